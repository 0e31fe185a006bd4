"""The model runners' rejection-sampler hook: the registered "ascend" sampler replaces vLLM's,
vLLM's stays when none is registered or the factory declines."""

import logging
from types import SimpleNamespace

import pytest

from ascend_core.registry import REJECTION_SAMPLERS, Registry
from ascend_core.worker.speculative import (
    REJECTION_SAMPLER_NAME,
    install_registered_rejection_sampler,
)


class VllmRejectionSampler:
    pass


def make_runner():
    spec = SimpleNamespace(method="ngram", rejection_sample_method="standard")
    return SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=spec),
                           sampler=object(), device="cpu",
                           rejection_sampler=VllmRejectionSampler())


@pytest.fixture
def without_ascend_entry():
    # ascend-specdec may have registered ours in this process; set it aside.
    saved = REJECTION_SAMPLERS._entries.pop(REJECTION_SAMPLER_NAME, None)
    yield
    REJECTION_SAMPLERS._entries.pop(REJECTION_SAMPLER_NAME, None)
    if saved is not None:
        REJECTION_SAMPLERS.register(REJECTION_SAMPLER_NAME, saved)


@pytest.fixture
def registered(without_ascend_entry):
    calls = []

    class OurSampler:
        def __init__(self, sampler, spec_config, device):
            calls.append((sampler, spec_config, device))

    REJECTION_SAMPLERS.register(REJECTION_SAMPLER_NAME, OurSampler)
    return OurSampler, calls


def test_registry_is_a_named_registry():
    assert isinstance(REJECTION_SAMPLERS, Registry)
    assert REJECTION_SAMPLERS.kind == "rejection sampler"


def test_registered_sampler_replaces_vllms(registered, caplog):
    sampler_cls, calls = registered
    runner = make_runner()
    with caplog.at_level(logging.INFO, logger="ascend_core.worker.speculative"):
        assert install_registered_rejection_sampler(runner) == "ascend"
    assert isinstance(runner.rejection_sampler, sampler_cls)
    assert calls == [(runner.sampler, runner.vllm_config.speculative_config, "cpu")]
    assert "OurSampler from the Ascend registry" in caplog.text


def test_without_a_registered_sampler_vllms_stays(without_ascend_entry, caplog):
    runner = make_runner()
    with caplog.at_level(logging.INFO, logger="ascend_core.worker.speculative"):
        assert install_registered_rejection_sampler(runner) == "vllm"
    assert isinstance(runner.rejection_sampler, VllmRejectionSampler)
    assert "using vLLM's VllmRejectionSampler (none is registered" in caplog.text


def test_a_factory_may_decline_a_configuration(without_ascend_entry, caplog):
    def declining_factory(sampler, spec_config, device):
        return None

    REJECTION_SAMPLERS.register(REJECTION_SAMPLER_NAME, declining_factory)
    runner = make_runner()
    with caplog.at_level(logging.INFO, logger="ascend_core.worker.speculative"):
        assert install_registered_rejection_sampler(runner) == "vllm"
    assert isinstance(runner.rejection_sampler, VllmRejectionSampler)
    assert "declining_factory declined this configuration" in caplog.text


def test_no_speculation_means_no_rejection_sampler(registered):
    _, calls = registered
    runner = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None))
    assert install_registered_rejection_sampler(runner) == "none"
    assert calls == []
