"""MoE W8A8_DYNAMIC experts against a per-token dequantized reference."""

import pytest
import torch
import torch.nn.functional as F

from ascend_quant.errors import QuantConfigError
from ascend_quant.export import export_modelslim
from ascend_quant.lookup import scheme_class
from ascend_quant.quantize import quantize_per_token
from ascend_quant.schemes import COMPRESSED_TENSORS, MODELSLIM, SchemeOptions

E, H, INTER, T, TOPK = 4, 64, 32, 9, 2


def gen(seed):
    return torch.Generator().manual_seed(seed)


def expert_tensors(seed):
    """Stacked w13_/w2_ checkpoint tensors and the float weights they came from."""
    w13 = torch.randn(E, 2 * INTER, H, generator=gen(seed)) * 0.05
    w2 = torch.randn(E, H, INTER, generator=gen(seed + 1)) * 0.05
    loaded = {}
    for which, weights in (("w13", w13), ("w2", w2)):
        per_expert = [export_modelslim("W8A8_DYNAMIC", weights[e]) for e in range(E)]
        for name in ("weight", "weight_scale", "weight_offset"):
            loaded[f"{which}_{name}"] = torch.stack([p[name] for p in per_expert])
    return loaded, w13, w2


def fq(x):
    q, s = quantize_per_token(x, 8)
    return q.double() * s.double().unsqueeze(-1)


@pytest.mark.parametrize("layout", [COMPRESSED_TENSORS, MODELSLIM])
def test_moe_w8a8_dynamic_matches_reference(layout):
    loaded, w13, w2 = expert_tensors(0)
    if layout == COMPRESSED_TENSORS:
        loaded = {k: v for k, v in loaded.items() if "offset" not in k}
    scheme = scheme_class("W8A8_DYNAMIC", layout, "experts", moe=True)(
        SchemeOptions(layout=layout), "experts")
    runtime = scheme.process(loaded)
    dq13, dq2 = scheme.dequantized_weights(runtime)
    x = torch.randn(T, H, generator=gen(3))
    logits = torch.randn(T, E, generator=gen(4))
    topk_w, topk_ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    y = scheme.apply(runtime, x, topk_w, topk_ids)

    ref = torch.zeros(T, H, dtype=torch.float64)
    flt = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for j in range(TOPK):
            e = int(topk_ids[t, j])
            h = fq(x[t:t + 1]) @ dq13[e].double().t()
            a = F.silu(h[:, :INTER]) * h[:, INTER:]
            ref[t] += topk_w[t, j] * (fq(a.float()) @ dq2[e].double().t())[0]
            hf = x[t:t + 1].double() @ w13[e].double().t()
            af = F.silu(hf[:, :INTER]) * hf[:, INTER:]
            flt[t] += topk_w[t, j] * (af @ w2[e].double().t())[0]
    assert (y.double() - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert (y.double() - flt).abs().max() <= 0.05 * flt.abs().max()


def test_moe_scheme_ignores_tokens_routed_elsewhere():
    loaded, _, _ = expert_tensors(5)
    scheme = scheme_class("W8A8_DYNAMIC", MODELSLIM, "experts", moe=True)(
        SchemeOptions(layout=MODELSLIM), "experts")
    runtime = scheme.process(loaded)
    x = torch.randn(3, H, generator=gen(6))
    ids = torch.tensor([[0, -1], [E + 2, 1], [-1, -1]])
    y = scheme.apply(runtime, x, torch.ones(3, 2), ids)
    assert not bool(y[2].any()) and bool(y[0].any()) and bool(y[1].any())


def test_moe_nonzero_offsets_are_refused():
    loaded, _, _ = expert_tensors(7)
    loaded["w2_weight_offset"][1] += 2
    scheme = scheme_class("W8A8_DYNAMIC", MODELSLIM, "experts", moe=True)(
        SchemeOptions(layout=MODELSLIM), "experts")
    with pytest.raises(QuantConfigError, match="w2_weight_offset"):
        scheme.process(loaded)


def test_unsupported_moe_scheme_lists_the_supported_ones():
    with pytest.raises(QuantConfigError, match=r"'W4A16'.*MoE experts.*supported: W8A8_DYNAMIC"):
        scheme_class("W4A16", COMPRESSED_TENSORS, "model.layers.0.mlp.experts", moe=True)
