"""scaled_int8_mm's CPU reference path: exact int32 accumulation whether torch._int_mm
takes the inputs or the int32 matmul fallback runs."""

import pytest
import torch

import ascend_kernels
from ascend_kernels import quant


def _exact(a, b, scale_a, scale_b, bias=None):
    acc = (a.long() @ b.long()).double()
    out = acc * scale_a.double().reshape(-1, 1) * scale_b.double().reshape(1, -1)
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("shape", [(1, 4096, 64), (3, 5, 7), (17, 33, 65), (64, 256, 16)])
def test_int8_mm_is_exact_on_cpu(shape):
    m, k, n = shape
    torch.manual_seed(0)
    a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    b = torch.randint(-128, 128, (k, n), dtype=torch.int8)
    sa, sb = torch.rand(m) + 0.5, torch.rand(n) + 0.5
    bias = torch.randn(n)
    out = ascend_kernels.scaled_int8_mm(a, b, sa, sb, torch.float32, bias, backend="reference")
    torch.testing.assert_close(out.double(), _exact(a, b, sa, sb, bias), rtol=1e-6, atol=1e-3)


def test_extreme_sums_stay_exact():
    """-128 * -128 summed over K = 4096 is 2**26: beyond float32's exact integers, so the
    accumulation must be integer."""
    a = torch.full((2, 4096), -128, dtype=torch.int8)
    b = torch.full((4096, 3), -128, dtype=torch.int8)
    b[0, 0] = 127  # breaks the power of two
    acc = quant._int_matmul(a, b)
    expected = (a.long() @ b.long()).float()
    assert torch.equal(acc, expected)


def test_falls_back_to_the_int32_matmul(monkeypatch):
    calls = []

    def refusing(a, b):
        calls.append(1)
        raise RuntimeError("_int_mm: not for these inputs")

    monkeypatch.setattr(torch, "_int_mm", refusing)
    a = torch.randint(-128, 128, (4, 40), dtype=torch.int8)
    b = torch.randint(-128, 128, (40, 8), dtype=torch.int8)
    out = quant._int_matmul(a, b)
    assert calls and torch.equal(out, (a.long() @ b.long()).float())


def test_non_contiguous_weight_views():
    a = torch.randint(-128, 128, (5, 48), dtype=torch.int8)
    b = torch.randint(-128, 128, (24, 48), dtype=torch.int8).t()  # [48, 24], column-major
    assert torch.equal(quant._int_matmul(a, b), (a.long() @ b.long()).float())
