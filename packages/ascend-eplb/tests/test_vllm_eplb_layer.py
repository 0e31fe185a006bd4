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
from ascend_core.config import get_ascend_config, init_ascend_config, reset_ascend_config
from ascend_core.ops.moe import AscendUnquantizedFusedMoEMethod
from ascend_core.registry import CUSTOM_OPS
from ascend_eplb.runtime import EplbRuntime, EplbSettings
from ascend_eplb.vllm import routed_experts
from ascend_eplb.vllm.routed_experts import (
    AscendRoutedExperts,
    HostEplb,
    ModelEplb,
    _loaded_experts,
    _query_lengths,
    _StepInfo,
)


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


# --- the npu target ------------------------------------------------------------------------------

NPU_PLATFORM = SimpleNamespace(is_cpu=lambda: False, device_type="npu")


@pytest.fixture
def on_npu(monkeypatch):
    monkeypatch.setattr(routed_experts, "current_platform", NPU_PLATFORM)
    yield lambda eplb: init_ascend_config({"eplb_config": eplb}, target="npu")
    reset_ascend_config()


def npu_layer(use_ep=False, npu_path=True, quantized=False):
    if quantized:
        method = mock.Mock()
    else:
        method = mock.Mock(spec=AscendUnquantizedFusedMoEMethod)
        method.runs_npu_path = npu_path
    return SimpleNamespace(use_ep=use_ep, eplb_index=-1, quant_method=method,
                           layer_name="model.layers.0.mlp.experts")


def test_npu_layers_are_served_by_the_same_runtime_glue(on_npu):
    on_npu({"dynamic_eplb": True, "num_redundant_experts": 2})
    with set_current_vllm_config(VllmConfig()):
        first, second = npu_layer(), npu_layer()
        model = ModelEplb.for_layer(first)
        assert ModelEplb.for_layer(second) is model
    assert model.target == "npu" and model.layers == [first, second]
    assert model.summary() == {"started": False, "target": "npu", "layers": 2}


def test_npu_without_eplb_leaves_expert_parallelism_to_the_npu_method(on_npu):
    on_npu({})
    with set_current_vllm_config(VllmConfig()):
        # Unlike the host target, the npu method serves expert parallelism itself.
        assert ModelEplb.for_layer(npu_layer(use_ep=True)) is None


def test_npu_layers_eplb_cannot_serve_fail_at_start_up(on_npu):
    on_npu({"dynamic_eplb": True})
    with set_current_vllm_config(VllmConfig()):
        for layer in (npu_layer(quantized=True), npu_layer(npu_path=False)):
            with pytest.raises(NotImplementedError, match="EPLB on the npu target serves the "
                               "npu platform's unquantized MoE layers"):
                ModelEplb.for_layer(layer)


def test_npu_eplb_with_captured_graphs_is_refused(on_npu):
    from vllm.config.compilation import CUDAGraphMode

    on_npu({"num_redundant_experts": 2})
    config = VllmConfig()
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    with set_current_vllm_config(config), pytest.raises(
        NotImplementedError, match="npu target runs eagerly.*cudagraph_mode is "
                                   "FULL_DECODE_ONLY. Pass enforce_eager=True"
    ):
        ModelEplb.for_layer(npu_layer())


def test_other_devices_run_without_eplb(monkeypatch, host_config, caplog):
    monkeypatch.setattr(routed_experts, "current_platform",
                        SimpleNamespace(is_cpu=lambda: False, device_type="cuda"))
    host_config({"dynamic_eplb": True})
    with set_current_vllm_config(VllmConfig()):
        assert ModelEplb.for_layer(npu_layer()) is None
    assert "serves the host and npu targets" in caplog.text


def test_npu_slots_record_logical_ids_and_route_to_global_slots(on_npu):
    on_npu({"dynamic_eplb": True, "num_redundant_experts": 2})
    model = ModelEplb(VllmConfig(), get_ascend_config().eplb_config, "npu")
    settings = EplbSettings(num_experts=4, num_redundant_experts=2, dynamic=True)
    runtime = EplbRuntime(settings, num_layers=1)
    sources = [[torch.arange(4.0).view(4, 1)]]
    # Slots 4 and 5 repeat experts 1 and 3.
    runtime.start(sources, torch.arange(4).view(1, 4), torch.tensor([[0, 1, 2, 3, 1, 3]]))
    model.runtime = runtime
    runtime.on_step_boundary()
    ids = torch.tensor([[1, 3], [1, 0], [2, 3]])
    model._step = _StepInfo(real=True, num_tokens=2)  # a padded third row
    slots = model._to_slots(0, ids)
    # Token t takes replica t % 2 of experts with two slots.
    assert slots.tolist() == [[1, 3], [4, 0], [2, 3]]
    runtime.on_step_boundary()
    assert runtime.recorder.window_load().tolist() == [[1, 2, 0, 1]]
    model._step = _StepInfo(real=False)  # a dummy run is routed, not recorded
    model._to_slots(0, ids)
    runtime.on_step_boundary()
    assert runtime.recorder.window_load().tolist() == [[1, 2, 0, 1]]


def test_query_lengths_from_either_attention_metadata():
    vllm_style = SimpleNamespace(query_start_loc=torch.tensor([0, 5, 6, 7]))
    ascend_style = SimpleNamespace(query_lens=[5, 1, 1], num_actual_tokens=7)
    assert _query_lengths(vllm_style).tolist() == [5, 1, 1]
    assert _query_lengths(ascend_style).tolist() == [5, 1, 1]
    assert _query_lengths(SimpleNamespace(seq_lens=[3])) is None


@pytest.mark.parametrize(("dp_metadata", "boundary"), [(None, False), (object(), True)])
def test_a_forward_without_attention_metadata_is_a_step_only_under_data_parallelism(
        monkeypatch, dp_metadata, boundary):
    """An idle DP rank runs a dummy batch (no attention metadata) while the others run a
    step: it must close a step too, or the ranks' replans (a collective weight exchange)
    fall out of step. Without data parallelism such a forward (profiling, warm-up) is none."""
    model = object.__new__(ModelEplb)
    model.decode_query_len = 1
    context = SimpleNamespace(attn_metadata=None, dp_metadata=dp_metadata)
    monkeypatch.setattr(routed_experts, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(routed_experts, "get_forward_context", lambda: context)
    step = model._step_info()
    assert step.is_boundary is boundary and step.real is False
    model.runtime = mock.Mock()
    model._begin_forward()
    assert model.runtime.on_step_boundary.call_count == int(boundary)
