"""The npu target's unquantized MoE (ascend_core.ops.moe) on the reference torch_npu: npu
tensors, so ascend-kernels' dispatcher takes the torch_npu ops; compared with a plain torch
MoE written here (softmax, top-k, renormalisation, per-expert SwiGLU MLPs in float32)."""

from __future__ import annotations

import pytest
import torch

from ascend_core.ops.moe import AscendUnquantizedFusedMoEMethod, fused_moe

from npu_reference import reference_torch_npu

NPU_OPS = ("npu_moe_gating_top_k_softmax", "npu_moe_gating_top_k", "npu_grouped_matmul",
           "npu_swiglu")


@pytest.fixture(scope="module")
def reference_npu():
    with reference_torch_npu() as module:
        yield module


@pytest.fixture
def npu_calls(reference_npu, monkeypatch):
    """Counts the calls of the torch_npu MoE ops."""
    calls = dict.fromkeys(NPU_OPS, 0)
    for name in NPU_OPS:
        original = getattr(reference_npu, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(reference_npu, name, counted)
    return calls


def plain_moe(x, logits, w13, w2, top_k, renormalize, expert_map=None, chosen=None):
    """vLLM layouts: w13 [E, 2I, H] (gate rows, then up), w2 [E, H, I]; float32 throughout.
    ``chosen``: (probabilities, ids) picked elsewhere instead of softmax + top-k."""
    probs = logits.float().softmax(-1)
    weights, ids = chosen if chosen is not None else probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    if expert_map is not None:
        ids = expert_map[ids]
    inter = w2.shape[2]
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = w13[e].float() @ x[t].float()
            a = torch.nn.functional.silu(h[:inter]) * h[inter:]
            out[t] += weights[t, j] * (w2[e].float() @ a)
    return out


def make(tokens, experts, hidden=64, inter=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, experts, generator=g)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    return x, logits, w13, w2


def on_npu(*tensors):
    return [t.to("npu") for t in tensors]


def kn(w):
    return w.transpose(1, 2).contiguous()


def assert_moe_close(actual, expected):
    assert actual.device.type == "npu"
    assert actual.dtype == torch.bfloat16
    err = (actual.cpu().float() - expected).abs().max().item()
    # Two bfloat16 roundings (after each grouped matmul) of values of order 1.
    assert err <= 0.03 * max(1.0, expected.abs().max().item()), err


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("tokens,experts,top_k", [(9, 8, 2), (5, 4, 1), (16, 16, 4)])
def test_npu_moe_equals_a_plain_torch_moe(npu_calls, tokens, experts, top_k, renormalize):
    x, logits, w13, w2 = make(tokens, experts, seed=tokens + experts)
    expected = plain_moe(x, logits, w13, w2, top_k, renormalize)
    xn, ln, a, b = on_npu(x, logits, kn(w13), kn(w2))
    out = fused_moe(xn, ln.to(torch.bfloat16), a, b, top_k=top_k, renormalize=renormalize)
    # The router's logits arrive in the model's dtype; route the reference on the same values.
    expected = plain_moe(x, logits.to(torch.bfloat16), w13, w2, top_k, renormalize)
    assert_moe_close(out, expected)
    assert npu_calls["npu_moe_gating_top_k_softmax"] == 1
    assert npu_calls["npu_grouped_matmul"] == 2
    assert npu_calls["npu_swiglu"] == 1


def test_experts_without_tokens_and_a_single_token(npu_calls):
    # The logits send every token to experts 1 and 5 only: the other six get no rows.
    x, logits, w13, w2 = make(6, 8, seed=3)
    logits = torch.full((6, 8), -8.0)
    logits[:, 1] = torch.linspace(1.0, 2.0, 6)
    logits[:, 5] = 1.5
    expected = plain_moe(x, logits, w13, w2, 2, True)
    xn, ln, a, b = on_npu(x, logits, kn(w13), kn(w2))
    out = fused_moe(xn, ln, a, b, top_k=2, renormalize=True)
    assert_moe_close(out, expected)
    one = fused_moe(xn[:1], ln[:1], a, b, top_k=2, renormalize=True)
    assert_moe_close(one, expected[:1])


def test_expert_map_drops_the_other_ranks_experts(npu_calls):
    # Expert parallelism: this rank holds global experts 4..7 as local 0..3.
    x, logits, w13, w2 = make(10, 8, seed=4)
    expert_map = torch.tensor([-1, -1, -1, -1, 0, 1, 2, 3])
    full = torch.cat([torch.zeros_like(w13[:4]), w13[4:]])
    full2 = torch.cat([torch.zeros_like(w2[:4]), w2[4:]])
    expected = plain_moe(x, logits, full, full2, 2, True)
    xn, ln, a, b, m = on_npu(x, logits, kn(w13[4:]), kn(w2[4:]), expert_map)
    out = fused_moe(xn, ln, a, b, top_k=2, renormalize=True, expert_map=m)
    assert_moe_close(out, expected)


def test_no_tokens_for_local_experts_gives_zeros(npu_calls):
    x, logits, w13, w2 = make(3, 4, seed=5)
    expert_map = torch.tensor([0, 1, -1, -1])
    logits[:, 2:] += 20.0  # everything goes to the other rank's experts
    xn, ln, a, b, m = on_npu(x, logits, kn(w13[:2]), kn(w2[:2]), expert_map)
    out = fused_moe(xn, ln, a, b, top_k=2, renormalize=True, expert_map=m)
    assert out.shape == (3, 64)
    assert bool((out.cpu() == 0).all())
    assert npu_calls["npu_grouped_matmul"] == 0


def test_grouped_topk_routing_goes_through_npu_moe_gating_top_k(npu_calls):
    # 16 experts in 4 groups of 4 (npu_moe_gating_top_k wants more than 2 per group).
    x, logits, w13, w2 = make(7, 16, seed=6)
    xn, ln, a, b = on_npu(x, logits, kn(w13), kn(w2))
    out = fused_moe(xn, ln, a, b, top_k=2, renormalize=True, use_grouped_topk=True,
                    num_expert_group=4, topk_group=2, scoring_func="softmax")
    assert npu_calls["npu_moe_gating_top_k"] == 1
    # The same routing done by hand: the best two groups (by their best expert), then top-2.
    probs = logits.softmax(-1)
    groups = probs.view(7, 4, 4).amax(-1).topk(2, dim=-1).indices
    mask = torch.zeros(7, 4, dtype=torch.bool).scatter_(1, groups, True).repeat_interleave(4, 1)
    weights, ids = probs.masked_fill(~mask, 0.0).topk(2, dim=-1)
    assert not mask.all()
    expected = plain_moe(x, logits, w13, w2, 2, True, chosen=(weights, ids))
    assert_moe_close(out, expected)


def test_routes_the_npu_path_does_not_serve_are_clear_errors(reference_npu):
    x, logits, w13, w2 = make(2, 4)
    with pytest.raises(NotImplementedError, match="scoring_func='sigmoid'.*VLLM_ASCEND_TARGET"):
        fused_moe(x, logits, kn(w13), kn(w2), top_k=1, renormalize=False,
                  scoring_func="sigmoid")


def test_bad_expert_weights_are_clear_errors(reference_npu):
    x, logits, w13, w2 = make(2, 4, inter=16)
    with pytest.raises(ValueError, match=r"w13 must be \[experts, hidden=64"):
        fused_moe(x, logits, w13, kn(w2), top_k=1, renormalize=False)  # vLLM layout
    with pytest.raises(TypeError, match="w2 has dtype torch.float32 but x torch.bfloat16"):
        fused_moe(x, logits, kn(w13), kn(w2).float(), top_k=1, renormalize=False)


def test_the_method_is_vllms_unquantized_method():
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    from ascend_core.ops.vllm_custom_ops import register
    from ascend_core.registry import CUSTOM_OPS

    register()
    assert issubclass(AscendUnquantizedFusedMoEMethod, UnquantizedFusedMoEMethod)
    # vLLM looks the replacement up by the class name it instantiates.
    assert CUSTOM_OPS.get(UnquantizedFusedMoEMethod.__name__) is AscendUnquantizedFusedMoEMethod
