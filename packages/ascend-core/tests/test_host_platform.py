"""The host platform's choices on top of vLLM's CPU platform."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ascend_core.platform.host import use_reference_mla_for_float32


def config(dtype=torch.float32, use_mla=True, backend=None):
    return SimpleNamespace(model_config=SimpleNamespace(use_mla=use_mla, dtype=dtype),
                           attention_config=SimpleNamespace(backend=backend))


@pytest.mark.parametrize(("amx", "dtype", "use_mla", "chosen"), [
    (True, torch.float32, True, True),  # AMX_MLA would fail at load
    (True, torch.bfloat16, True, False),  # AMX_MLA takes it
    (False, torch.float32, True, False),  # vLLM picks CPU_MLA itself
    (True, torch.float32, False, False),  # not an MLA model
])
def test_float32_mla_on_amx_gets_the_reference_backend(monkeypatch, amx, dtype, use_mla,
                                                       chosen):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    vllm_config = config(dtype, use_mla)
    assert use_reference_mla_for_float32(vllm_config) is chosen
    assert vllm_config.attention_config.backend == (
        AttentionBackendEnum.CPU_MLA if chosen else None)


def test_a_backend_the_user_chose_stays(monkeypatch):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    vllm_config = config(backend=AttentionBackendEnum.AMX_MLA)
    assert not use_reference_mla_for_float32(vllm_config)
    assert vllm_config.attention_config.backend == AttentionBackendEnum.AMX_MLA


@pytest.mark.parametrize(("hybrid", "speculative", "prefix_caching", "refused"), [
    (True, True, True, True),  # vLLM's align-mode state copies: GPU Triton kernels
    (True, True, False, False),
    (True, False, True, False),
    (False, True, True, False),
])
def test_hybrid_speculation_with_prefix_caching_is_refused(hybrid, speculative,
                                                           prefix_caching, refused):
    from ascend_core.platform.host import AscendHostPlatform

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(is_hybrid=hybrid,
                                     architecture="Qwen3NextForCausalLM"),
        speculative_config=SimpleNamespace(method="mtp") if speculative else None,
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching))
    if not refused:
        AscendHostPlatform.refuse_hybrid_speculation_with_prefix_caching(vllm_config)
        return
    with pytest.raises(ValueError, match=r"method='mtp' on the hybrid model "
                       r"Qwen3NextForCausalLM with prefix caching on: .* the host target .*"
                       r"--no-enable-prefix-caching"):
        AscendHostPlatform.refuse_hybrid_speculation_with_prefix_caching(vllm_config)
