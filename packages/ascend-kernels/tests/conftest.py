"""Shared setup of the ascend-kernels tests.

Triton reads ``TRITON_INTERPRET`` when a kernel module is imported (at ``@triton.jit``),
so it is set here, before any test imports one: the Triton backend then runs on CPU
tensors in Triton's interpreter. The Triton tests need the ``test`` extra (triton); where
it is missing they fail, saying so, rather than skip.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from ascend_kernels.dispatch import torch_npu_module, triton_module  # noqa: E402

REFERENCE_TORCH_NPU = Path(__file__).resolve().parents[3] / "testing" / "reference_torch_npu"

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Tolerances of a float result against the float32 reference rounded to the dtype.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}

needs_triton = pytest.mark.needs_triton


def pytest_configure(config):
    config.addinivalue_line("markers", "needs_triton: runs a Triton kernel (interpreted on CPU)")


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_triton") and triton_module() is None:
        pytest.fail("triton is not installed: install ascend-kernels[test] to run these tests")


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[dtype] * scale
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def assert_int8_close(actual: torch.Tensor, expected: torch.Tensor,
                      max_off_by_one: float = 0.01) -> None:
    """int8 results may differ by one step where a value sits on a rounding boundary
    (another rounding of an intermediate); never by more, and rarely."""
    assert actual.dtype == torch.int8 and actual.shape == expected.shape
    diff = (actual.int() - expected.int()).abs()
    if diff.numel():
        assert diff.max().item() <= 1
        assert (diff > 0).float().mean().item() <= max_off_by_one


@pytest.fixture(scope="session")
def reference_torch_npu():
    """The reference torch_npu (testing/reference_torch_npu) as ``torch_npu``."""
    sys.path.insert(0, str(REFERENCE_TORCH_NPU))
    torch_npu_module.cache_clear()
    module = torch_npu_module()
    assert module is not None and "reference" in module.__version__
    yield module
    sys.path.remove(str(REFERENCE_TORCH_NPU))
    torch_npu_module.cache_clear()
