"""additional_config rejection_sampler_config.backend reaches the rejection sampler."""

import pytest
import torch

from ascend_core.config import init_ascend_config, reset_ascend_config
from ascend_specdec import rejection
from ascend_specdec.rejection import configured_backend


@pytest.fixture(autouse=True)
def _fresh_config():
    reset_ascend_config()
    yield
    reset_ascend_config()


def _configure(backend):
    init_ascend_config({"rejection_sampler_config": {"backend": backend}}, target="host")


def test_auto_lets_each_op_pick():
    assert configured_backend("cpu") is None
    _configure("auto")
    assert configured_backend("cpu") is None


def test_reference_is_forced():
    _configure("reference")
    assert configured_backend("cpu") == "reference"


def test_triton_that_cannot_run_fails_at_start_with_the_key(monkeypatch):
    monkeypatch.setattr(rejection, "triton_unusable_reason", lambda tensor: "no driver")
    _configure("triton")
    with pytest.raises(ValueError) as info:
        configured_backend("cpu")
    message = str(info.value)
    assert "'rejection_sampler_config.backend' is \"triton\"" in message
    assert "no driver" in message and '"auto" or "reference"' in message
    assert "\n" not in message


def test_triton_that_can_run_is_forced(monkeypatch):
    seen = []
    monkeypatch.setattr(rejection, "triton_unusable_reason",
                        lambda tensor: seen.append(tensor.device) or None)
    _configure("triton")
    assert configured_backend("cpu") == "triton"
    assert seen == [torch.device("cpu")]


def test_a_forced_backend_verifies_through_the_softmax_ops(monkeypatch):
    """On the CPU "auto" verifies random rows from the logits; a forced backend takes the
    per-position ops (the kernels a device runs), so the setting changes the path taken."""
    calls = []
    original = rejection.rejection_random_sample
    monkeypatch.setattr(rejection, "rejection_random_sample",
                        lambda *a, **k: calls.append(k["backend"]) or original(*a, **k))
    logits = torch.randn(2, 8)
    args = (torch.tensor([3, 1], dtype=torch.int32), [2], torch.tensor([2]), 2, None, logits,
            torch.tensor([[5]]))
    kwargs = dict(temperature=torch.tensor([1.0]), all_greedy=False, all_random=True)
    for backend in (None, "reference"):
        out = rejection.rejection_sample(*args, **kwargs, backend=backend)
        assert out.shape == (1, 3)
    assert calls == ["reference"]
