"""vllm_proposer_deferred: vLLM's runner builds a placeholder, not its own proposer, for a
method with a registered one (and only then), and the lookup is restored afterwards."""

import sys
import types

import pytest

from ascend_core.registry import SPECULATIVE_PROPOSERS
from ascend_core.worker import speculative
from ascend_core.worker.speculative import PendingProposer, vllm_proposer_deferred


class VllmsProposer:
    def __init__(self, vllm_config):
        raise ImportError("needs a package that is not installed")


@pytest.fixture
def fake_runner_module(monkeypatch):
    module = types.ModuleType("fake_vllm_runner")
    module.SuffixDecodingProposer = VllmsProposer
    monkeypatch.setitem(sys.modules, "fake_vllm_runner", module)
    monkeypatch.setitem(speculative._VLLM_PROPOSER_LOOKUPS, "suffix",
                        ("fake_vllm_runner", "SuffixDecodingProposer"))
    return module


def config(method):
    return types.SimpleNamespace(speculative_config=types.SimpleNamespace(method=method))


def build_drafter(module, vllm_config):  # what vLLM's runner __init__ does
    return module.SuffixDecodingProposer(vllm_config)


def test_registered_method_gets_a_placeholder_while_the_runner_is_built(fake_runner_module):
    SPECULATIVE_PROPOSERS.register("suffix", object)
    try:
        with vllm_proposer_deferred(config("suffix")):
            drafter = build_drafter(fake_runner_module, config("suffix"))
        assert isinstance(drafter, PendingProposer)
        drafter.load_model(None)
        assert fake_runner_module.SuffixDecodingProposer is VllmsProposer
    finally:
        SPECULATIVE_PROPOSERS.unregister("suffix")


def test_unregistered_method_builds_vllms_proposer(fake_runner_module):
    assert "suffix" not in SPECULATIVE_PROPOSERS
    with pytest.raises(ImportError, match="needs a package"):
        with vllm_proposer_deferred(config("suffix")):
            build_drafter(fake_runner_module, config("suffix"))
    with vllm_proposer_deferred(types.SimpleNamespace(speculative_config=None)):
        pass
