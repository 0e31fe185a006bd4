"""The vLLM glue (imports vLLM): registration of the EPLB MoE layer and its start-up checks.

The layer serving real models is tested end to end in tests/e2e/test_eplb.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

import ascend_eplb
from ascend_core.config import init_ascend_config, reset_ascend_config
from ascend_core.registry import CUSTOM_OPS
from ascend_eplb.vllm.routed_experts import AscendRoutedExperts, HostEplb, _loaded_experts


@pytest.fixture
def host_config():
    yield lambda eplb: init_ascend_config({"eplb_config": eplb}, target="host")
    reset_ascend_config()


def test_register_puts_the_layer_in_cores_registry_once_vllm_runs():
    ascend_eplb.register()
    ascend_eplb.register()
    assert CUSTOM_OPS.get("RoutedExperts") is AscendRoutedExperts
    assert issubclass(AscendRoutedExperts, RoutedExperts)


def test_core_hands_the_layer_to_vllm():
    from ascend_core.ops.vllm_custom_ops import register_with_vllm

    saved = dict(op_registry_oot)
    try:
        ascend_eplb.register()
        assert "RoutedExperts" in register_with_vllm()
        assert op_registry_oot["RoutedExperts"] is AscendRoutedExperts
    finally:
        op_registry_oot.clear()
        op_registry_oot.update(saved)


def fake_layer(use_ep=False, quantized=False):
    method = mock.Mock() if quantized else mock.Mock(spec=UnquantizedFusedMoEMethod)
    return SimpleNamespace(use_ep=use_ep, eplb_index=-1, quant_method=method,
                           layer_name="model.layers.0.mlp.experts")


def test_the_layer_stays_vllms_without_eplb(host_config):
    host_config({})
    with set_current_vllm_config(VllmConfig()):
        assert HostEplb.for_layer(fake_layer()) is None


def test_layers_of_one_model_share_one_host(host_config):
    host_config({"num_redundant_experts": 2})
    with set_current_vllm_config(VllmConfig()):
        first, second = fake_layer(), fake_layer()
        host = HostEplb.for_layer(first)
        assert HostEplb.for_layer(second) is host
    assert host.layers == [first, second]
    assert (first.eplb_index, second.eplb_index) == (0, 1)


def test_expert_parallelism_on_cpu_needs_the_layer(host_config):
    host_config({})
    with set_current_vllm_config(VllmConfig()):
        assert isinstance(HostEplb.for_layer(fake_layer(use_ep=True)), HostEplb)
        # A quantized layer is left to vLLM.
        assert HostEplb.for_layer(fake_layer(use_ep=True, quantized=True)) is None


def test_quantized_layers_with_eplb_fail_at_start_up(host_config):
    host_config({"dynamic_eplb": True})
    with set_current_vllm_config(VllmConfig()), pytest.raises(
        NotImplementedError, match="serves unquantized MoE layers; model.layers.0.mlp.experts"
    ):
        HostEplb.for_layer(fake_layer(quantized=True))


def test_start_up_errors(host_config, tmp_path):
    host_config({"dynamic_eplb": True, "policy": "fastest"})
    with set_current_vllm_config(VllmConfig()), pytest.raises(
        ValueError, match="eplb_config.policy: unknown EPLB policy 'fastest'; known: default"
    ):
        HostEplb.for_layer(fake_layer())
    bad_map = tmp_path / "map.json"
    bad_map.write_text('{"moe_layer_count": 1, "layer_list": [{}]}')
    host_config({"expert_map_path": str(bad_map)})
    with set_current_vllm_config(VllmConfig()), pytest.raises(
        ValueError, match=r"layer_list\[0\]: missing required key 'device_list'"
    ):
        HostEplb.for_layer(fake_layer())


def test_loaded_experts_follow_vllms_expert_map():
    # Rank 1 of 2 under round-robin placement: experts 1, 3, 5, 7 in local rows 0-3.
    expert_map = torch.tensor([-1, 0, -1, 1, -1, 2, -1, 3], dtype=torch.int32)
    layer = SimpleNamespace(expert_map=expert_map, local_num_experts=4, layer_name="l0")
    assert _loaded_experts(layer).tolist() == [1, 3, 5, 7]
    layer = SimpleNamespace(expert_map=None, local_num_experts=8, layer_name="l0")
    assert _loaded_experts(layer).tolist() == list(range(8))
