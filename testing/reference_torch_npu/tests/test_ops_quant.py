"""The reference's weight-quantization and grouped-matmul ops against plain torch math and
the argument rules of their torch_npu documentation pages."""

from __future__ import annotations

import pytest
import torch

HALF = [torch.float16, torch.bfloat16]
ATOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}




def _close(actual, expected, dtype, scale=1.0):
    assert actual.dtype == dtype
    tol = ATOL[dtype] * scale
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


# --- npu_quantize -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_quantize_div_mode_divides_and_adds_the_zero_point(torch_npu, dtype):
    x = torch.randn(4, 6, 32, dtype=dtype) * 3
    scale = torch.tensor([0.05])
    out = torch_npu.npu_quantize(x, scale, torch.tensor([3], dtype=torch.int32),
                                 torch.qint8, -1, True)
    expected = torch.round(x.float() / 0.05 + 3).clamp(-128, 127).to(torch.int8)
    assert out.dtype == torch.int8 and torch.equal(out, expected)
    assert int(out.max()) == 127  # |x| / 0.05 exceeds int8: saturated


def test_quantize_per_channel_scales_run_along_axis(torch_npu):
    x = torch.randn(5, 8)
    per_row = torch.rand(5) + 0.1
    out = torch_npu.npu_quantize(x, per_row, None, torch.qint8, 0, True)
    assert torch.equal(out, torch.round(x / per_row[:, None]).clamp(-128, 127).to(torch.int8))
    per_col = torch.rand(8) + 0.1
    out = torch_npu.npu_quantize(x, per_col, None, torch.qint8, -1, True)
    assert torch.equal(out, torch.round(x / per_col).clamp(-128, 127).to(torch.int8))


def test_quantize_multiply_mode_and_axis_minus_two(torch_npu):
    x = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    scales = torch.full((16,), 20.0, dtype=torch.bfloat16)
    zeros = torch.full((16,), -1.0, dtype=torch.bfloat16)
    out = torch_npu.npu_quantize(x, scales, zeros, torch.qint8, -1, False)
    assert torch.equal(out, torch.round(x.float() * 20 - 1).clamp(-128, 127).to(torch.int8))
    rows = torch.rand(1, 3, 1) * 10
    out = torch_npu.npu_quantize(x.float(), rows, None, torch.qint8, -2, False)
    assert torch.equal(out, torch.round(x.float() * rows).clamp(-128, 127).to(torch.int8))


def test_quantize_to_quint4x2_packs_eight_saturated_values_per_word(torch_npu):
    x = torch.tensor([[0.0, 1, -1, 7, -8, 20, -20, 3, 2, 2, 2, 2, 2, 2, 2, -2]])
    out = torch_npu.npu_quantize(x, torch.tensor([1.0]), None, torch.quint4x2, -1, False)
    assert out.dtype == torch.int32 and out.shape == (1, 2)
    words = out.to(torch.int64) & 0xFFFFFFFF
    nibbles = [(int(words[0, w]) >> (4 * j)) & 0xF for w in range(2) for j in range(8)]
    signed = [v - 16 if v >= 8 else v for v in nibbles]
    assert signed == [0, 1, -1, 7, -8, 7, -8, 3, 2, 2, 2, 2, 2, 2, 2, -2]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"scales": torch.tensor([1.0], dtype=torch.float16)}, RuntimeError, "div_mode=True"),
    ({"zero_points": torch.tensor([1.0])}, RuntimeError, "zero_points has dtype"),
    ({"scales": torch.ones(3)}, RuntimeError, "1 or input.shape"),
    ({"dtype": torch.quint8}, NotImplementedError, "not modelled"),
    ({"dtype": torch.float16}, RuntimeError, "dtype must be"),
    ({"dtype": torch.quint4x2}, RuntimeError, "div_mode=False"),
    ({"scales": torch.ones(1, 8)}, NotImplementedError, "multi-dim|dim scales"),
    ({"div_mode": False, "axis": -3}, RuntimeError, r"\[-2"),
    ({"div_mode": False, "zero_points": torch.ones(1, dtype=torch.bfloat16)}, RuntimeError,
     "scales' shape and dtype"),
])
def test_quantize_refuses_what_the_page_rules_out(torch_npu, kwargs, error, match):
    args = {"input": torch.randn(4, 8), "scales": torch.tensor([0.1]), "zero_points": None,
            "dtype": torch.qint8, "axis": -1, "div_mode": True} | kwargs
    with pytest.raises(error, match=match):
        torch_npu.npu_quantize(**args)


@pytest.mark.parametrize("dtype", [torch.qint32, torch.int32])
def test_quantize_to_int32_rounds_half_even_and_saturates(torch_npu, dtype):
    # The page's int32 output (div_mode=True): input / scales + zero_points, rounded and
    # held in int32; values past the int32 range saturate.
    x = torch.tensor([[2.5, -2.5, 3.5, 7.0], [1e10, -1e10, 0.4, -0.6]])
    scales = torch.tensor([1.0, 1.0, 1.0, 0.5])
    zero_points = torch.tensor([0, 0, 0, 100], dtype=torch.int32)
    out = torch_npu.npu_quantize(x, scales, zero_points, dtype, -1, True)
    assert out.dtype == torch.int32
    assert out.tolist() == [[2, -2, 4, 114], [2**31 - 1, -(2**31), 0, 99]]
    npu_out = torch_npu.npu_quantize(x.to("npu"), scales.to("npu"), zero_points.to("npu"),
                                     dtype, -1, True)
    assert torch.equal(npu_out.cpu(), out)
    with pytest.raises(RuntimeError, match="div_mode=True"):
        torch_npu.npu_quantize(x, scales, None, dtype, -1, False)


# --- npu_convert_weight_to_int4pack -------------------------------------------------------


def test_int4pack_packs_eight_nibbles_low_first(torch_npu):
    torch.manual_seed(0)
    w = torch.randint(-8, 8, (6, 24), dtype=torch.int32)
    packed = torch_npu.npu_convert_weight_to_int4pack(w)
    assert packed.dtype == torch.int32 and packed.shape == (6, 3)
    as_bytes = packed.contiguous().view(torch.uint8).reshape(6, 12)  # little endian
    low = (as_bytes & 0xF).to(torch.int16)
    high = (as_bytes >> 4).to(torch.int16)
    values = torch.stack([low, high], -1).reshape(6, 24)
    values = torch.where(values >= 8, values - 16, values)
    assert torch.equal(values.to(torch.int32), w)


@pytest.mark.parametrize(("weight", "kwargs", "error", "match"), [
    (torch.zeros(4, 8, dtype=torch.int8), {}, RuntimeError, "int32"),
    (torch.zeros(4, 12, dtype=torch.int32), {}, RuntimeError, "multiple of 8"),
    (torch.full((4, 8), 8, dtype=torch.int32), {}, RuntimeError, r"\[-8, 7\]"),
    (torch.zeros(8, 4, dtype=torch.int32).t(), {}, RuntimeError, "contiguous"),
    (torch.zeros(2, 4, 8, dtype=torch.int32), {}, RuntimeError, "2-D"),
    (torch.zeros(4, 8, dtype=torch.int32), {"inner_k_tiles": 2}, RuntimeError, "inner_k_tiles"),
])
def test_int4pack_refuses(torch_npu, weight, kwargs, error, match):
    with pytest.raises(error, match=match):
        torch_npu.npu_convert_weight_to_int4pack(weight, **kwargs)


# --- npu_weight_quant_batchmatmul ---------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_weight_quant_matmul_int8_per_channel_with_offset_and_bias(torch_npu, dtype):
    torch.manual_seed(1)
    x = torch.randn(5, 64, dtype=dtype)
    w = torch.randint(-128, 128, (64, 48), dtype=torch.int8)
    scale = (torch.rand(48) * 0.01).to(dtype)
    offset = torch.randint(-3, 3, (48,)).to(dtype)
    bias = torch.randn(48, dtype=torch.float32 if dtype == torch.bfloat16 else dtype)
    out = torch_npu.npu_weight_quant_batchmatmul(x, w, scale, offset, bias=bias)
    expected = x.float() @ ((w.float() + offset.float()) * scale.float()) + bias.float()
    _close(out, expected, dtype, scale=4)
    # (1, N) scales and a transposed weight view give the same
    wt = w.t().contiguous().t()
    again = torch_npu.npu_weight_quant_batchmatmul(x, wt, scale.reshape(1, 48),
                                                   offset.reshape(1, 48), bias=bias)
    assert torch.equal(again, out)


def test_weight_quant_matmul_int4_packed_grouped(torch_npu):
    torch.manual_seed(2)
    k, n, group = 128, 16, 32
    x = torch.randn(3, k, dtype=torch.bfloat16)
    w = torch.randint(-8, 8, (k, n), dtype=torch.int32)
    packed = torch_npu.npu_convert_weight_to_int4pack(w)
    scale = (torch.rand(k // group, n) * 0.1).to(torch.bfloat16)
    out = torch_npu.npu_weight_quant_batchmatmul(x, packed, scale, antiquant_group_size=group)
    deq = w.float() * scale.float().repeat_interleave(group, 0)
    _close(out, x.float() @ deq, torch.bfloat16, scale=2)
    # the transposed form: (N, K) packed along K, passed as its transpose
    packed_nk = torch_npu.npu_convert_weight_to_int4pack(w.t().contiguous())
    again = torch_npu.npu_weight_quant_batchmatmul(x, packed_nk.t(), scale,
                                                   antiquant_group_size=group)
    assert torch.equal(again, out)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"x": torch.randn(2, 64)}, RuntimeError, "x has dtype"),
    ({"antiquant_scale": torch.ones(16)}, RuntimeError, "x's"),
    ({"antiquant_scale": torch.ones(3, dtype=torch.float16)}, RuntimeError, "per channel"),
    ({"antiquant_group_size": 16,
      "antiquant_scale": torch.ones(4, 16, dtype=torch.float16)}, RuntimeError, "multiple of 32"),
    ({"antiquant_group_size": 32}, RuntimeError, "per-group antiquant_scale"),
    ({"antiquant_offset": torch.ones(16)}, RuntimeError, "antiquant_offset"),
    ({"bias": torch.ones(16)}, RuntimeError, "bias has dtype"),
    ({"quant_scale": torch.ones(16)}, NotImplementedError, "quant_scale"),
    ({"antiquant_scale": torch.ones(16, dtype=torch.int64)}, NotImplementedError, "int64"),
    ({"weight": torch.zeros(32, 16, dtype=torch.int8)}, RuntimeError, "do not multiply"),
    ({"inner_precise": 2}, RuntimeError, "inner_precise"),
])
def test_weight_quant_matmul_refuses(torch_npu, kwargs, error, match):
    args = {"x": torch.randn(2, 64, dtype=torch.float16),
            "weight": torch.zeros(64, 16, dtype=torch.int8),
            "antiquant_scale": torch.ones(16, dtype=torch.float16)} | kwargs
    with pytest.raises(error, match=match):
        torch_npu.npu_weight_quant_batchmatmul(**args)


# --- npu_grouped_matmul -------------------------------------------------------------------


def _groups(counts):
    return torch.tensor(counts, dtype=torch.int64)


@pytest.mark.parametrize("list_type", [0, 1])
def test_grouped_matmul_int8_per_token_single_weight(torch_npu, list_type):
    torch.manual_seed(3)
    counts = [3, 0, 5]
    m, k, n = sum(counts), 32, 24
    x = torch.randint(-128, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-128, 128, (3, k, n), dtype=torch.int8)
    scale = (torch.rand(3, n) * 1e-3).to(torch.bfloat16)
    tokens = torch.rand(m) * 0.1
    group_list = _groups(counts if list_type else [3, 3, 8])
    (out,) = torch_npu.npu_grouped_matmul(
        [x], [w], scale=[scale], per_token_scale=[tokens], group_list=group_list,
        split_item=2, group_type=0, group_list_type=list_type, output_dtype=torch.bfloat16)
    expert = [0] * 3 + [2] * 5
    expected = torch.stack([(x[i].double() @ w[e].double()).float() * scale[e].float()
                            * tokens[i] for i, e in enumerate(expert)])
    _close(out, expected, torch.bfloat16)


def test_grouped_matmul_multi_weight_float_with_bias(torch_npu):
    torch.manual_seed(4)
    x = torch.randn(6, 16, dtype=torch.float16)
    ws = [torch.randn(16, 8, dtype=torch.float16) for _ in range(2)]
    biases = [torch.randn(8, dtype=torch.float16) for _ in range(2)]
    (out,) = torch_npu.npu_grouped_matmul([x], ws, bias=biases, group_list=_groups([2, 4]),
                                          split_item=3, group_type=0, group_list_type=1)
    expected = torch.cat([x[:2].float() @ ws[0].float() + biases[0].float(),
                          x[2:].float() @ ws[1].float() + biases[1].float()])
    _close(out, expected, torch.float16, scale=4)


@pytest.mark.parametrize("list_type", [0, 1])
def test_grouped_matmul_group_type_2_groups_along_k(torch_npu, list_type):
    # The page's A2/A3 group_type=2 row: x (M, K) transposed, weight (K, N), group_list
    # over K, y (g, M, N) with y[i] = x[:, k_i] @ weight[k_i, :].
    torch.manual_seed(9)
    m, k, n = 3, 12, 5
    x = torch.randn(k, m, dtype=torch.bfloat16).t()
    w = torch.randn(k, n, dtype=torch.bfloat16)
    sizes = [4, 0, 8]
    group_list = torch.tensor(sizes if list_type else [4, 4, 12])
    (out,) = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=3,
                                         group_type=2, group_list_type=list_type)
    assert out.shape == (3, m, n) and out.dtype == torch.bfloat16
    starts = [0, 4, 4]
    for i, (start, size) in enumerate(zip(starts, sizes)):
        expected = x[:, start:start + size].float() @ w[start:start + size].float()
        torch.testing.assert_close(out[i].float(), expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(out[1], torch.zeros(m, n, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="x transposed"):
        torch_npu.npu_grouped_matmul([x.contiguous()], [w], group_list=group_list,
                                     split_item=3, group_type=2, group_list_type=list_type)
    with pytest.raises(RuntimeError, match="covers"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=torch.tensor([4, 4, 11]),
                                     split_item=3, group_type=2)
    with pytest.raises(NotImplementedError, match="bias with group_type=2"):
        torch_npu.npu_grouped_matmul([x], [w], bias=[torch.zeros(3, n)],
                                     group_list=group_list, split_item=3, group_type=2,
                                     group_list_type=list_type)


def _gmm_reference(x, w, b=None):
    out = x.float() @ w.float()
    return out + b.float() if b is not None else out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split_item", [0, 1])
def test_grouped_matmul_multi_multi_multi_multiplies_each_pair(torch_npu, dtype, split_item):
    """group_type=-1: one output per (x_i, weight_i), x of any shared rank from 2 to 6."""
    torch.manual_seed(8)
    bias_dtype = torch.float16 if dtype == torch.float16 else torch.float32
    xs = [torch.randn(2, 3, 16, dtype=dtype), torch.randn(4, 1, 8, dtype=dtype)]
    ws = [torch.randn(16, 5, dtype=dtype), torch.randn(8, 12, dtype=dtype)]
    bs = [torch.randn(5, dtype=bias_dtype), torch.randn(12, dtype=bias_dtype)]
    outs = torch_npu.npu_grouped_matmul(xs, ws, bias=bs, split_item=split_item, group_type=-1)
    assert [o.shape for o in outs] == [(2, 3, 5), (4, 1, 12)]
    for out, x, w, b in zip(outs, xs, ws, bs):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), _gmm_reference(x, w, b), atol=3e-2, rtol=2e-2)
    # Transposed weights (all of them) compute the same.
    wts = [w.t().contiguous().t() for w in ws]
    again = torch_npu.npu_grouped_matmul(xs, wts, bias=bs, split_item=split_item,
                                         group_type=-1)
    assert all(torch.equal(a, b) for a, b in zip(again, outs))


@pytest.mark.parametrize("list_type", [None, 0, 1])
def test_grouped_matmul_multi_multi_single_stacks_the_groups_along_m(torch_npu, list_type):
    torch.manual_seed(9)
    xs = [torch.randn(3, 16, dtype=torch.float16), torch.randn(0, 8, dtype=torch.float16),
          torch.randn(5, 4, dtype=torch.float16)]
    ws = [torch.randn(16, 6, dtype=torch.float16), torch.randn(8, 6, dtype=torch.float16),
          torch.randn(4, 6, dtype=torch.float16)]
    group_list = None if list_type is None else torch.tensor(
        [3, 3, 8] if list_type == 0 else [3, 0, 5])
    (out,) = torch_npu.npu_grouped_matmul(xs, ws, group_list=group_list, split_item=2,
                                          group_type=0, group_list_type=list_type or 0)
    expected = torch.cat([_gmm_reference(x, w) for x, w in zip(xs, ws)])
    assert out.shape == (8, 6) and out.dtype == torch.float16
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize(("xs", "ws", "kwargs", "match"), [
    ([torch.ones(2, 4, dtype=torch.float16)] * 2, [torch.ones(4, 3, dtype=torch.float16)] * 2,
     {"group_type": -1, "split_item": 2}, "takes split_item 0 or 1"),
    ([torch.ones(2, 4, dtype=torch.float16)] * 2, [torch.ones(4, 3, dtype=torch.float16)] * 2,
     {"group_type": -1, "group_list": torch.tensor([2, 4])}, "takes no group_list"),
    ([torch.ones(2, 4, dtype=torch.float16), torch.ones(1, 2, 4, dtype=torch.float16)],
     [torch.ones(4, 3, dtype=torch.float16)] * 2, {"group_type": -1}, "one rank"),
    ([torch.ones(2, 4, dtype=torch.float16)] * 2,
     [torch.ones(4, 3, dtype=torch.float16), torch.ones(4, 5, dtype=torch.float16)],
     {"group_type": 0, "split_item": 2}, "weights of one N"),
    ([torch.ones(2, 4, dtype=torch.float16)] * 2, [torch.ones(4, 3, dtype=torch.float16)] * 2,
     {"group_type": 0, "split_item": 2, "group_list": torch.tensor([1, 4])},
     "does not describe the x tensors' rows"),
    ([torch.ones(2, 4, dtype=torch.float16)] * 2, [torch.ones(4, 3, dtype=torch.float16)] * 2,
     {"group_type": 0, "split_item": 0}, "take split_item 2 or 3"),
    ([torch.ones(2, 4)] * 2, [torch.ones(4, 3)] * 2, {"group_type": -1}, "float32 only"),
    ([torch.ones(2, 4, dtype=torch.float16)] * 2, [torch.ones(4, 3, dtype=torch.float16)],
     {"group_type": -1}, "one of each per group"),
    ([torch.ones(2, 4, dtype=torch.float16)] * 2, [torch.ones(5, 3, dtype=torch.float16)] * 2,
     {"group_type": -1}, "is not weight's K"),
    ([torch.ones(4, 2, dtype=torch.float16).t()] * 2,
     [torch.ones(4, 3, dtype=torch.float16)] * 2, {"group_type": -1}, "transposition"),
    ([torch.ones(2, 4, dtype=torch.float16)] * 2,
     [torch.ones(4, 3, dtype=torch.float16), torch.ones(3, 4, dtype=torch.float16).t()],
     {"group_type": -1}, "all be transposed or none"),
])
def test_grouped_matmul_multi_x_refuses_what_the_page_rules_out(torch_npu, xs, ws, kwargs,
                                                                match):
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_grouped_matmul(xs, ws, **kwargs)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"group_list": [2, 6], "per_token_scale": None, "scale": None, "group_type": None},
     NotImplementedError,
     "int8 inputs or weights with a List"),
    ({"group_list": _groups([4, 2])}, RuntimeError, "non-decreasing"),
    ({"group_list": _groups([2, 5])}, RuntimeError, "covers 5 rows"),
    ({"group_list": _groups([6])}, RuntimeError, "one per weight group"),
    ({"split_item": 0}, NotImplementedError, "split_item"),
    ({"group_type": -1}, RuntimeError, r"weight\[0\] must be 2-D"),
    ({"group_type": 1}, RuntimeError, "group_type=1"),
    ({"group_type": 2}, RuntimeError, "group_type -1 and 0 only"),
    ({"act_type": 5}, NotImplementedError, "act_type"),
    ({"output_dtype": torch.float16}, RuntimeError, "scale has dtype"),
    ({"output_dtype": None}, NotImplementedError, "output_dtype"),
    ({"per_token_scale": [torch.rand(5)]}, RuntimeError, "per_token_scale"),
    ({"offset": [torch.zeros(8)]}, RuntimeError, "offset"),
    ({"antiquant_scale": [torch.ones(2, 8)]}, NotImplementedError, "antiquant"),
    ({"scale": [torch.ones(8, dtype=torch.bfloat16)]}, RuntimeError, r"\(2, 8\)"),
])
def test_grouped_matmul_refuses(torch_npu, kwargs, error, match):
    args = {"x": [torch.zeros(6, 16, dtype=torch.int8)],
            "weight": [torch.zeros(2, 16, 8, dtype=torch.int8)],
            "scale": [torch.ones(2, 8, dtype=torch.bfloat16)],
            "per_token_scale": [torch.ones(6)], "group_list": _groups([2, 6]),
            "split_item": 2, "group_type": 0, "output_dtype": torch.bfloat16} | kwargs
    x, weight = args.pop("x"), args.pop("weight")
    with pytest.raises(error, match=match):
        torch_npu.npu_grouped_matmul(x, weight, **args)


# --- npu_grouped_matmul, quantized multi-x forms ---------------------------------------------


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("per_token", [False, True])
def test_grouped_matmul_int8_multi_multi_multi(torch_npu, out_dtype, per_token):
    """group_type=-1 with int8 x and weights: y_i = (x_i @ w_i + bias_i) * scale_i *
    per_token_scale_i, written out with integer matmuls here."""
    gen = torch.Generator().manual_seed(15)
    scale_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    xs = [torch.randint(-128, 128, (3, 16), generator=gen, dtype=torch.int8),
          torch.randint(-128, 128, (2, 32), generator=gen, dtype=torch.int8)]
    ws = [torch.randint(-128, 128, (16, 4), generator=gen, dtype=torch.int8),
          torch.randint(-128, 128, (32, 6), generator=gen, dtype=torch.int8)]
    bs = [torch.randint(-500, 500, (4,), generator=gen, dtype=torch.int32),
          torch.randint(-500, 500, (6,), generator=gen, dtype=torch.int32)]
    scales = [(torch.rand(4, generator=gen) * 1e-3).to(scale_dtype),
              (torch.rand(6, generator=gen) * 1e-3).to(scale_dtype)]
    tokens = [torch.rand(3, generator=gen) + 0.5, torch.rand(2, generator=gen) + 0.5]
    outs = torch_npu.npu_grouped_matmul(
        xs, ws, bias=bs, scale=scales, per_token_scale=tokens if per_token else None,
        group_type=-1, split_item=0, output_dtype=out_dtype)
    for i, out in enumerate(outs):
        acc = xs[i].long() @ ws[i].long() + bs[i].long()
        want = acc.double() * scales[i].double()
        if per_token:
            want = want * tokens[i].double()[:, None]
        assert out.dtype == out_dtype and out.shape == want.shape
        torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


def test_grouped_matmul_int8_multi_multi_single_stacks_the_groups(torch_npu):
    gen = torch.Generator().manual_seed(16)
    xs = [torch.randint(-128, 128, (m, 16), generator=gen, dtype=torch.int8) for m in (2, 3)]
    ws = [torch.randint(-128, 128, (16, 8), generator=gen, dtype=torch.int8) for _ in range(2)]
    scales = [torch.rand(8, generator=gen) * 1e-3 for _ in range(2)]
    (out,) = torch_npu.npu_grouped_matmul(xs, ws, scale=scales, group_type=0, split_item=2,
                                          group_list=torch.tensor([2, 5]),
                                          output_dtype=torch.float16)
    want = torch.cat([(x.long() @ w.long()).double() * s.double()
                      for x, w, s in zip(xs, ws, scales)])
    torch.testing.assert_close(out.double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"scale": None}, NotImplementedError, "scale=None with several int8"),
    ({"output_dtype": None}, NotImplementedError, "output_dtype=None with int8"),
    ({"output_dtype": torch.float32}, RuntimeError, "not supported with int8"),
    ({"scale": [torch.ones(8, dtype=torch.int64)] * 2}, NotImplementedError, "scale in int64"),
    ({"scale": [torch.ones(8)] * 2}, RuntimeError, r"scale\[0\] is torch.float32"),
    ({"scale": [torch.ones(8, dtype=torch.bfloat16)]}, RuntimeError, "one per weight"),
    ({"per_token_scale": [torch.ones(2)]}, RuntimeError, "one per x tensor"),
    ({"per_token_scale": [torch.ones(3)] * 2}, RuntimeError, r"per_token_scale\[0\]"),
    ({"bias": [torch.ones(8)] * 2}, RuntimeError, "torch.int32 tensor per weight"),
    ({"act_type": 5}, NotImplementedError, "act_type"),
])
def test_grouped_matmul_int8_multi_x_refuses(torch_npu, kwargs, error, match):
    args = {"scale": [torch.ones(8, dtype=torch.bfloat16)] * 2, "group_type": -1,
            "split_item": 0, "output_dtype": torch.bfloat16} | kwargs
    with pytest.raises(error, match=match):
        torch_npu.npu_grouped_matmul([torch.zeros(2, 16, dtype=torch.int8)] * 2,
                                     [torch.zeros(16, 8, dtype=torch.int8)] * 2, **args)


# --- npu_grouped_matmul with a List[int] group_list (the .List overload) ----------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split_item", [2, 3])
def test_grouped_matmul_int_list_single_multi_single(torch_npu, dtype, split_item):
    """One x, one weight per group, the cumulative List[int] cutting x's rows (an empty
    group too); the same result as the Tensor group_list."""
    torch.manual_seed(12)
    bias_dtype = torch.float16 if dtype == torch.float16 else torch.float32
    x = torch.randn(7, 16, dtype=dtype)
    ws = [torch.randn(16, 8, dtype=dtype) for _ in range(3)]
    bs = [torch.randn(8, dtype=bias_dtype) for _ in range(3)]
    (out,) = torch_npu.npu_grouped_matmul([x], ws, bias=bs, group_list=[2, 2, 7],
                                          split_item=split_item)
    expected = torch.cat([_gmm_reference(x[:2], ws[0], bs[0]),
                          _gmm_reference(x[7:7], ws[1], bs[1]),
                          _gmm_reference(x[2:], ws[2], bs[2])])
    assert out.shape == (7, 8) and out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=3e-2, rtol=2e-2)
    (tensor_form,) = torch_npu.npu_grouped_matmul([x], ws, bias=bs, group_type=0,
                                                  group_list=torch.tensor([2, 2, 7]),
                                                  split_item=split_item)
    assert torch.equal(out, tensor_form)


def test_grouped_matmul_int_list_single_multi_multi(torch_npu):
    """One x, split_item 0: one output per group, of the group's rows and its weight's N."""
    torch.manual_seed(13)
    x = torch.randn(5, 16, dtype=torch.float16)
    ws = [torch.randn(16, 4, dtype=torch.float16), torch.randn(16, 6, dtype=torch.float16)]
    outs = torch_npu.npu_grouped_matmul([x], ws, group_list=[3, 5], split_item=0)
    assert [o.shape for o in outs] == [(3, 4), (2, 6)]
    torch.testing.assert_close(outs[0].float(), _gmm_reference(x[:3], ws[0]), atol=3e-2,
                               rtol=2e-2)
    torch.testing.assert_close(outs[1].float(), _gmm_reference(x[3:], ws[1]), atol=3e-2,
                               rtol=2e-2)


@pytest.mark.parametrize("split_item", [0, 2])
def test_grouped_matmul_int_list_with_several_x(torch_npu, split_item):
    """Several x: the list's steps must be the x tensors' rows (multi-multi-multi with
    split_item 0/1, multi-multi-single with 2/3)."""
    torch.manual_seed(14)
    xs = [torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(3, 8, dtype=torch.bfloat16)]
    ws = [torch.randn(8, 4, dtype=torch.bfloat16), torch.randn(8, 4, dtype=torch.bfloat16)]
    outs = torch_npu.npu_grouped_matmul(xs, ws, group_list=[2, 5], split_item=split_item)
    expected = [_gmm_reference(x, w) for x, w in zip(xs, ws)]
    if split_item == 2:
        expected = [torch.cat(expected)]
    assert len(outs) == len(expected)
    for out, want in zip(outs, expected):
        torch.testing.assert_close(out.float(), want, atol=5e-2, rtol=2e-2)
    with pytest.raises(RuntimeError, match="does not describe the x tensors' rows"):
        torch_npu.npu_grouped_matmul(xs, ws, group_list=[3, 5], split_item=split_item)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"group_list": [6]}, RuntimeError, "must not have length 1"),
    ({"group_list": [4, 2]}, RuntimeError, "non-negative and non-decreasing"),
    ({"group_list": [-1, 6]}, RuntimeError, "non-negative and non-decreasing"),
    ({"group_list": [2, 5]}, RuntimeError, "must end at x's M = 6"),
    ({"group_list": [2, 4, 6]}, RuntimeError, "3 groups but weight holds 2"),
    ({"group_list": [2, True]}, TypeError, "list of ints"),
    ({"group_type": 0}, RuntimeError, "group_type=0 with a List"),
    ({"group_list_type": 1}, RuntimeError, "group_list_type=1 with a List"),
    ({"act_type": 1}, RuntimeError, "act_type=1 with a List"),
    ({"per_token_scale": [torch.ones(6)]}, RuntimeError, "per_token_scale with a List"),
    ({"scale": [torch.ones(8, dtype=torch.int64)] * 2}, NotImplementedError,
     "scale .int64, int8 output. with a List"),
    ({"scale": [torch.ones(8)] * 2}, RuntimeError, "must be int64"),
    ({"tuning_config": [4]}, TypeError, "takes no tuning_config"),
])
def test_grouped_matmul_int_list_refuses_what_the_page_rules_out(torch_npu, kwargs, error,
                                                                 match):
    args = {"group_list": [2, 6], "split_item": 2} | kwargs
    with pytest.raises(error, match=match):
        torch_npu.npu_grouped_matmul([torch.zeros(6, 16, dtype=torch.float16)],
                                     [torch.zeros(16, 8, dtype=torch.float16)] * 2, **args)


# --- npu_trans_quant_param ----------------------------------------------------------------


def _float_bits(value: float) -> int:
    import struct

    return struct.unpack("<I", struct.pack("<f", value))[0]


def _round_to_10_mantissa_bits(value: float) -> float:
    """Round a normal float32 to the nearest float with 10 mantissa bits, ties to even:
    computed on exact Python floats, independently of the bit manipulation under test."""
    import math

    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= |m| < 1
    step = 2.0 ** (exponent - 11)  # the spacing of 10-bit-mantissa floats at this exponent
    return round(value / step) * step  # Python rounds half to even


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_trans_quant_param_keeps_the_top_19_bits_and_sets_bit_46(torch_npu, device):
    """The real op's test golden: scale bits & 0xFFFFE000, with 1 << 46 (round_mode 0)."""
    torch.manual_seed(10)
    scale = torch.rand(16) + 2
    out = torch_npu.npu_trans_quant_param(scale.to(device)).cpu()
    assert out.dtype == torch.int64 and out.shape == (16,)
    for word, value in zip(out.tolist(), scale.tolist()):
        assert word == (_float_bits(value) & 0xFFFFE000) | (1 << 46)
    # None is the schema's default round_mode (int?), and round_mode is positional.
    assert torch.equal(torch_npu.npu_trans_quant_param(scale, None, None), out)


def test_trans_quant_param_round_mode_1_rounds_to_nearest_even(torch_npu):
    import struct

    torch.manual_seed(11)
    values = torch.cat([torch.randn(64) * 100, torch.tensor([1.0, -3.0, 1e-3])])
    # Ties on purpose: exactly halfway between two 10-bit mantissas, both parities.
    values = torch.cat([values, torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11])])
    out = torch_npu.npu_trans_quant_param(values, round_mode=1)
    for word, value in zip(out.tolist(), values.tolist()):
        assert word >> 32 == 1 << 14  # bit 46 only above the scale
        rounded = _round_to_10_mantissa_bits(value)
        assert word & 0xFFFFFFFF == _float_bits(rounded), (value, rounded)
    assert struct.pack("<I", out[-2].item() & 0xFFFFFFFF) == struct.pack("<f", 1.0)
    assert (out[-1].item() & 0xFFFFFFFF) == _float_bits(1 + 4 * 2 ** -11)
    zero = torch_npu.npu_trans_quant_param(torch.tensor([0.0, 1e-40]), round_mode=1)
    assert zero.tolist() == [1 << 46, 1 << 46]  # a subnormal keeps no bits when rounded


def test_trans_quant_param_packs_the_offset_as_int9(torch_npu):
    from torch_npu._ops_quant import decode_trans_quant_param

    scale = torch.tensor([0.5])
    offset = torch.tensor([-300.0, -2.5, 0.5, 1.5, 255.7, -1.0])
    out = torch_npu.npu_trans_quant_param(scale, offset)
    assert out.shape == (6,)
    decoded_scale, decoded_offset = decode_trans_quant_param(out)
    assert decoded_offset.tolist() == [-256, -2, 0, 2, 255, -1]  # half to even, clamped
    assert (decoded_scale == 0.5).all() and ((out >> 46) & 1).all()
    assert ((out[-1].item() >> 37) & 0x1FF) == 0x1FF  # -1 as nine bits
    # A 1-D scale of n with one offset, and the 2-D (1, n) form.
    wide = torch_npu.npu_trans_quant_param(torch.full((4,), 0.25), torch.tensor([3.0]))
    assert decode_trans_quant_param(wide)[1].tolist() == [3] * 4
    two_d = torch_npu.npu_trans_quant_param(torch.full((1, 4), 0.25), torch.ones(1, 4))
    assert two_d.shape == (1, 4) and decode_trans_quant_param(two_d)[1].tolist() == [[1] * 4]


@pytest.mark.parametrize(("args", "match"), [
    ((torch.ones(4, dtype=torch.float16),), "float32"),
    ((torch.ones(1, 2, 2),), "1-D or 2-D"),
    ((torch.ones(0),), "non-empty"),
    ((torch.ones(3), torch.ones(4)), "one length or length 1"),
    ((torch.ones(1, 4), torch.ones(4)), r"both be \(1, n\)"),
    ((torch.ones(2, 4), torch.ones(2, 4)), r"both be \(1, n\)"),
    ((torch.ones(4), None, 2), "round_mode=2 is not supported"),
])
def test_trans_quant_param_refuses(torch_npu, args, match):
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_trans_quant_param(*args)


def test_quant_matmul_reads_the_scale_an_int64_word_holds(torch_npu):
    """Table 2's first row: int64 scale (npu_trans_quant_param), float16 output, no
    pertoken_scale: the result is the float32 path's with the 19-bit scale."""
    torch.manual_seed(12)
    x1 = torch.randint(-128, 128, (5, 32), dtype=torch.int8)
    x2 = torch.randint(-128, 128, (32, 6), dtype=torch.int8)
    scale = torch.rand(6) / 50
    bias = torch.randint(-20, 20, (6,), dtype=torch.int32)
    words = torch_npu.npu_trans_quant_param(scale)
    kept = (scale.view(torch.int32) & -8192).view(torch.float32)  # 0xFFFFE000 as int32
    out = torch_npu.npu_quant_matmul(x1, x2, words, bias=bias, output_dtype=torch.float16)
    want = torch_npu.npu_quant_matmul(x1, x2, kept, bias=bias, output_dtype=torch.float16)
    assert torch.equal(out, want)
    assert not torch.equal(kept, scale)  # the truncation is visible
    with pytest.raises(RuntimeError, match="float16"):
        torch_npu.npu_quant_matmul(x1, x2, words, output_dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="carrying an offset"):
        torch_npu.npu_quant_matmul(x1, x2, torch_npu.npu_trans_quant_param(scale, torch.ones(6)),
                                   output_dtype=torch.float16)
