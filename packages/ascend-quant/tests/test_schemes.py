"""Every linear scheme, in both checkpoint layouts, against the dequantized float reference.

compressed-tensors tensors are produced by the compressed-tensors library's compressors and
the reference weight by its decompressor; msModelSlim tensors by ascend_quant.export with the
reference computed here from the stored tensors (``(q + offset) * scale``).
"""

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor

from ascend_quant.errors import QuantConfigError
from ascend_quant.export import (
    ActivationStats,
    ct_format,
    ct_scheme,
    export_compressed_tensors,
    export_modelslim,
)
from ascend_quant.formats.compressed_tensors import classify
from ascend_quant.lookup import scheme_class
from ascend_quant.quantize import quantize_per_token, quantize_static
from ascend_quant.schemes import COMPRESSED_TENSORS as CT
from ascend_quant.schemes import MODELSLIM as MS
from ascend_quant.schemes import LayerShapes, SchemeOptions

N, K = 48, 128
STATS = ActivationStats(low=-4.6, high=4.2)  # covers the N(0, 1) inputs below

CASES = [
    ("W8A8", CT, {}),
    ("W8A8", CT, {"act_symmetric": False}),
    ("W8A8", MS, {}),
    ("W8A8", MS, {"act_symmetric": False}),
    ("W8A8_DYNAMIC", CT, {}),
    ("W8A8_DYNAMIC", MS, {}),
    ("W8A16", CT, {"packed": False}),
    ("W8A16", CT, {"group_size": 32, "symmetric": False}),
    ("W8A16", MS, {}),
    ("W8A16", MS, {"symmetric": False}),
    ("W4A16", CT, {"group_size": 32}),
    ("W4A16", CT, {"group_size": 32, "symmetric": False}),
    ("W4A16", CT, {}),
    ("W4A16", CT, {"group_size": 64, "packed": False}),
    ("W4A8_DYNAMIC", CT, {}),
    ("W4A8_DYNAMIC", CT, {"group_size": 32, "packed": True}),
    ("W4A8_DYNAMIC", MS, {}),
    ("W4A8_DYNAMIC", MS, {"group_size": 32}),
    ("W4A4_DYNAMIC", CT, {}),
    ("W4A4_DYNAMIC", CT, {"packed": True}),
    ("W4A4_DYNAMIC", MS, {}),
]
# Largest relative error (max |y - y_float| / max |y_float|) against the unquantized layer.
FLOAT_ERROR = {"W8A8": 0.03, "W8A8_DYNAMIC": 0.03, "W8A16": 0.01, "W4A16": 0.2,
               "W4A8_DYNAMIC": 0.2, "W4A4_DYNAMIC": 0.35}


def case_id(case):
    name, layout, opts = case
    return "-".join([name, layout] + [f"{k}={v}" for k, v in opts.items()])


def gen(seed):
    return torch.Generator().manual_seed(seed)


def build(name, layout, opts, weight, bias):
    """(checkpoint tensors, SchemeOptions, reference float weight [N, K], activation
    quantizer of the reference)."""
    if layout == CT:
        scheme = ct_scheme(name, ["Linear"], group_size=opts.get("group_size"),
                           symmetric=opts.get("symmetric", True),
                           act_symmetric=opts.get("act_symmetric", True))
        fmt = ct_format(name, opts.get("packed"))
        tensors = export_compressed_tensors(scheme, fmt, weight, STATS)
        choice = classify(scheme, fmt, "layer")
        assert choice.name == name
        decompressed = BaseCompressor.get_value_from_registry(fmt).decompress(
            dict(tensors), scheme)
        reference = decompressed["weight"].float()
        in_scale = tensors.get("input_scale")
        in_zero = tensors.get("input_zero_point")
        return tensors, choice.options, reference, (in_scale, in_zero)
    tensors = export_modelslim(name, weight, bias, group_size=opts.get("group_size"),
                               activations=STATS, symmetric=opts.get("symmetric", True),
                               act_symmetric=opts.get("act_symmetric", True))
    scale = tensors["weight_scale"].float()
    if "weight_scale_second" in tensors:
        scale = scale * tensors["weight_scale_second"]
    groups = scale.shape[1]
    q = tensors["weight"].float().view(N, groups, -1) + tensors["weight_offset"].view(N, 1, 1)
    reference = (q * scale.view(N, groups, 1)).view(N, K)
    options = SchemeOptions(layout=MS, group_size=opts.get("group_size"))
    act = (tensors.get("input_scale"), tensors.get("input_offset"))
    return tensors, options, reference, act


def fake_quant_activations(name, x, act):
    if name in ("W8A16", "W4A16"):
        return x.double()
    if name == "W8A8":
        scale, zero = act
        zero_t = None if zero is None else zero.float()
        q = quantize_static(x, scale.float(), zero_t).double()
        z = 0.0 if zero is None else float(zero)
        return (q - z) * float(scale)
    bits = 4 if name == "W4A4_DYNAMIC" else 8
    q, s = quantize_per_token(x, bits)
    return q.double() * s.double().unsqueeze(-1)


def make_scheme(name, options):
    return scheme_class(name, options.layout, "layer")(options, "layer")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_scheme_matches_dequantized_reference(case):
    name, layout, opts = case
    weight = torch.randn(N, K, generator=gen(0)) * 0.05
    bias = torch.randn(N, generator=gen(1)) * 0.1
    x = torch.randn(2, 5, K, generator=gen(2))
    tensors, options, ref_weight, act = build(name, layout, opts, weight, bias)
    scheme = make_scheme(name, options)
    specs = {s.name: s for s in scheme.checkpoint_params(N, K)}
    for spec in specs.values():
        if spec.required:
            assert spec.name in tensors, f"{spec.name} not exported"
    loaded = {k: v for k, v in tensors.items() if k in specs}
    runtime = scheme.process(loaded, LayerShapes([N], K))

    assert torch.allclose(scheme.dequantized_weight(runtime), ref_weight, rtol=1e-5, atol=1e-6)
    y = scheme.apply(runtime, x, bias)
    assert y.shape == (2, 5, N) and y.dtype == x.dtype
    y_ref = fake_quant_activations(name, x, act) @ ref_weight.double().t() + bias.double()
    scale = y_ref.abs().max()
    # msModelSlim W8A8 rounds the bias to accumulator units: half a deq_scale step.
    slack = tensors["deq_scale"].max() / 2 if "deq_scale" in tensors else 0.0
    assert (y.double() - y_ref).abs().max() <= 1e-5 * scale + slack + 1e-6

    y_float = x.double() @ weight.double().t() + bias.double()
    rel = ((y.double() - y_float).abs().max() / y_float.abs().max()).item()
    assert rel < FLOAT_ERROR[name], f"{name}: {rel:.4f} relative error against float"


@pytest.mark.parametrize("name", ["W8A8_DYNAMIC", "W4A8_DYNAMIC", "W8A16", "W4A16"])
def test_bfloat16_activations(name):
    weight = torch.randn(N, K, generator=gen(3)) * 0.05
    tensors, options, ref_weight, act = build(name, CT, {}, weight, None)
    scheme = make_scheme(name, options)
    specs = {s.name for s in scheme.checkpoint_params(N, K)}
    runtime = scheme.process({k: v for k, v in tensors.items() if k in specs},
                             LayerShapes([N], K))
    x = torch.randn(7, K, generator=gen(4)).to(torch.bfloat16)
    y = scheme.apply(runtime, x)
    assert y.dtype == torch.bfloat16
    y_ref = fake_quant_activations(name, x.float(), act) @ ref_weight.double().t()
    assert (y.double() - y_ref).abs().max() <= 0.02 * y_ref.abs().max()


def stack(parts):
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def test_fused_shards_with_their_own_per_tensor_scales():
    """q/k/v stored with one weight scale each: the fused layer scales each shard's rows."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    sizes = [32, 16, 16]
    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(num_bits=8, strategy="tensor", symmetric=True),
        input_activations=QuantizationArgs(num_bits=8, strategy="token", dynamic=True))
    compressor = BaseCompressor.get_value_from_registry("int-quantized")
    parts, refs = [], []
    for i, n in enumerate(sizes):
        w = torch.randn(n, K, generator=gen(10 + i)) * (0.02 * (i + 1))
        scale = w.abs().amax().reshape(1) / 127
        out = compressor.compress({"weight": w, "weight_scale": scale}, scheme)
        parts.append({"weight": out["weight"], "weight_scale": out["weight_scale"].reshape(1)})
        refs.append(out["weight"].float() * out["weight_scale"].float())
    choice = classify(scheme, "int-quantized", "qkv_proj")
    assert choice.name == "W8A8_DYNAMIC" and choice.options.weight_per_tensor
    op = make_scheme(choice.name, choice.options)
    runtime = op.process(stack(parts), LayerShapes(sizes, K))
    assert torch.allclose(op.dequantized_weight(runtime), torch.cat(refs), rtol=1e-6)


def test_fused_static_shards_must_share_the_input_zero_point():
    options = SchemeOptions(layout=MS)
    op = make_scheme("W8A8", options)
    w = torch.randn(N, K, generator=gen(5)) * 0.05
    parts = [export_modelslim("W8A8", w, activations=STATS, act_symmetric=False),
             export_modelslim("W8A8", w, activations=ActivationStats(-1.0, 4.0),
                              act_symmetric=False)]
    specs = {s.name for s in op.checkpoint_params(N, K)}
    loaded = stack([{k: v for k, v in p.items() if k in specs} for p in parts])
    with pytest.raises(QuantConfigError, match="different input_offset"):
        op.process(loaded, LayerShapes([N, N], K))


def test_int4_scheme_refuses_int8_range_weights():
    op = make_scheme("W4A8_DYNAMIC", SchemeOptions(layout=MS))
    w = torch.randn(N, K, generator=gen(6))
    tensors = export_modelslim("W8A8_DYNAMIC", w)
    with pytest.raises(QuantConfigError, match="outside the 4-bit range"):
        op.process(tensors, LayerShapes([N], K))


def test_non_finite_scales_are_refused():
    op = make_scheme("W8A16", SchemeOptions(layout=MS))
    tensors = export_modelslim("W8A16", torch.randn(N, K, generator=gen(7)))
    tensors["weight_scale"][3] = float("nan")
    with pytest.raises(QuantConfigError, match="non-finite"):
        op.process(tensors, LayerShapes([N], K))


def test_asymmetric_weights_with_quantized_activations_are_refused():
    op = make_scheme("W8A8_DYNAMIC", SchemeOptions(layout=MS))
    tensors = export_modelslim("W8A8_DYNAMIC", torch.randn(N, K, generator=gen(8)))
    tensors["weight_offset"] += 1
    with pytest.raises(QuantConfigError, match="asymmetric"):
        op.process(tensors, LayerShapes([N], K))


def test_msmodelslim_w4a16_is_not_served():
    with pytest.raises(QuantConfigError, match="W4A16.*not supported.*supported: "):
        scheme_class("W4A16", MS, "model.layers.0.mlp.down_proj")


def test_msmodelslim_w8a8_quant_bias_is_dropped_off_rank_zero():
    op = make_scheme("W8A8", SchemeOptions(layout=MS))
    w = torch.randn(N, K, generator=gen(9)) * 0.05
    tensors = export_modelslim("W8A8", w, torch.ones(N), activations=STATS)
    specs = {s.name for s in op.checkpoint_params(N, K)}
    loaded = {k: v for k, v in tensors.items() if k in specs}
    from ascend_quant.schemes import Placement

    rank0 = op.process(loaded, LayerShapes([N], K), Placement(True, True))
    rank1 = op.process(loaded, LayerShapes([N], K), Placement(True, False))
    assert torch.allclose(rank0["bias"], torch.ones(N), atol=float(tensors["deq_scale"].max()))
    assert not bool(rank1["bias"].any())
