"""The prefill/decode proxy against fake backends (httpx's mock transport): the two-step
request, streaming, least-loaded choice, retry and rotation, /health and /metrics."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from ascend_plugin.pd_proxy import PDProxy, parse_args

PREFILLS = ["http://p1:8100", "http://p2:8100"]
DECODES = ["http://d1:8200", "http://d2:8200"]


class Backends:
    """Fake vLLM instances: prefill answers one token and kv_transfer_params, decode
    answers (or streams) text naming who prefilled."""

    def __init__(self):
        self.seen: list[tuple[str, str, dict]] = []  # (url, path, body)
        self.down: set[str] = set()  # hosts that refuse connections
        self.broken: set[str] = set()  # hosts that answer 500
        self.hold: asyncio.Event | None = None  # decode answers wait for it

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}:{request.url.port}"
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/health":
            return httpx.Response(200 if host not in self.broken else 500)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": f"model on {host}"}]})
        if host in self.broken:
            return httpx.Response(500, text="engine dead")
        body = json.loads(request.content)
        self.seen.append((host, request.url.path, body))
        if host.startswith("http://p"):
            if body.get("prompt") == "refuse me":
                return httpx.Response(400, json={"error": "bad prompt"})
            params = None if body.get("prompt") == "no params" else {
                "do_remote_prefill": True, "remote_host": host, "remote_block_ids": [1]}
            return httpx.Response(200, json={"choices": [{"text": "x"}],
                                             "kv_transfer_params": params})
        if self.hold is not None:
            await self.hold.wait()
        text = f"decoded by {host} after {body['kv_transfer_params']['remote_host']}"
        if body.get("stream"):
            chunks = [f"data: {json.dumps({'choices': [{'text': part}]})}\n\n".encode()
                      for part in text.split()] + [b"data: [DONE]\n\n"]
            return httpx.Response(200, headers={"content-type": "text/event-stream"},
                                  content=b"".join(chunks))
        return httpx.Response(200, json={"choices": [{"text": text}]})

    def bodies(self, prefix: str) -> list[dict]:
        return [body for host, _, body in self.seen if host.startswith(prefix)]


def run(coro):
    return asyncio.run(coro)


def make(backends: Backends, prefills=PREFILLS, decodes=DECODES) -> tuple[PDProxy,
                                                                            httpx.AsyncClient]:
    proxy = PDProxy(prefills, decodes, transport=httpx.MockTransport(backends))
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=proxy.app()),
                               base_url="http://proxy")
    return proxy, client


def test_a_completion_is_prefilled_for_one_token_then_decoded_with_its_params():
    backends = Backends()

    async def go():
        _, client = make(backends)
        reply = await client.post("/v1/completions", json={
            "model": "m", "prompt": "def f():", "max_tokens": 24, "temperature": 0})
        return reply

    reply = run(go())
    assert reply.status_code == 200
    (prefill,) = backends.bodies("http://p")
    (decode,) = backends.bodies("http://d")
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert decode["max_tokens"] == 24 and decode["prompt"] == "def f():"
    assert decode["kv_transfer_params"]["remote_host"] == "http://p1:8100"
    assert reply.json()["choices"][0]["text"] == "decoded by http://d1:8200 after http://p1:8100"


def test_a_streamed_chat_streams_from_decode_and_prefill_does_not_stream():
    backends = Backends()

    async def go():
        _, client = make(backends)
        return await client.post("/v1/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}})

    reply = run(go())
    (prefill,) = backends.bodies("http://p")
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert prefill["max_completion_tokens"] == 1 and prefill["max_tokens"] == 1
    (decode,) = backends.bodies("http://d")
    assert decode["stream"] is True and decode["max_completion_tokens"] == 9
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    words = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
    assert " ".join(words) == "decoded by http://d1:8200 after http://p1:8100"


def test_concurrent_requests_go_to_the_least_loaded_instances():
    backends = Backends()

    async def go():
        proxy, client = make(backends)
        backends.hold = asyncio.Event()
        body = {"model": "m", "prompt": "p", "max_tokens": 4}
        first = asyncio.create_task(client.post("/v1/completions", json=body))
        while not proxy.decode.backends[0].in_flight:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(client.post("/v1/completions", json=body))
        while not proxy.decode.backends[1].in_flight:
            await asyncio.sleep(0.01)
        in_flight = [b.in_flight for b in proxy.decode.backends]
        backends.hold.set()
        replies = await asyncio.gather(first, second)
        return in_flight, replies, proxy

    in_flight, replies, proxy = run(go())
    assert in_flight == [1, 1]
    texts = sorted(r.json()["choices"][0]["text"] for r in replies)
    assert texts == ["decoded by http://d1:8200 after http://p1:8100",
                     "decoded by http://d2:8200 after http://p2:8100"]
    assert [b.in_flight for b in proxy.backends()] == [0, 0, 0, 0]


def test_a_dead_instance_leaves_rotation_the_request_is_retried_and_it_comes_back():
    backends = Backends()
    backends.down.add("http://p1:8100")
    backends.broken.add("http://d1:8200")

    async def go():
        proxy, client = make(backends)
        body = {"model": "m", "prompt": "p", "max_tokens": 4}
        first = await client.post("/v1/completions", json=body)
        health = await client.get("/health")
        second = await client.post("/v1/completions", json=body)
        metrics = (await client.get("/metrics")).text
        backends.down.clear()
        backends.broken.clear()
        await proxy.check_health_once()
        healed = await client.get("/health")
        return first, health, second, metrics, healed

    first, health, second, metrics, healed = run(go())
    assert first.json()["choices"][0]["text"] == \
        "decoded by http://d2:8200 after http://p2:8100"
    state = {b["url"]: b["healthy"] for side in health.json().values() for b in side}
    assert state == {"http://p1:8100": False, "http://p2:8100": True,
                     "http://d1:8200": False, "http://d2:8200": True}
    assert health.status_code == 200  # one of each kind is still up
    assert "ConnectError" in health.json()["prefill"][0]["last_error"]
    assert "HTTP 500: engine dead" in health.json()["decode"][0]["last_error"]
    # Out of rotation: the second request is not tried on them at all.
    assert [host for host, _, _ in backends.seen] == ["http://p2:8100", "http://d2:8200"] * 2
    assert second.status_code == 200
    assert 'pd_proxy_retries_total{role="prefill"} 1.0' in metrics
    assert 'pd_proxy_retries_total{role="decode"} 1.0' in metrics
    assert ('pd_proxy_backend_failures_total{backend="http://p1:8100",role="prefill"} 1.0'
            in metrics)
    assert 'pd_proxy_requests_total{endpoint="/v1/completions",status="200"} 2.0' in metrics
    assert all(b["healthy"] for side in healed.json().values() for b in side)


def test_when_every_instance_of_a_kind_fails_the_client_gets_a_502_naming_them():
    backends = Backends()
    backends.broken.update(DECODES)

    async def go():
        _, client = make(backends)
        reply = await client.post("/v1/completions", json={"model": "m", "prompt": "p"})
        return reply, await client.get("/health")

    reply, health = run(go())
    assert reply.status_code == 502
    assert "HTTP 500: engine dead" in reply.json()["error"]
    assert health.status_code == 503


def test_client_errors_pass_through_and_a_prefill_without_params_is_named():
    backends = Backends()

    async def go():
        _, client = make(backends, prefills=PREFILLS[:1])
        refused = await client.post("/v1/completions", json={"model": "m",
                                                              "prompt": "refuse me"})
        no_params = await client.post("/v1/completions", json={"model": "m",
                                                                "prompt": "no params"})
        not_json = await client.post("/v1/completions", content=b"[1, 2")
        return refused, no_params, not_json

    refused, no_params, not_json = run(go())
    assert refused.status_code == 400 and refused.json() == {"error": "bad prompt"}
    assert not backends.bodies("http://d")  # nothing went on to decode
    assert no_params.status_code == 502
    assert ("the prefill instance http://p1:8100 answered without kv_transfer_params"
            in no_params.json()["error"])
    assert not_json.status_code == 400


def test_models_are_listed_by_a_decode_instance():
    async def go():
        _, client = make(Backends())
        return await client.get("/v1/models")

    assert run(go()).json() == {"data": [{"id": "model on http://d1:8200"}]}


def test_backend_urls_are_checked():
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "p1:8100", "--decode", "http://d1:8200"])
    args = parse_args(["--prefill", *PREFILLS, "--decode", DECODES[0], "--port", "9000"])
    assert args.prefill == PREFILLS and args.decode == DECODES[:1] and args.port == 9000


class Generating(Backends):
    """Decode instances that stream the words w0 w1 w2 ..., one per event with usage as
    vLLM counts it, continuing a prompt that already ends in some of them (as a model
    would); ``cut[host] = n`` makes that host fail after its n-th event."""

    def __init__(self):
        super().__init__()
        self.cut: dict[str, int] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}:{request.url.port}"
        if not host.startswith("http://d") or request.url.path == "/health" or \
                host in self.down | self.broken:
            return await super().__call__(request)
        body = json.loads(request.content)
        self.seen.append((host, request.url.path, body))
        chat = request.url.path.endswith("/chat/completions")
        context = body["messages"][-1]["content"] if chat else body["prompt"]
        # Word wK is token 1000 + K; a text prompt is tokens 1, 2.
        start = len(re.findall(r"w\d+", context)) if isinstance(context, str) else \
            sum(token >= 1000 for token in context)
        ids = not chat and body.get("return_token_ids")
        budget = body.get("max_completion_tokens") or body["max_tokens"]
        options = body.get("stream_options") or {}

        def event(index: int, piece: str, finish: str | None) -> bytes:
            choice = {"index": 0, "finish_reason": finish}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            if ids:
                choice["token_ids"] = [1000 + start + index]
                if index == 0:
                    choice["prompt_token_ids"] = [1, 2] if isinstance(context, str) else \
                        context
            payload = {"id": f"cmpl-{host}", "created": 1, "choices": [choice]}
            if options.get("continuous_usage_stats"):
                payload["usage"] = {"prompt_tokens": 5, "completion_tokens": index + 1,
                                    "total_tokens": 6 + index}
            return f"data: {json.dumps(payload)}\n\n".encode()

        async def stream():
            if chat:
                opening = {"id": f"cmpl-{host}", "created": 1,
                           "choices": [{"index": 0, "delta": {"role": "assistant",
                                                               "content": ""}}]}
                yield f"data: {json.dumps(opening)}\n\n".encode()
            for index in range(budget):
                if self.cut.get(host) == index:
                    raise httpx.ReadError("peer closed connection", request=request)
                word = f"w{start + index}"
                piece = word if start + index == 0 else " " + word
                yield event(index, piece, "length" if index == budget - 1 else None)
            if options.get("include_usage"):
                usage = {"prompt_tokens": 5, "completion_tokens": budget,
                         "total_tokens": 5 + budget}
                yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n" \
                    .encode()
            yield b"data: [DONE]\n\n"

        return httpx.Response(200, headers={"content-type": "text/event-stream"},
                              content=stream())


def events_of(reply: httpx.Response) -> list[dict]:
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_decode_instance_that_dies_mid_stream_is_replaced_keeping_the_streamed_text(path):
    backends = Generating()
    backends.cut["http://d1:8200"] = 3
    chat = path.endswith("chat/completions")
    body = {"model": "m", "max_tokens": 7, "stream": True,
            "stream_options": {"include_usage": True}}
    body.update({"messages": [{"role": "user", "content": "count"}]} if chat else
                {"prompt": "count:"})

    async def go():
        proxy, client = make(backends)
        reply = await client.post(path, json=body)
        return reply, (await client.get("/metrics")).text, proxy

    reply, metrics, proxy = run(go())
    events = events_of(reply)
    pieces = [(c.get("delta") or {}).get("content", "") if chat else c["text"]
              for e in events for c in e["choices"]]
    assert "".join(pieces) == "w0 w1 w2 w3 w4 w5 w6"
    # One stream to the client: one id, usage only at the end (as asked), counted in full.
    assert {e["id"] for e in events} == {"cmpl-http://d1:8200"}
    assert [e.get("usage") for e in events[:-1]] == [None] * (len(events) - 1)
    assert events[-1]["usage"]["completion_tokens"] == 7
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    # The second decode instance continued: prompt plus the 3 streamed words, 4 to go,
    # after a new prefill of that prompt.
    first, second = backends.bodies("http://d")
    assert first["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert second["max_tokens"] == 4
    if chat:
        assert second["messages"][-1] == {"role": "assistant", "content": "w0 w1 w2"}
        assert second["continue_final_message"] is True
        assert second["add_generation_prompt"] is False
    else:  # exactly the tokens: the prompt's and the three streamed
        assert second["prompt"] == [1, 2, 1000, 1001, 1002]
        assert first["return_token_ids"] is True and "return_token_ids" not in body
        assert all("token_ids" not in c and "prompt_token_ids" not in c
                   for e in events for c in e["choices"])
    assert [b["prompt" if not chat else "messages"] for b in backends.bodies("http://p")] \
        == [body.get("prompt", body.get("messages")), second.get("prompt",
                                                                 second.get("messages"))]
    assert not proxy.decode.backends[0].healthy
    assert "ReadError mid-stream" in proxy.decode.backends[0].last_error
    assert 'pd_proxy_retries_total{role="decode"} 1.0' in metrics
    assert [b.in_flight for b in proxy.backends()] == [0, 0, 0, 0]


def test_a_stream_that_fails_twice_ends_with_an_error_event_not_a_hang():
    backends = Generating()
    backends.cut.update({"http://d1:8200": 2, "http://d2:8200": 1})

    async def go():
        _, client = make(backends)
        return await client.post("/v1/completions", json={
            "model": "m", "prompt": "p", "max_tokens": 6, "stream": True})

    events = events_of(run(go()))
    assert "".join(c["text"] for e in events[:-1] for c in e["choices"]) == "w0 w1 w2"
    assert all("usage" not in e for e in events[:-1])  # the client did not ask for usage
    assert events[-1]["error"]["code"] == 502
    assert "decode instance http://d2:8200 failed: ReadError mid-stream" in \
        events[-1]["error"]["message"]
    assert "retried once already" in events[-1]["error"]["message"]


def test_a_client_that_asks_for_token_ids_gets_them_across_a_continuation():
    backends = Generating()
    backends.cut["http://d1:8200"] = 2

    async def go():
        _, client = make(backends)
        return await client.post("/v1/completions", json={
            "model": "m", "prompt": "p", "max_tokens": 5, "stream": True,
            "return_token_ids": True})

    choices = [c for e in events_of(run(go())) for c in e["choices"]]
    assert [t for c in choices for t in c["token_ids"]] == [1000, 1001, 1002, 1003, 1004]
    # The prompt's ids once, as the first instance saw them; not the continuation's.
    assert [c["prompt_token_ids"] for c in choices if "prompt_token_ids" in c] == [[1, 2]]
