"""The draft-length histogram: what the stat-logger plugin observes per step, and reading it
back from /metrics text."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, generate_latest  # noqa: E402

from ascend_plugin import serving  # noqa: E402
from ascend_plugin.stat_logger import DraftLengthStatLogger  # noqa: E402
from ascend_specdec.metrics import DRAFT_LENGTH  # noqa: E402


def config(k):
    spec = None if k is None else SimpleNamespace(num_speculative_tokens=k)
    return SimpleNamespace(speculative_config=spec)


def stats(per_pos, drafts, running):
    spec = SimpleNamespace(num_draft_tokens_per_pos=per_pos, num_drafts=drafts)
    return SimpleNamespace(spec_decoding_stats=spec if per_pos is not None else None,
                           num_running_reqs=running)


def sample(engine, le):
    return REGISTRY.get_sample_value(DRAFT_LENGTH + "_bucket", {"engine": engine, "le": le})


def test_each_request_of_each_step_is_observed_at_its_length(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "host")
    logger = DraftLengthStatLogger(config(3), engine_index=7)
    logger.record(stats([2, 1, 1], drafts=2, running=3), None)  # lengths 3, 1 and one 0
    logger.record(stats(None, 0, running=2), None)  # the controller chose none: two 0s
    assert [sample("7", le) for le in ("0.0", "1.0", "2.0", "3.0")] == [3, 4, 4, 5]
    text = generate_latest(REGISTRY).decode()
    monkeypatch.setattr(serving.urllib.request, "urlopen", lambda *a, **k: Reply(text))
    assert serving.histogram_counts("http://x", DRAFT_LENGTH) == {0: 3, 1: 1, 2: 0, 3: 1}


def test_nothing_is_observed_without_speculation_or_with_the_plugin_inactive(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "host")
    assert DraftLengthStatLogger(config(None), engine_index=8).histogram is None
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "auto")  # no NPU here: inactive
    logger = DraftLengthStatLogger(config(3), engine_index=9)
    assert logger.histogram is None
    logger.record(stats([1], drafts=1, running=1), None)
    assert sample("9", "3.0") is None


class Reply:
    def __init__(self, text):
        self.text = text

    def read(self):
        return self.text.encode()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
