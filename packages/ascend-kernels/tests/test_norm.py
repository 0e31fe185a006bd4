"""rms_norm, add_rms_norm and l2norm: the references against the formulas, the Triton
backend (in Triton's interpreter) against the references."""

import pytest
import torch

from ascend_kernels import BackendUnavailable, add_rms_norm, l2norm, rms_norm

from conftest import DTYPES, TOL, assert_close, needs_triton

# Hidden sizes that are not powers of two, one token, several leading dims, no tokens.
SHAPES = [(3, 96), (1, 200), (2, 5, 24), (0, 32), (7, 1)]


def _rms_formula(x64: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_reference_matches_formula(dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(4, 48, dtype=dtype), torch.randn(4, 48, dtype=dtype)
    w = torch.rand(48, dtype=dtype) + 0.5
    out, new_residual = add_rms_norm(x, residual, w, 1e-5, backend="reference")
    added = x.double() + residual.double()
    torch.testing.assert_close(new_residual, added.to(dtype))
    torch.testing.assert_close(out.double(), _rms_formula(added, w, 1e-5),
                               atol=TOL[dtype] * 2, rtol=TOL[dtype] * 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_l2norm_reference_matches_formula(dtype):
    x = torch.randn(3, 40, dtype=dtype)
    out = l2norm(x, eps=1e-6, backend="reference")
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).sum(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert l2norm(x, out_dtype=torch.float32, backend="reference").dtype == torch.float32


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_triton_matches_reference(dtype, shape):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.rand(shape[-1], dtype=dtype) + 0.5
    out = rms_norm(x, w, 1e-6, backend="triton")
    assert_close(out, rms_norm(x, w, 1e-6, backend="reference"), dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_triton_matches_reference(dtype, shape):
    torch.manual_seed(2)
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.rand(shape[-1], dtype=torch.float32) + 0.5  # a float32 weight is fine too
    out, new_residual = add_rms_norm(x, residual, w, 1e-6, backend="triton")
    ref_out, ref_residual = add_rms_norm(x, residual, w, 1e-6, backend="reference")
    assert_close(out, ref_out, dtype, scale=2)
    assert_close(new_residual, ref_residual, dtype)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_l2norm_triton_matches_reference(dtype, shape):
    x = torch.randn(shape, dtype=dtype)
    assert_close(l2norm(x, backend="triton"), l2norm(x, backend="reference"), dtype)
    out32 = l2norm(x, out_dtype=torch.float32, backend="triton")
    assert_close(out32, l2norm(x, out_dtype=torch.float32, backend="reference"), torch.float32)


@needs_triton
def test_triton_norms_read_strided_rows():
    # Rows of a wider buffer (a slice of a fused projection): no copy is needed.
    torch.manual_seed(3)
    wide = torch.randn(6, 80, dtype=torch.bfloat16)
    x, residual = wide[:, :48], wide[:, 16:64]
    w = torch.rand(48, dtype=torch.bfloat16) + 0.5
    assert_close(rms_norm(x, w, backend="triton"), rms_norm(x, w, backend="reference"),
                 torch.bfloat16)
    for got, want in zip(add_rms_norm(x, residual, w, backend="triton"),
                         add_rms_norm(x, residual, w, backend="reference")):
        assert_close(got, want, torch.bfloat16, scale=2)
    transposed = torch.randn(48, 5).t()  # last dim not contiguous: copied first
    assert_close(l2norm(transposed, backend="triton"), l2norm(transposed, backend="reference"),
                 torch.float32)


def test_auto_backend_on_cpu_is_the_reference(monkeypatch):
    import ascend_kernels.triton_kernels.norm as triton_norm

    def fail(*args, **kwargs):
        raise AssertionError("the Triton kernel ran for a CPU tensor under auto dispatch")

    monkeypatch.setattr(triton_norm, "rms_norm", fail)
    x = torch.randn(2, 16)
    assert_close(rms_norm(x, torch.ones(16)), rms_norm(x, torch.ones(16), backend="reference"),
                 torch.float32)


@pytest.mark.parametrize("call, error, match", [
    (lambda: rms_norm(torch.ones(2, 8), torch.ones(2, 8)), ValueError,
     r"weight \(shape \(2, 8\)\); weight must be \[hidden\]"),
    (lambda: rms_norm(torch.ones(2, 8, dtype=torch.int32), torch.ones(8)), TypeError,
     "x has dtype torch.int32"),
    (lambda: add_rms_norm(torch.ones(2, 8), torch.ones(3, 8), torch.ones(8)), ValueError,
     r"residual has shape \(3, 8\) but x has \(2, 8\)"),
    (lambda: add_rms_norm(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16),
                          torch.ones(8)), TypeError,
     "residual has dtype torch.float16 but x has torch.float32"),
    (lambda: l2norm(torch.ones(2, 8), out_dtype=torch.int8), TypeError,
     "out_dtype torch.int8 is not a float dtype"),
    (lambda: l2norm(torch.ones(2, 8), backend="npu"), BackendUnavailable,
     "l2norm has no 'npu' backend"),
])
def test_bad_inputs_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_triton_needs_the_interpreter_for_cpu_tensors(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
        rms_norm(torch.ones(2, 8), torch.ones(8), backend="triton")


def test_triton_refuses_rows_longer_than_its_block(monkeypatch):
    import ascend_kernels.triton_kernels as triton_kernels

    monkeypatch.setattr(triton_kernels, "MAX_ROW_BLOCK", 16)
    with pytest.raises(BackendUnavailable, match="rows of 32 elements exceed"):
        rms_norm(torch.ones(2, 32), torch.ones(32), backend="triton")
