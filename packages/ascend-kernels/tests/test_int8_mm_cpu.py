"""scaled_int8_mm's CPU reference path: exact int32 accumulation whether torch._int_mm
takes the inputs, refuses them, or is inexact on this CPU (oneDNN without VNNI)."""

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


@pytest.fixture
def fresh_probe():
    quant._cpu_int_mm_is_exact.cache_clear()
    yield
    quant._cpu_int_mm_is_exact.cache_clear()


def test_falls_back_to_the_float64_matmul(monkeypatch, fresh_probe):
    calls = []

    def refusing(a, b):
        calls.append(1)
        raise RuntimeError("_int_mm: not for these inputs")

    monkeypatch.setattr(torch, "_int_mm", refusing)
    a = torch.randint(-128, 128, (4, 40), dtype=torch.int8)
    b = torch.randint(-128, 128, (40, 8), dtype=torch.int8)
    out = quant._int_matmul(a, b)
    assert calls and torch.equal(out, (a.long() @ b.long()).float())


def _saturating_int_mm(a, b):
    """oneDNN's int8 GEMM on a CPU without VNNI: a shifted to u8, pairs of u8 x s8
    products summed in saturating int16 (vpmaddubsw), then the shift taken back."""
    u = a.long() + 128
    bl = b.long()
    prods = u.unsqueeze(2) * bl.unsqueeze(0)  # [m, k, n]
    if prods.shape[1] % 2:
        prods = torch.cat([prods, torch.zeros_like(prods[:, :1])], 1)
    pairs = (prods[:, 0::2] + prods[:, 1::2]).clamp(-32768, 32767)
    return (pairs.sum(1) - 128 * bl.sum(0)).to(torch.int32)


def test_an_inexact_int_mm_is_found_and_not_used(monkeypatch, fresh_probe):
    monkeypatch.setattr(torch, "_int_mm", _saturating_int_mm)
    a = torch.full((3, 64), 127, dtype=torch.int8)
    b = torch.full((64, 5), 127, dtype=torch.int8)
    assert not torch.equal(_saturating_int_mm(a, b), (a.long() @ b.long()).int())
    assert not quant._cpu_int_mm_is_exact()
    assert torch.equal(quant._int_matmul(a, b), (a.long() @ b.long()).float())


def test_the_probe_accepts_an_exact_int_mm(monkeypatch, fresh_probe):
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: a.to(torch.int32) @ b.to(torch.int32))
    assert quant._cpu_int_mm_is_exact()


def test_non_contiguous_weight_views():
    a = torch.randint(-128, 128, (5, 48), dtype=torch.int8)
    b = torch.randint(-128, 128, (24, 48), dtype=torch.int8).t()  # [48, 24], column-major
    assert torch.equal(quant._int_matmul(a, b), (a.long() @ b.long()).float())
