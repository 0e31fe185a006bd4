"""The draft-length benchmark's load: N concurrent clients, each sending its requests one
after another (``--requests-per-client``), against a stand-in for the ``openai`` client."""

import asyncio
import sys
import types
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_draft_length  # noqa: E402


class _Chunk:
    def __init__(self, text=None, tokens=None):
        self.choices = [types.SimpleNamespace(text=text)] if text else []
        self.usage = types.SimpleNamespace(completion_tokens=tokens) if tokens else None


class _Server:
    """Streams three tokens per request; records the prompts in order, each one's
    ``max_tokens`` and the most requests in flight at once."""

    def __init__(self):
        self.sent, self.lengths, self.in_flight, self.most = [], {}, 0, 0

    async def stream(self, prompt, max_tokens):
        self.sent.append(prompt)
        self.lengths[prompt] = max_tokens
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        for _ in range(3):
            await asyncio.sleep(0.001)
            yield _Chunk(text="x")
        self.in_flight -= 1
        yield _Chunk(tokens=3)


def _fake_openai(monkeypatch, server):
    class Completions:
        async def create(self, *, prompt, max_tokens, **_):
            return server.stream(prompt, max_tokens)

    class AsyncOpenAI:
        def __init__(self, **_):
            self.completions = Completions()

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc):
            return False

    monkeypatch.setitem(sys.modules, "openai", types.SimpleNamespace(AsyncOpenAI=AsyncOpenAI))


def test_each_client_sends_its_requests_one_after_another(monkeypatch):
    server = _Server()
    _fake_openai(monkeypatch, server)
    prompts = [f"p{i}" for i in range(6)]
    result = asyncio.run(bench_draft_length.one_round("http://x", "m", prompts, clients=2))
    assert server.most == 2  # never more requests in flight than clients
    assert sorted(server.sent) == prompts and result["tokens"] == 18
    # Client 0 sends p0, p2, p4 in that order, client 1 p1, p3, p5.
    assert [p for p in server.sent if p in ("p0", "p2", "p4")] == ["p0", "p2", "p4"]
    assert [p for p in server.sent if p in ("p1", "p3", "p5")] == ["p1", "p3", "p5"]
    assert len(result["ttft"]) == 6


def test_one_request_per_client_is_one_closed_batch(monkeypatch):
    server = _Server()
    _fake_openai(monkeypatch, server)
    asyncio.run(bench_draft_length.one_round("http://x", "m", ["a", "b", "c"], clients=3))
    assert server.most == 3


def test_spread_lengths_go_with_their_prompts_and_keep_the_mean(monkeypatch):
    server = _Server()
    _fake_openai(monkeypatch, server)
    prompts = [f"p{i}" for i in range(5)]
    lengths = bench_draft_length.output_lengths(5, 64)
    assert lengths == [64, 96, 128, 160, 192]
    asyncio.run(bench_draft_length.one_round("http://x", "m", prompts, clients=2,
                                             max_tokens=lengths))
    assert server.lengths == dict(zip(prompts, lengths))
    assert bench_draft_length.output_lengths(4, 0) == [128] * 4
    # Without lengths every request asks for the benchmark's 128.
    asyncio.run(bench_draft_length.one_round("http://x", "m", ["q"], clients=1))
    assert server.lengths["q"] == 128


def test_a_spread_that_leaves_no_tokens_is_refused_in_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_draft_length.py", "--max-tokens-spread", "128"])
    with pytest.raises(SystemExit) as stop:
        bench_draft_length.main()
    assert stop.value.code == 2
    assert "--max-tokens-spread is 128" in capsys.readouterr().err
