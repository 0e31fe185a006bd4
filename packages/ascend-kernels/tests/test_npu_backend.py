"""The torch_npu backends, run on the reference torch_npu (testing/reference_torch_npu)."""

import sys
from pathlib import Path

import pytest
import torch

import ascend_kernels
from ascend_kernels.dispatch import torch_npu_module

REFERENCE_TORCH_NPU = Path(__file__).resolve().parents[3] / "testing" / "reference_torch_npu"


@pytest.fixture(scope="module")
def reference_torch_npu():
    sys.path.insert(0, str(REFERENCE_TORCH_NPU))
    torch_npu_module.cache_clear()
    module = torch_npu_module()
    assert module is not None and "reference" in module.__version__
    yield module
    sys.path.remove(str(REFERENCE_TORCH_NPU))
    torch_npu_module.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_npu_equals_reference(reference_torch_npu, dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 256, dtype=dtype)
    w = torch.rand(256, dtype=dtype) + 0.5
    npu = ascend_kernels.rms_norm(x, w, 1e-6, backend="npu")
    ref = ascend_kernels.rms_norm(x, w, 1e-6, backend="reference")
    assert npu.dtype == dtype
    torch.testing.assert_close(npu, ref, atol=2e-2 if dtype != torch.float32 else 1e-5,
                               rtol=2e-2 if dtype != torch.float32 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_npu_equals_reference(reference_torch_npu, dtype):
    x = torch.randn(5, 2 * 64, dtype=dtype)
    npu = ascend_kernels.silu_and_mul(x, backend="npu")
    ref = ascend_kernels.silu_and_mul(x, backend="reference")
    assert npu.shape == (5, 64)
    torch.testing.assert_close(npu, ref, atol=2e-2 if dtype != torch.float32 else 1e-5,
                               rtol=2e-2 if dtype != torch.float32 else 1e-5)
