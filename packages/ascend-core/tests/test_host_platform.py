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
