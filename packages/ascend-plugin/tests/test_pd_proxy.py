"""The prefill/decode proxy against fake backends (httpx's mock transport): the two-step
request, streaming, least-loaded choice, retry and rotation, /health and /metrics."""

from __future__ import annotations

import asyncio
import json

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
