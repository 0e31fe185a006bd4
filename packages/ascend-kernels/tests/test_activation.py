"""silu_and_mul: the Triton backend (in Triton's interpreter) against the reference."""

import pytest
import torch

from ascend_kernels import silu_and_mul

from conftest import DTYPES, assert_close, needs_triton


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 2 * 96), (1, 2 * 1500), (2, 3, 2 * 7), (0, 16), (4, 2)])
def test_silu_and_mul_triton_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype) * 2
    out = silu_and_mul(x, backend="triton")
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, silu_and_mul(x, backend="reference"), dtype, scale=2)


@needs_triton
def test_silu_and_mul_triton_reads_strided_rows():
    wide = torch.randn(5, 100)
    x = wide[:, :64]
    assert_close(silu_and_mul(x, backend="triton"), silu_and_mul(x, backend="reference"),
                 torch.float32)


def test_silu_and_mul_refuses_integer_input():
    with pytest.raises(TypeError, match="x has dtype torch.int64"):
        silu_and_mul(torch.ones(2, 4, dtype=torch.int64))
