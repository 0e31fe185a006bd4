import pytest
import torch

import ascend_kernels
from ascend_kernels import BackendUnavailable, rms_norm, silu_and_mul
from ascend_kernels.dispatch import torch_npu_module

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 64), (2, 5, 96), (0, 32), (1, 1)])
def test_rms_norm_matches_formula(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.rand(shape[-1], dtype=dtype) + 0.5
    out = rms_norm(x, w, eps=1e-5)
    x64 = x.double()
    expected = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 2 * 48), (2, 3, 2 * 7), (0, 8)])
def test_silu_and_mul_matches_formula(dtype, shape):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype)
    d = shape[-1] // 2
    out = silu_and_mul(x)
    a, b = x[..., :d].double(), x[..., d:].double()
    expected = a / (1 + torch.exp(-a)) * b
    assert out.shape == (*shape[:-1], d) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, atol=TOL[dtype] * 2, rtol=TOL[dtype])


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"hidden size of x \(8\) does not match weight \(4\)"):
        rms_norm(torch.ones(2, 8), torch.ones(4))
    with pytest.raises(ValueError, match="must be even, got 7"):
        silu_and_mul(torch.ones(2, 7))


def test_forcing_unknown_or_missing_backend_fails_loudly():
    x = torch.ones(2, 8)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        rms_norm(x, torch.ones(8), backend="cuda")
    with pytest.raises(BackendUnavailable, match="has no 'npu' backend"):
        ascend_kernels.l2norm(x, backend="npu")


def test_npu_backend_needs_torch_npu(monkeypatch):
    torch_npu_module.cache_clear()
    monkeypatch.setitem(__import__("sys").modules, "torch_npu", None)
    try:
        with pytest.raises(BackendUnavailable, match="needs torch_npu"):
            rms_norm(torch.ones(2, 8), torch.ones(8), backend="npu")
    finally:
        torch_npu_module.cache_clear()


def test_version_is_exported():
    assert ascend_kernels.__version__.count(".") == 2
