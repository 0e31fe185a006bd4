"""int8 ops: the references against their definitions, the Triton backend (in Triton's
interpreter) against the references."""

import pytest
import torch

from ascend_kernels import (
    BackendUnavailable,
    add_rms_norm,
    add_rms_norm_quant,
    dynamic_per_token_quant,
    scaled_int8_mm,
)

from conftest import DTYPES, assert_close, assert_int8_close, needs_triton

SHAPES = [(4, 96), (1, 200), (2, 3, 24), (0, 32), (3, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dynamic_quant_reference_round_trips_within_half_a_step(dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 64, dtype=dtype) * 3
    q, scales = dynamic_per_token_quant(x, backend="reference")
    assert q.dtype == torch.int8 and scales.dtype == torch.float32 and scales.shape == (5,)
    x32 = x.float()
    torch.testing.assert_close(scales, x32.abs().amax(-1) / 127)
    assert q.abs().amax(-1).eq(127).all()  # the largest value of each row maps to +-127
    error = (q.float() * scales[:, None] - x32).abs()
    assert (error <= scales[:, None] * 0.5001 + 1e-6).all()


def test_dynamic_quant_of_a_zero_row_is_zero():
    x = torch.zeros(2, 8)
    x[1] = torch.arange(8.0)
    q, scales = dynamic_per_token_quant(x, backend="reference")
    assert scales[0] == 0 and (q[0] == 0).all()
    assert q[1, -1] == 127


def test_rounding_is_half_to_even():
    # Values 0.5, 1.5, 2.5 steps (scale 1 because the row's max is 127).
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 127.0]])
    q, _ = dynamic_per_token_quant(x, backend="reference")
    assert q.tolist() == [[0, 2, 2, 0, -2, 127]]


@needs_triton
def test_triton_rounding_is_half_to_even_too():
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, -3.5, 127.0]])
    q, _ = dynamic_per_token_quant(x, backend="triton")
    assert q.tolist() == [[0, 2, 2, 0, -2, -4, 127]]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_dynamic_quant_triton_matches_reference(dtype, shape):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype) * 2
    q, scales = dynamic_per_token_quant(x, backend="triton")
    ref_q, ref_scales = dynamic_per_token_quant(x, backend="reference")
    assert scales.shape == shape[:-1]
    torch.testing.assert_close(scales, ref_scales)
    assert_int8_close(q, ref_q)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_quant_reference_is_add_rms_norm_then_quant(dtype):
    torch.manual_seed(2)
    x, residual = torch.randn(4, 48, dtype=dtype), torch.randn(4, 48, dtype=dtype)
    w = torch.rand(48) + 0.5
    q, scales, new_residual = add_rms_norm_quant(x, residual, w, 1e-6, backend="reference")
    out32, _ = add_rms_norm(x.float(), residual.float(), w, 1e-6, backend="reference")
    torch.testing.assert_close(new_residual, add_rms_norm(x, residual, w,
                                                          backend="reference")[1])
    ref_q, ref_scales = dynamic_per_token_quant(out32, backend="reference")
    assert_int8_close(q, ref_q)
    torch.testing.assert_close(scales, ref_scales, atol=1e-6, rtol=1e-5)
    static_q, static_scale, _ = add_rms_norm_quant(x, residual, w, 1e-6, scale=0.02, offset=-3,
                                                   backend="reference")
    assert static_scale.tolist() == [pytest.approx(0.02)] and static_scale.dtype == torch.float32
    expected = (torch.round(out32 / torch.tensor(0.02)) - 3).clamp(-128, 127)
    assert_int8_close(static_q, expected.to(torch.int8))


def test_static_quant_saturates():
    x = torch.full((1, 4), 10.0)
    q, _, _ = add_rms_norm_quant(x, torch.zeros_like(x), torch.ones(4), scale=0.001, offset=5,
                                 backend="reference")
    assert q.tolist() == [[127] * 4]
    q, _, _ = add_rms_norm_quant(-x, torch.zeros_like(x), torch.ones(4), scale=0.001,
                                 offset=-5, backend="reference")
    assert q.tolist() == [[-128] * 4]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("static", [None, "scale", "scale+offset", "tensor"])
def test_add_rms_norm_quant_triton_matches_reference(dtype, shape, static):
    torch.manual_seed(3)
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.rand(shape[-1], dtype=dtype) + 0.5
    kwargs = {None: {}, "scale": {"scale": 0.015}, "scale+offset": {"scale": 0.02, "offset": 7},
              "tensor": {"scale": torch.tensor([0.01]), "offset": torch.tensor(-4)}}[static]
    q, scales, new_residual = add_rms_norm_quant(x, residual, w, backend="triton", **kwargs)
    ref_q, ref_scales, ref_residual = add_rms_norm_quant(x, residual, w, backend="reference",
                                                         **kwargs)
    assert scales.shape == ((1,) if static else shape[:-1])
    torch.testing.assert_close(scales, ref_scales, atol=1e-6, rtol=1e-5)
    assert_int8_close(q, ref_q)
    assert_close(new_residual, ref_residual, dtype)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"offset": 3}, ValueError, "an offset needs a static scale"),
    ({"scale": torch.ones(4)}, ValueError, "a static scale is one value"),
    ({"scale": "0.1"}, TypeError, "scale must be a float or a one-element tensor"),
    ({"scale": 0.1, "offset": 200}, ValueError, "offset 200 is outside int8"),
    ({"scale": 0.1, "offset": torch.tensor([0.5])}, ValueError, "offset must be one integer"),
])
def test_add_rms_norm_quant_bad_arguments(kwargs, error, match):
    x = torch.ones(2, 4)
    with pytest.raises(error, match=match):
        add_rms_norm_quant(x, x, torch.ones(4), **kwargs)


# --- scaled_int8_mm -----------------------------------------------------------------------


def _int8(*shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8)


def test_scaled_int8_mm_reference_is_exact_then_scaled():
    torch.manual_seed(4)
    a, b = _int8(5, 300), _int8(300, 7)
    scale_a, scale_b, bias = torch.rand(5), torch.rand(7), torch.randn(7)
    out = scaled_int8_mm(a, b, scale_a, scale_b, torch.float32, bias, backend="reference")
    exact = a.double() @ b.double()
    expected = exact * scale_a.double()[:, None] * scale_b.double()[None, :] + bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-3)


@needs_triton
@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(1, 16, 8), (33, 70, 20), (70, 129, 65)])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_scaled_int8_mm_triton_matches_reference(out_dtype, m, k, n, per_tensor):
    torch.manual_seed(5)
    a, b = _int8(m, k), _int8(k, n)
    scale_a = torch.rand(1) / 50 if per_tensor else torch.rand(m, 1) / 50
    scale_b = torch.rand(1) / 50 if per_tensor else torch.rand(n) / 50
    bias = None if per_tensor else torch.randn(n, dtype=out_dtype)
    out = scaled_int8_mm(a, b, scale_a, scale_b, out_dtype, bias, backend="triton")
    ref = scaled_int8_mm(a, b, scale_a, scale_b, out_dtype, bias, backend="reference")
    assert out.shape == (m, n) and out.dtype == out_dtype
    assert_close(out, ref, out_dtype)


@needs_triton
def test_scaled_int8_mm_triton_reads_a_transposed_weight():
    a, weight = _int8(6, 40), _int8(24, 40)  # a linear layer keeps [N, K]
    scale_a, scale_b = torch.rand(6), torch.rand(24)
    assert_close(scaled_int8_mm(a, weight.t(), scale_a, scale_b, torch.float32, backend="triton"),
                 scaled_int8_mm(a, weight.t(), scale_a, scale_b, torch.float32,
                                backend="reference"), torch.float32)


@needs_triton
@pytest.mark.parametrize("m, k, n", [(0, 8, 4), (3, 8, 0), (3, 0, 4)])
def test_scaled_int8_mm_empty(m, k, n):
    out = scaled_int8_mm(_int8(m, k), _int8(k, n), torch.ones(1), torch.ones(1),
                         backend="triton")
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    assert (out == 0).all()


@pytest.mark.parametrize("args, error, match", [
    ((torch.ones(2, 4), _int8(4, 3), torch.ones(2), torch.ones(3)), TypeError,
     "a has dtype torch.float32; it must be torch.int8"),
    ((_int8(2, 4), _int8(5, 3), torch.ones(2), torch.ones(3)), ValueError,
     r"a must be \[M, K\] and b \[K, N\]"),
    ((_int8(2, 4), _int8(4, 3), torch.ones(3), torch.ones(3)), ValueError,
     r"scale_a has shape \(3,\)"),
    ((_int8(2, 4), _int8(4, 3), torch.ones(2), torch.ones(3, dtype=torch.float16)), TypeError,
     "scale_b has dtype torch.float16; it must be torch.float32"),
    ((_int8(2, 4), _int8(4, 3), torch.ones(2), torch.ones(3), torch.int32), TypeError,
     "out_dtype torch.int32 is not"),
    ((_int8(2, 4), _int8(4, 3), torch.ones(2), torch.ones(3), torch.float32, torch.ones(4)),
     ValueError, r"bias has shape \(4,\); it must be \[3\]"),
])
def test_scaled_int8_mm_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        scaled_int8_mm(*args)


def test_forced_npu_without_torch_npu_is_refused(monkeypatch):
    import sys

    from ascend_kernels.dispatch import torch_npu_module

    torch_npu_module.cache_clear()
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    try:
        with pytest.raises(BackendUnavailable, match="needs torch_npu"):
            dynamic_per_token_quant(torch.ones(2, 4, dtype=torch.bfloat16), backend="npu")
    finally:
        torch_npu_module.cache_clear()
