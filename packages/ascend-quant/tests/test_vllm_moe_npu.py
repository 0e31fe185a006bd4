"""``AscendQuantMoEMethod`` on the npu platform, on the reference torch_npu: weights created,
loaded and processed through the method (vLLM's loader stand-in copies each expert's
shard), then ``apply_monolithic`` routes the router logits with ascend-kernels' routing
(torch_npu's gating ops on npu tensors, not vLLM's router and its ``_moe_C``) and runs the
experts in the scheme's npu form. Compared with the host form of the same scheme on the
same checkpoint tensors, routed by plain torch (softmax, top-k, renormalisation).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_moe_scheme import INTER, TOPK, E, H, expert_tensors, gen
from test_npu_schemes import count_calls, reference_torch_npu  # noqa: F401 - fixture

from ascend_quant.errors import QuantConfigError
from ascend_quant.lookup import scheme_class
from ascend_quant.schemes import MODELSLIM, SchemeOptions
from ascend_quant.vllm import moe as quant_moe
from ascend_quant.vllm.linear import runtime_weights
from ascend_quant.vllm.moe import AscendQuantMoEMethod

REFERENCE_TORCH_NPU = Path(__file__).resolve().parents[3] / "testing" / "reference_torch_npu"
OPS = ("npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k", "npu_grouped_matmul",
       "npu_swiglu", "npu_dynamic_quant")
NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


@pytest.fixture(scope="module", autouse=True)
def transformers_without_torch_npu():
    """transformers decides once whether torch_npu exists: before the reference (the
    ``reference_torch_npu`` fixture, set up after this one) is importable."""
    from transformers.utils import import_utils

    import_utils.is_torch_npu_available()
    import_utils.is_torch_npu_available(check_device=True)


@pytest.fixture
def calls(request, monkeypatch):
    return count_calls(request.getfixturevalue("reference_torch_npu"), OPS, monkeypatch)


def moe_config(**parallel):
    return SimpleNamespace(activation="silu", has_bias=False, intermediate_size=INTER,
                           moe_parallel_config=SimpleNamespace(
                               use_ep=False, **{"enable_eplb": False, **parallel}))


def vllm_loader(param, loaded, weight_name, shard_id, expert_id, return_success=False):
    """vLLM's RoutedExperts loader for one replica: gate rows, then up rows, in w13."""
    rows = {"w1": slice(0, INTER), "w3": slice(INTER, 2 * INTER)}.get(shard_id, slice(None))
    param.data[expert_id][rows].copy_(loaded)
    return True


def routed_layer(**routing):
    layer = torch.nn.Module()
    layer.layer_name = "model.layers.0.mlp.experts"
    defaults = dict(top_k=TOPK, renormalize=True, use_grouped_topk=False, num_expert_group=None,
                    topk_group=None, scoring_func="softmax", e_score_correction_bias=None,
                    routed_scaling_factor=1.0, apply_router_weight_on_input=False,
                    custom_routing_function=None, routing_sink=None)
    for name, value in {**defaults, **routing}.items():
        setattr(layer, name, value)
    return layer


def served(device, route_here, seed=30, experts=E, **routing):
    """A method and its layer, the checkpoint's expert tensors loaded one shard at a time
    (``experts``: a multiple of test_moe_scheme's E, drawn E at a time)."""
    draws = [expert_tensors(seed + 2 * i)[0] for i in range(experts // E)]
    loaded = {name: torch.cat([d[name] for d in draws]) for name in draws[0]}
    scheme = scheme_class("W8A8_DYNAMIC", MODELSLIM, "experts", moe=True)(
        SchemeOptions(layout=MODELSLIM), "model.layers.0.mlp.experts")
    method = AscendQuantMoEMethod(scheme, moe_config(), NAMES, route_here=route_here)
    layer = routed_layer(**routing)
    with torch.device(device):  # as vLLM's loader: the parameters made on the device
        method.create_weights(layer, experts, H, INTER, torch.bfloat16, weight_loader=vllm_loader)
    for param_name, param in list(layer.named_parameters()):
        stack, tensor = param_name.split("_", 1)
        for expert in range(experts):
            shards = ("w1", "w3") if stack == "w13" else ("w2",)
            for shard in shards:
                full = loaded[f"{stack}_{tensor}"][expert]
                part = full if shard == "w2" else (full[:INTER] if shard == "w1"
                                                   else full[INTER:])
                param.weight_loader(param, part, f"experts.{expert}.{NAMES[shard]}.{tensor}",
                                    shard, expert)
    method.process_weights_after_loading(layer)
    return method, layer


def test_npu_platform_routes_with_ascend_kernels_and_runs_the_npu_form(calls):
    method, layer = served("npu", route_here=True)
    assert method.is_monolithic and method.runs_npu_path
    assert set(layer.ascend_quant_runtime) == {"npu_w13", "npu_w13_scale", "npu_w2",
                                               "npu_w2_scale"}
    host_method, host_layer = served("cpu", route_here=False)
    assert not host_method.is_monolithic and not host_method.runs_npu_path

    tokens = 13
    x = torch.randn(tokens, H, generator=gen(31)).to(torch.bfloat16)
    logits = torch.randn(tokens, E, generator=gen(32))
    y = method.apply_monolithic(layer, x.to("npu"), logits.to(torch.bfloat16).to("npu"))
    assert y.device.type == "npu" and y.dtype == torch.bfloat16 and y.shape == (tokens, H)
    assert method.monolithic_calls == 1
    assert calls["npu_moe_gating_top_k_softmax"] == 1
    assert calls["npu_grouped_matmul"] == 2 and calls["npu_swiglu"] == 1
    assert calls["npu_dynamic_quant"] == 2

    # host form, routed by plain torch on the same (bfloat16) logits
    weights, ids = logits.to(torch.bfloat16).float().softmax(-1).topk(TOPK, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    want = host_method.apply(host_layer, x, weights, ids, None, None)
    err = (y.cpu().double() - want.double()).abs().max()
    assert err <= 5e-2 * want.double().abs().max(), err


def test_grouped_topk_routing_goes_through_npu_moe_gating_top_k(calls):
    # 8 experts in 2 groups of 4 (npu_moe_gating_top_k wants more than 2 per group)
    experts = 2 * E
    bias = torch.tensor([0.1, -0.1] * (experts // 2))  # moves the choice within groups
    routing = dict(use_grouped_topk=True, num_expert_group=2, topk_group=1,
                   scoring_func="sigmoid", routed_scaling_factor=2.0, experts=experts)
    method, layer = served("npu", route_here=True, e_score_correction_bias=bias.to("npu"),
                           **routing)
    host_method, host_layer = served("cpu", route_here=False, **routing)
    x = torch.randn(7, H, generator=gen(33)).to(torch.bfloat16)
    logits = torch.randn(7, experts, generator=gen(34))
    y = method.apply_monolithic(layer, x.to("npu"), logits.to("npu"))
    assert calls["npu_moe_gating_top_k"] == 1 and calls["npu_moe_gating_top_k_softmax"] == 0

    # plain torch: sigmoid scores, the best group (by its top-2 biased scores), top-k in it,
    # weights the unbiased scores renormalised and scaled
    scores = logits.sigmoid()
    biased = scores + bias
    group_scores = biased.view(7, 2, 4).topk(2, dim=-1).values.sum(-1)
    group = group_scores.argmax(-1)
    mask = torch.zeros(7, experts, dtype=torch.bool)
    for t in range(7):
        mask[t, group[t] * 4:(group[t] + 1) * 4] = True
    assert len(set(group.tolist())) == 2  # both groups win somewhere
    ids = biased.masked_fill(~mask, float("-inf")).topk(TOPK, dim=-1).indices
    unbiased = scores.masked_fill(~mask, float("-inf")).topk(TOPK, dim=-1).indices
    assert not torch.equal(ids.sort(-1).values, unbiased.sort(-1).values)  # the bias counts
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * 2.0
    want = host_method.apply(host_layer, x, weights, ids, None, None)
    err = (y.cpu().double() - want.double()).abs().max()
    assert err <= 5e-2 * want.double().abs().max(), err


def test_the_platform_decides_the_routing(monkeypatch):
    import vllm.platforms

    scheme = scheme_class("W8A8_DYNAMIC", MODELSLIM, "experts", moe=True)(
        SchemeOptions(layout=MODELSLIM), "experts")
    for device_type, monolithic in (("npu", True), ("cpu", False)):
        monkeypatch.setattr(vllm.platforms, "current_platform",
                            SimpleNamespace(device_type=device_type), raising=False)
        assert quant_moe.npu_platform() is monolithic
        method = AscendQuantMoEMethod(scheme, moe_config(), NAMES)
        assert method.is_monolithic is monolithic


@pytest.mark.usefixtures("reference_torch_npu")
def test_host_routing_keeps_vllms_router():
    method, layer = served("cpu", route_here=False)
    assert set(runtime_weights(layer)) == {"w13", "w13_scale", "w2", "w2_scale"}
    with pytest.raises(QuantConfigError, match="routed by vLLM's router"):
        method.apply_monolithic(layer, torch.zeros(2, H), torch.zeros(2, E))


@pytest.mark.parametrize("routing, message", [
    ({"custom_routing_function": lambda *a: a}, "a custom routing function"),
    ({"routing_sink": torch.zeros(1)}, "a routing sink"),
    ({"apply_router_weight_on_input": True}, "apply_router_weight_on_input"),
])
@pytest.mark.usefixtures("reference_torch_npu")
def test_routing_the_npu_target_does_not_serve_is_refused_at_load(routing, message):
    with pytest.raises(QuantConfigError, match=f"does not serve {message}.*"
                                               "VLLM_ASCEND_TARGET=host"):
        served("npu", route_here=True, **routing)
