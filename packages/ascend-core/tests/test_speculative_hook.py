"""The model runners' proposer hook: registry first, vLLM's proposer otherwise."""

from types import SimpleNamespace

import pytest

from ascend_core.registry import SPECULATIVE_PROPOSERS
from ascend_core.worker.speculative import create_registered_proposer, install_registered_proposer


class VllmDrafter:
    pass


def make_runner(method):
    spec = SimpleNamespace(method=method)
    return SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec),
                           device="cpu", drafter=VllmDrafter())


@pytest.fixture
def registered_suffix():
    calls = []

    class OurSuffixProposer:
        def __init__(self, vllm_config, device, runner):
            calls.append((vllm_config, device, runner))

    SPECULATIVE_PROPOSERS.register("suffix", OurSuffixProposer)
    yield OurSuffixProposer, calls
    SPECULATIVE_PROPOSERS.unregister("suffix")


def test_registered_method_replaces_vllms_drafter(registered_suffix):
    proposer_cls, calls = registered_suffix
    runner = make_runner("suffix")
    assert install_registered_proposer(runner) == "ascend"
    assert isinstance(runner.drafter, proposer_cls)
    assert calls == [(runner.vllm_config, "cpu", runner)]


def test_unregistered_method_keeps_vllms_drafter(registered_suffix):
    runner = make_runner("ngram")
    assert install_registered_proposer(runner) == "vllm"
    assert isinstance(runner.drafter, VllmDrafter)


def test_no_speculation_means_no_proposer():
    config = SimpleNamespace(speculative_config=None)
    assert create_registered_proposer(config, "cpu", None) is None
    assert install_registered_proposer(SimpleNamespace(vllm_config=config)) == "none"
