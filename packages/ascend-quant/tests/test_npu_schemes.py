"""The npu form of every scheme, run on the reference torch_npu (testing/reference_torch_npu).

The reference computes each torch_npu op with plain torch and raises on arguments, dtypes
and layouts the op's documentation rules out (and on arguments it does not model), so a
scheme that runs here calls torch_npu as documented. Each npu result is compared with the
host form of the same scheme on the same checkpoint tensors, and with the float64
reference of the quantized math; the torch_npu functions each scheme goes through are
recorded and checked.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_moe_scheme import INTER, TOPK, E, H, expert_tensors
from test_schemes import CASES, K, N, build, case_id, fake_quant_activations, gen

from ascend_kernels.dispatch import torch_npu_module
from ascend_quant.errors import QuantConfigError
from ascend_quant.lookup import scheme_class
from ascend_quant.schemes import COMPRESSED_TENSORS as CT
from ascend_quant.schemes import MODELSLIM as MS
from ascend_quant.schemes import LayerShapes, SchemeOptions

REFERENCE_TORCH_NPU = Path(__file__).resolve().parents[3] / "testing" / "reference_torch_npu"
HALF = [torch.bfloat16, torch.float16]
# npu against host, relative to max |host|: both round the output to the dtype once, and
# the npu forms round some intermediates (scales, dequantized activations, the MoE hidden
# state) to it too.
TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3}
OPS = ("npu_quantize", "npu_dynamic_quant", "npu_quant_matmul", "npu_weight_quant_batchmatmul",
       "npu_convert_weight_to_int4pack", "npu_grouped_matmul", "npu_swiglu")
# The torch_npu functions each scheme's npu form calls (at load and per apply).
CALLS = {
    "W8A8": {"npu_quantize", "npu_quant_matmul"},
    "W8A8_DYNAMIC": {"npu_dynamic_quant", "npu_quant_matmul"},
    "W8A16": {"npu_weight_quant_batchmatmul"},
    "W4A16": {"npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul"},
    "W4A8_DYNAMIC": {"npu_convert_weight_to_int4pack", "npu_dynamic_quant",
                     "npu_weight_quant_batchmatmul"},
    "W4A4_DYNAMIC": {"npu_convert_weight_to_int4pack", "npu_quantize",
                     "npu_weight_quant_batchmatmul"},
}


@pytest.fixture(scope="module")
def reference_torch_npu():
    """The reference torch_npu as ``torch_npu``, removed again after the module."""
    sys.path.insert(0, str(REFERENCE_TORCH_NPU))
    importlib.invalidate_caches()
    torch_npu_module.cache_clear()
    module = torch_npu_module()
    assert module is not None and "reference" in module.__version__
    yield module
    if "torch_npu" in sys.modules:
        importlib.import_module("torch_npu._reference").uninstall()
    sys.path.remove(str(REFERENCE_TORCH_NPU))
    torch_npu_module.cache_clear()


def count_calls(module, names, monkeypatch) -> Counter:
    """Counts the calls of each of ``module``'s functions ``names`` (each still runs)."""
    seen = Counter()
    for name in names:
        real = getattr(module, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            seen[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    return seen


@pytest.fixture
def calls(reference_torch_npu, monkeypatch):
    """Counts the calls of each torch_npu op (each still runs the reference)."""
    return count_calls(reference_torch_npu, OPS, monkeypatch)


def schemes(name, options):
    cls = scheme_class(name, options.layout, "layer")
    return cls(options, "layer"), cls(options, "layer", backend="npu")


def processed(name, layout, opts, weight, bias=None):
    tensors, options, ref_weight, act = build(name, layout, opts, weight, bias)
    host, on_npu = schemes(name, options)
    wanted = {s.name for s in host.checkpoint_params(N, K)}
    loaded = {k: v for k, v in tensors.items() if k in wanted}
    return (host, host.process(loaded, LayerShapes([N], K)), on_npu,
            on_npu.process(loaded, LayerShapes([N], K)), ref_weight, act, tensors)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_npu_form_matches_the_host_form(case, dtype, calls):
    name, layout, opts = case
    weight = torch.randn(N, K, generator=gen(10)) * 0.05
    bias = torch.randn(N, generator=gen(11)) * 0.1
    host, host_w, on_npu, npu_w, ref_weight, act, tensors = processed(name, layout, opts,
                                                                      weight, bias)
    assert any(key.startswith("npu_") for key in npu_w)
    assert not any(key.startswith("npu_") for key in host_w)
    # the npu layouts hold the same weight
    torch.testing.assert_close(on_npu.dequantized_weight(npu_w), host.dequantized_weight(host_w))

    x = torch.randn(3, 4, K, generator=gen(12)).to(dtype)
    y_npu = on_npu.apply(npu_w, x, bias.to(dtype))
    y_host = host.apply(host_w, x, bias.to(dtype))
    assert y_npu.shape == (3, 4, N) and y_npu.dtype == dtype
    top = y_host.double().abs().max()
    assert (y_npu.double() - y_host.double()).abs().max() <= TOL[dtype] * top

    # msModelSlim W8A8 folds the bias into its quant_bias; the others add it.
    y_ref = (fake_quant_activations(name, x.float(), act) @ ref_weight.double().t()
             + bias.to(dtype).double())
    slack = tensors["deq_scale"].max() / 2 if "deq_scale" in tensors else 0.0
    assert (y_npu.double() - y_ref).abs().max() <= TOL[dtype] * y_ref.abs().max() + slack
    assert set(calls) == CALLS[name], dict(calls)


def test_int4_weights_are_packed_once_at_load(calls):
    weight = torch.randn(N, K, generator=gen(13)) * 0.05
    _, _, on_npu, npu_w, *_ = processed("W4A16", CT, {"group_size": 32}, weight)
    assert calls["npu_convert_weight_to_int4pack"] == 1
    packed = npu_w["npu_weight"]
    assert packed.dtype == torch.int32 and packed.shape == (K, N // 8)
    x = torch.randn(5, K, generator=gen(14)).to(torch.bfloat16)
    on_npu.apply(npu_w, x)
    on_npu.apply(npu_w, x)
    assert calls["npu_convert_weight_to_int4pack"] == 1
    assert calls["npu_weight_quant_batchmatmul"] == 2


def test_auto_selection_keeps_cpu_weights_on_the_host_form(reference_torch_npu):
    weight = torch.randn(N, K, generator=gen(15)) * 0.05
    tensors, options, *_ = build("W8A8_DYNAMIC", CT, {}, weight, None)
    scheme = scheme_class("W8A8_DYNAMIC", CT, "layer")(options, "layer")
    wanted = {s.name for s in scheme.checkpoint_params(N, K)}
    runtime = scheme.process({k: v for k, v in tensors.items() if k in wanted},
                             LayerShapes([N], K))
    assert set(runtime) == {"qweight", "weight_scale"}


def test_npu_form_refuses_float32_activations(reference_torch_npu):
    weight = torch.randn(N, K, generator=gen(16)) * 0.05
    _, _, on_npu, npu_w, *_ = processed("W8A16", CT, {"packed": False}, weight)
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        on_npu.apply(npu_w, torch.randn(2, K))


def test_groups_torch_npu_cannot_take_are_refused_at_load(reference_torch_npu):
    weight = torch.randn(N, K, generator=gen(17)) * 0.05
    with pytest.raises(QuantConfigError, match="multiple of 32"):
        processed("W4A16", CT, {"group_size": 16}, weight)


def test_int4_output_channels_must_fill_whole_words(reference_torch_npu):
    n = 20
    weight = torch.randn(n, K, generator=gen(18)) * 0.05
    q = torch.round(weight / (weight.abs().amax(1, keepdim=True) / 7)).to(torch.int8)
    loaded = {"weight": q, "weight_scale": weight.abs().amax(1, keepdim=True) / 7}
    scheme = scheme_class("W4A8_DYNAMIC", MS, "layer")(SchemeOptions(layout=MS), "layer",
                                                        backend="npu")
    with pytest.raises(QuantConfigError, match="multiple of 8"):
        scheme.process(loaded, LayerShapes([n], K))


# --- MoE ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", [CT, MS])
def test_moe_npu_form_matches_the_host_form(layout, dtype, calls):
    loaded, _, _ = expert_tensors(20)
    if layout == CT:
        loaded = {k: v for k, v in loaded.items() if "offset" not in k}
    cls = scheme_class("W8A8_DYNAMIC", layout, "experts", moe=True)
    host = cls(SchemeOptions(layout=layout), "experts")
    on_npu = cls(SchemeOptions(layout=layout), "experts", backend="npu")
    host_w, npu_w = host.process(loaded), on_npu.process(loaded)
    assert set(npu_w) == {f"npu_{k}" for k in host_w}
    for got, want in zip(on_npu.dequantized_weights(npu_w), host.dequantized_weights(host_w),
                         strict=True):
        torch.testing.assert_close(got, want)

    tokens = 11
    x = torch.randn(tokens, H, generator=gen(21)).to(dtype)
    logits = torch.randn(tokens, E, generator=gen(22))
    logits[:, 1] = -1e9  # expert 1 gets no token: an empty group
    topk_w, topk_ids = torch.softmax(logits, -1).topk(TOPK, dim=-1)
    topk_ids[0, 1] = -1  # a slot routed to another rank's expert
    y_npu = on_npu.apply(npu_w, x, topk_w, topk_ids)
    y_host = host.apply(host_w, x, topk_w, topk_ids)
    assert y_npu.shape == (tokens, H) and y_npu.dtype == dtype
    # the npu form rounds the hidden state to the dtype before SwiGLU and requantization
    tol = {torch.bfloat16: 5e-2, torch.float16: 1e-2}[dtype]
    assert (y_npu.double() - y_host.double()).abs().max() <= tol * y_host.double().abs().max()
    assert calls["npu_grouped_matmul"] == 2 and calls["npu_swiglu"] == 1
    assert calls["npu_dynamic_quant"] == 2 and INTER > 0


def test_moe_without_local_tokens_returns_zeros(reference_torch_npu):
    loaded, _, _ = expert_tensors(23)
    cls = scheme_class("W8A8_DYNAMIC", MS, "experts", moe=True)
    on_npu = cls(SchemeOptions(layout=MS), "experts", backend="npu")
    npu_w = on_npu.process(loaded)
    x = torch.randn(3, H).to(torch.bfloat16)
    y = on_npu.apply(npu_w, x, torch.ones(3, TOPK), torch.full((3, TOPK), -1))
    assert torch.equal(y, torch.zeros(3, H, dtype=torch.bfloat16))
