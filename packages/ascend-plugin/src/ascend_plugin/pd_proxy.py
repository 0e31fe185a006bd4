"""A proxy in front of prefill and decode vLLM instances (prefill/decode disaggregation).

    python -m ascend_plugin.pd_proxy --prefill http://P1:8100 [...] \\
        --decode http://D1:8200 [...] --port 8000

Each ``/v1/completions`` or ``/v1/chat/completions`` request goes first to the least
loaded prefill instance with ``max_tokens`` 1 and ``kv_transfer_params:
{"do_remote_decode": true}``; that instance keeps the prompt's KV blocks and answers with
the ``kv_transfer_params`` that locate them. The request then goes, unchanged but for
those parameters, to the least loaded decode instance, which pulls the blocks and
generates the answer (streamed when the client asked for a stream). A backend that does
not answer or answers 5xx is taken out of rotation (until its ``/health`` answers again)
and the request is retried once on another instance of the same kind. A decode instance
that fails in the middle of a stream is replaced the same way: the request, extended by
what was already streamed (a completion's prompt and streamed token ids; a chat's text,
as a final assistant message to continue) and with the rest of its token budget, is
prefilled again and another decode instance continues the stream. ``/health`` and
``/metrics`` (Prometheus) describe the proxy and its backends.

Built on what vLLM's OpenAI server already installs: FastAPI, uvicorn and httpx.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import httpx
import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("ascend_plugin.pd_proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
KEEPALIVE_S = 2.0


@dataclass
class Backend:
    url: str
    role: str  # "prefill" or "decode"
    in_flight: int = 0
    served: int = 0
    healthy: bool = True
    last_error: str = ""

    def describe(self) -> dict:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "served": self.served, "last_error": self.last_error}


class NoBackend(RuntimeError):
    pass


class BackendFailed(RuntimeError):
    def __init__(self, backend: Backend, message: str):
        super().__init__(message)
        self.backend = backend


class Pool:
    """The instances of one kind; picks the least loaded healthy one."""

    def __init__(self, role: str, urls: Sequence[str]):
        self.role = role
        self.backends = [Backend(url.rstrip("/"), role) for url in urls]

    def pick(self, exclude: Sequence[Backend] = ()) -> Backend:
        candidates = [b for b in self.backends if b.healthy and b not in exclude]
        if not candidates:
            down = ", ".join(f"{b.url} ({b.last_error or 'excluded'})" for b in self.backends)
            raise NoBackend(f"no {self.role} instance can take the request: {down}")
        # Fewest requests in flight; among equals the one that served fewest (rotation).
        return min(candidates, key=lambda b: (b.in_flight, b.served))

    def healthy(self) -> bool:
        return any(b.healthy for b in self.backends)


class Metrics:
    def __init__(self):
        self.registry = prometheus_client.CollectorRegistry()
        labels = ["role", "backend"]
        self.requests = prometheus_client.Counter(
            "pd_proxy_requests", "Client requests by endpoint and outcome.",
            ["endpoint", "status"], registry=self.registry)
        self.backend_requests = prometheus_client.Counter(
            "pd_proxy_backend_requests", "Requests sent to each backend.", labels,
            registry=self.registry)
        self.backend_failures = prometheus_client.Counter(
            "pd_proxy_backend_failures", "Backend answers that took it out of rotation.",
            labels, registry=self.registry)
        self.retries = prometheus_client.Counter(
            "pd_proxy_retries", "Requests retried on another instance.", ["role"],
            registry=self.registry)
        self.in_flight = prometheus_client.Gauge(
            "pd_proxy_backend_in_flight", "Requests in flight per backend.", labels,
            registry=self.registry)
        self.healthy = prometheus_client.Gauge(
            "pd_proxy_backend_healthy", "1 while a backend is in rotation.", labels,
            registry=self.registry)


class PDProxy:
    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], *,
                 timeout_s: float = 600.0, health_interval_s: float = 5.0,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.prefill = Pool("prefill", prefill_urls)
        self.decode = Pool("decode", decode_urls)
        self.health_interval_s = health_interval_s
        # Idle connections are dropped well before vLLM's server closes them (uvicorn's
        # keep-alive of VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request sent on a connection
        # the server is closing fails with a ReadError that would look like a dead backend.
        self.client = httpx.AsyncClient(
            transport=transport, timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_S))
        self.metrics = Metrics()
        for backend in self.backends():
            self.metrics.healthy.labels(backend.role, backend.url).set(1)

    def backends(self) -> list[Backend]:
        return self.prefill.backends + self.decode.backends

    def _take_out(self, backend: Backend, why: str) -> None:
        if backend.healthy:
            logger.warning("pd_proxy: %s instance %s out of rotation: %s", backend.role,
                           backend.url, why)
        backend.healthy = False
        backend.last_error = why
        self.metrics.backend_failures.labels(backend.role, backend.url).inc()
        self.metrics.healthy.labels(backend.role, backend.url).set(0)

    def _start(self, backend: Backend) -> None:
        backend.in_flight += 1
        backend.served += 1
        self.metrics.backend_requests.labels(backend.role, backend.url).inc()
        self.metrics.in_flight.labels(backend.role, backend.url).inc()

    def _end(self, backend: Backend) -> None:
        backend.in_flight -= 1
        self.metrics.in_flight.labels(backend.role, backend.url).dec()

    async def _open(self, backend: Backend, path: str, body: dict) -> httpx.Response:
        """A streamed response with a non-5xx status, or BackendFailed."""
        try:
            reply = await self.client.send(
                self.client.build_request("POST", backend.url + path, json=body), stream=True)
        except httpx.HTTPError as err:
            raise BackendFailed(backend, f"{type(err).__name__}: {err}") from err
        if reply.status_code >= 500:
            text = (await reply.aread()).decode(errors="replace")[:300]
            await reply.aclose()
            raise BackendFailed(backend, f"HTTP {reply.status_code}: {text}")
        return reply

    async def _send(self, pool: Pool, path: str, body: dict) -> tuple[Backend, httpx.Response]:
        """Open a request on the least loaded instance, retrying once on another; the
        caller ends the backend (``_end``) and closes the response."""
        tried: list[Backend] = []
        while True:
            backend = pool.pick(exclude=tried)
            self._start(backend)
            try:
                return backend, await self._open(backend, path, body)
            except BackendFailed as err:
                self._end(backend)
                self._take_out(backend, str(err))
                tried.append(backend)
                if len(tried) > 1:
                    raise
                self.metrics.retries.labels(pool.role).inc()

    async def _prefill(self, path: str, body: dict) -> dict | Response:
        """The kv_transfer_params of a one-token prefill, or a response to return as is."""
        request = {**body, "max_tokens": 1, "stream": False,
                   "kv_transfer_params": {"do_remote_decode": True}}
        request.pop("stream_options", None)
        if "max_completion_tokens" in request:
            request["max_completion_tokens"] = 1
        backend, reply = await self._send(self.prefill, path, request)
        try:
            content = await reply.aread()
        finally:
            await reply.aclose()
            self._end(backend)
        if reply.status_code != 200:  # the client's request was refused: say so
            return Response(content, status_code=reply.status_code,
                            media_type=reply.headers.get("content-type"))
        params = json.loads(content).get("kv_transfer_params")
        if not params:
            raise BackendFailed(backend, f"the prefill instance {backend.url} answered without "
                                         f"kv_transfer_params: start it with --kv-transfer-config "
                                         f"and kv_role kv_producer")
        return params

    async def _prefill_then_decode(self, path: str, body: dict
                                   ) -> tuple[Backend, httpx.Response] | Response:
        """The decode instance's open response, or a response to return as is."""
        params = await self._prefill(path, body)
        if isinstance(params, Response):
            return params
        return await self._send(self.decode, path, {**body, "kv_transfer_params": params})

    async def forward(self, path: str, body: dict) -> Response:
        if body.get("stream"):
            decode_body = {**body, "stream_options": {
                **(body.get("stream_options") or {}), "include_usage": True,
                "continuous_usage_stats": True}}
            if not path.endswith("/chat/completions"):
                decode_body["return_token_ids"] = True  # a continuation resumes from these
        else:
            decode_body = body
        opened = await self._prefill_then_decode(path, decode_body)
        if isinstance(opened, Response):
            return opened
        backend, reply = opened
        media_type = reply.headers.get("content-type")
        if not body.get("stream") or reply.status_code != 200:
            try:
                content = await reply.aread()
            finally:
                await reply.aclose()
                self._end(backend)
            return Response(content, status_code=reply.status_code, media_type=media_type)
        return StreamingResponse(self._relay(path, body, decode_body, backend, reply),
                                 status_code=200, media_type=media_type)

    async def _relay(self, path: str, body: dict, decode_body: dict, backend: Backend,
                     reply: httpx.Response) -> AsyncIterator[bytes]:
        """Relay a decode instance's event stream. If that instance fails mid-stream, it
        leaves rotation and another one continues the answer once (prompt plus the text
        already streamed, the token budget less the tokens already streamed)."""
        stream = StreamState(path, body)
        retried = False
        while True:
            try:
                async for event in _events(reply):
                    out = stream.take(event)
                    if out is not None:
                        yield out
                if stream.done:
                    return
                failure = "the event stream ended before [DONE]"
            except httpx.HTTPError as err:
                failure = f"{type(err).__name__} mid-stream: {err}"
            finally:
                await reply.aclose()
                self._end(backend)
            self._take_out(backend, failure)
            rest = stream.continuation(decode_body)
            if retried or rest is None:
                why = "retried once already" if retried else "the request cannot be continued"
                yield stream.error(f"decode instance {backend.url} failed: {failure} ({why})")
                return
            if rest == "complete":
                yield stream.finish()
                return
            retried = True
            self.metrics.retries.labels("decode").inc()
            logger.warning("pd_proxy: continuing a stream on another decode instance after "
                           "%d streamed tokens: %s failed: %s", stream.tokens, backend.url,
                           failure)
            try:
                opened = await self._prefill_then_decode(path, rest)
            except (NoBackend, BackendFailed) as err:
                yield stream.error(str(err))
                return
            if isinstance(opened, Response) or opened[1].status_code != 200:
                if not isinstance(opened, Response):
                    await opened[1].aclose()
                    self._end(opened[0])
                yield stream.error("the continuation of the stream was refused")
                return
            backend, reply = opened
            stream.continuing()

    async def check_health_once(self) -> None:
        """Put instances whose /health answers 200 back into rotation."""
        for backend in self.backends():
            if backend.healthy:
                continue
            with contextlib.suppress(httpx.HTTPError):
                reply = await self.client.get(backend.url + "/health", timeout=5.0)
                if reply.status_code == 200:
                    logger.info("pd_proxy: %s instance %s back in rotation", backend.role,
                                backend.url)
                    backend.healthy = True
                    backend.last_error = ""
                    self.metrics.healthy.labels(backend.role, backend.url).set(1)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self.check_health_once()

    def app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            watcher = asyncio.create_task(self._watch_health())
            try:
                yield
            finally:
                watcher.cancel()
                await self.client.aclose()

        app = FastAPI(title="ascend-plugin prefill/decode proxy", lifespan=lifespan)

        async def handle(request: Request) -> Response:
            endpoint = request.url.path
            try:
                body = await request.json()
            except ValueError:
                body = None
            if not isinstance(body, dict):
                self.metrics.requests.labels(endpoint, "400").inc()
                return JSONResponse({"error": "the request body must be a JSON object"}, 400)
            try:
                response = await self.forward(endpoint, body)
            except (NoBackend, BackendFailed) as err:
                logger.error("pd_proxy: %s failed: %s", endpoint, err)
                response = JSONResponse({"error": str(err)}, 502)
            self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
            return response

        for route in ROUTES:
            app.add_api_route(route, handle, methods=["POST"])

        @app.get("/health")
        async def health() -> Response:
            ok = self.prefill.healthy() and self.decode.healthy()
            return JSONResponse({"prefill": [b.describe() for b in self.prefill.backends],
                                 "decode": [b.describe() for b in self.decode.backends]},
                                status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(prometheus_client.generate_latest(self.metrics.registry),
                            media_type=prometheus_client.CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> Response:
            backend, reply = await self._send_get(self.decode, "/v1/models")
            return Response(reply.content, status_code=reply.status_code,
                            media_type=reply.headers.get("content-type"))

        return app

    async def _send_get(self, pool: Pool, path: str) -> tuple[Backend, httpx.Response]:
        backend = pool.pick()
        try:
            return backend, await self.client.get(backend.url + path)
        except httpx.HTTPError as err:
            self._take_out(backend, f"{type(err).__name__}: {err}")
            raise BackendFailed(backend, str(err)) from err


async def _events(reply: httpx.Response) -> AsyncIterator[bytes]:
    """The server-sent events of a response, one ``data: ...`` event at a time."""
    buffer = b""
    async for chunk in reply.aiter_bytes():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            if event.strip():
                yield event


class StreamState:
    """What a relayed stream has sent so far: its text, its tokens, its first id.

    Decode instances are asked for usage in every event (``continuous_usage_stats``),
    which counts the tokens streamed, and completions for their token ids
    (``return_token_ids``), from which a continuation resumes exactly; the client sees
    usage and token ids only as it asked for them."""

    def __init__(self, path: str, body: dict):
        self.chat = path.endswith("/chat/completions")
        asked = body.get("stream_options") or {}
        self.usage_wanted = bool(asked.get("include_usage"))
        self.usage_each_event = self.usage_wanted and bool(asked.get("continuous_usage_stats"))
        self.ids_wanted = bool(body.get("return_token_ids"))
        self.text = ""
        self.prompt_token_ids: list[int] | None = None  # completions: the prompt's tokens
        self.token_ids: list[int] = []  # completions: the tokens streamed
        self.tokens = 0  # completion tokens streamed, over every decode instance
        self.earlier_tokens = 0  # of those, streamed by instances that failed
        self.prompt_tokens: int | None = None
        self.first: dict | None = None  # id, created, model of the first event
        self.done = False
        self.finished = False  # a choice ended (finish_reason) before a failure

    def continuing(self) -> None:
        self.earlier_tokens = self.tokens

    def _usage(self, usage: dict) -> dict:
        if self.prompt_tokens is None:
            self.prompt_tokens = usage.get("prompt_tokens", 0)
        completion = self.earlier_tokens + (usage.get("completion_tokens") or 0)
        return {**usage, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": self.prompt_tokens + completion}

    def take(self, event: bytes) -> bytes | None:
        """The event to send to the client (None: drop it)."""
        if not event.startswith(b"data: "):
            return event + b"\n\n"
        data = event[6:].strip()
        if data == b"[DONE]":
            self.done = True
            return b"data: [DONE]\n\n"
        try:
            payload = json.loads(data)
        except ValueError:
            return event + b"\n\n"
        if not isinstance(payload, dict) or "choices" not in payload:
            return event + b"\n\n"  # an error event: pass it on
        if self.first is None:
            self.first = {k: payload[k] for k in ("id", "created") if k in payload}
        elif self.earlier_tokens:
            payload.update(self.first)  # a continuation keeps the stream's id
        usage = payload.get("usage")
        if usage:
            usage = self._usage(usage)
            self.tokens = usage["completion_tokens"]
        choices = payload["choices"]
        for choice in choices:
            self._take_token_ids(choice)
            piece = (choice.get("delta") or {}).get("content") if self.chat else \
                choice.get("text")
            self.text += piece or ""
            if piece and not usage:  # an instance that does not count: one per piece
                self.tokens += 1
            self.finished = self.finished or bool(choice.get("finish_reason"))
        if self.earlier_tokens and self.chat and all(
                not (c.get("delta") or {}).get("content") and not c.get("finish_reason")
                for c in choices) and choices:
            return None  # the continuation's opening role event
        if not choices:  # the closing usage event
            if not self.usage_wanted:
                return None
            payload["usage"] = usage
        elif self.usage_each_event:
            payload["usage"] = usage
        else:
            payload.pop("usage", None)
        return b"data: " + json.dumps(payload).encode() + b"\n\n"

    def _take_token_ids(self, choice: dict) -> None:
        if self.chat:
            return
        prompt_ids = choice.pop("prompt_token_ids", None)
        if prompt_ids and self.prompt_token_ids is None:
            self.prompt_token_ids = list(prompt_ids)
            if self.ids_wanted:  # only the first instance's: a continuation's is longer
                choice["prompt_token_ids"] = prompt_ids
        self.token_ids.extend(choice.get("token_ids") or ())
        if not self.ids_wanted:
            choice.pop("token_ids", None)

    def continuation(self, body: dict) -> dict | str | None:
        """The request that continues ``body`` after what was streamed; "complete" when
        nothing is left to generate; None when it cannot be continued (several choices
        or prompts, echo)."""
        if self.finished:
            return "complete"
        if body.get("n", 1) != 1 or body.get("echo"):
            return None
        rest = {**body}
        for key in ("max_tokens", "max_completion_tokens"):
            if rest.get(key) is not None:
                rest[key] -= self.tokens
                if rest[key] <= 0:
                    return "complete"
        if self.chat:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            rest["messages"] = [*messages, {"role": "assistant", "content": self.text}]
            rest["continue_final_message"] = True
            rest["add_generation_prompt"] = False
        elif self.prompt_token_ids is not None:
            # The prompt's tokens and those streamed: the text re-tokenized could part
            # differently ("\n\n" as one token or two) and the answer with it.
            rest["prompt"] = self.prompt_token_ids + self.token_ids
        elif isinstance(body.get("prompt"), str):
            rest["prompt"] = body["prompt"] + self.text  # an instance without token ids
        else:
            return None
        return rest

    def finish(self) -> bytes:
        return b"data: [DONE]\n\n"

    def error(self, message: str) -> bytes:
        logger.error("pd_proxy: stream failed: %s", message)
        error = {"error": {"message": message, "type": "BadGateway", "code": 502}}
        return b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n"


def _url(value: str) -> str:
    if not value.startswith(("http://", "https://")):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a URL: expected one such as http://127.0.0.1:8100")
    return value


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ascend_plugin.pd_proxy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", type=_url, required=True,
                        help="base URLs of the prefill (kv_producer) instances")
    parser.add_argument("--decode", nargs="+", type=_url, required=True,
                        help="base URLs of the decode (kv_consumer) instances")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds a backend may take to answer (default 600)")
    parser.add_argument("--health-interval", type=float, default=5.0,
                        help="seconds between /health probes of instances out of rotation")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    proxy = PDProxy(args.prefill, args.decode, timeout_s=args.timeout,
                    health_interval_s=args.health_interval)
    logger.info("pd_proxy on http://%s:%d: prefill %s, decode %s", args.host, args.port,
                args.prefill, args.decode)
    uvicorn.run(proxy.app(), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
