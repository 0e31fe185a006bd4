"""The reference's norm, quantization and rotary ops against plain torch math and the
argument rules of their torch_npu documentation pages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HALF = [torch.float16, torch.bfloat16]
ATOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}




def _int8_steps(values: torch.Tensor) -> torch.Tensor:
    return torch.round(values).clamp(-128, 127).to(torch.int8)


# --- npu_add_rms_norm ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_add_rms_norm_is_add_then_rms_norm(torch_npu, dtype):
    torch.manual_seed(0)
    x1, x2 = torch.randn(3, 5, 32, dtype=dtype), torch.randn(3, 5, 32, dtype=dtype)
    gamma = torch.randn(32, dtype=dtype)
    y, rstd, x = torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-5)
    added = x1.float() + x2.float()
    torch.testing.assert_close(x, added.to(dtype))
    expected = F.rms_norm(added, (32,), weight=gamma.float(), eps=1e-5)
    torch.testing.assert_close(y.float(), expected, atol=ATOL[dtype], rtol=ATOL[dtype])
    assert y.dtype == dtype and rstd.dtype == torch.float32 and rstd.shape == (3, 5, 1)
    gamma2 = torch.randn(5, 32, dtype=dtype)
    assert torch_npu.npu_add_rms_norm(x1, x2, gamma2)[1].shape == (3, 1, 1)


@pytest.mark.parametrize(("x1", "x2", "gamma", "error", "match"), [
    (torch.ones(2, 4), torch.ones(2, 4), torch.ones(4, dtype=torch.float16), RuntimeError,
     "gamma must have x1's dtype"),
    (torch.ones(2, 4), torch.ones(3, 4), torch.ones(4), RuntimeError, "x2 has shape"),
    (torch.ones(2, 4), torch.ones(2, 4), torch.ones(3), RuntimeError, "trailing dims"),
    (torch.ones(0, 4), torch.ones(0, 4), torch.ones(4), RuntimeError, "empty"),
    (torch.ones(2, 4, dtype=torch.int32), torch.ones(2, 4, dtype=torch.int32),
     torch.ones(4, dtype=torch.int32), RuntimeError, "supported dtypes"),
])
def test_add_rms_norm_refuses_what_the_page_rules_out(torch_npu, x1, x2, gamma, error, match):
    with pytest.raises(error, match=match):
        torch_npu.npu_add_rms_norm(x1, x2, gamma)


# --- npu_add_rms_norm_quant ---------------------------------------------------------------


def _typed(x_dtype):
    return ((torch.float32, torch.int32) if x_dtype == torch.float16
            else (torch.bfloat16, torch.bfloat16))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("div_mode", [True, False])
def test_add_rms_norm_quant_follows_the_formula(torch_npu, dtype, div_mode):
    torch.manual_seed(1)
    x1, x2 = torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype)
    gamma, beta = torch.rand(16, dtype=dtype) + 0.5, torch.randn(16, dtype=dtype)
    scale_dtype, zero_dtype = _typed(dtype)
    scales1 = torch.full((16,), 0.03125 if div_mode else 32.0, dtype=scale_dtype)
    zero_points1 = torch.full((16,), 3, dtype=zero_dtype)
    y1, y2, x = torch_npu.npu_add_rms_norm_quant(x1, x2, gamma, scales1, zero_points1, beta,
                                                 epsilon=1e-6, div_mode=div_mode)
    added = x1.float() + x2.float()
    y = F.rms_norm(added, (16,), weight=gamma.float(), eps=1e-6) + beta.float()
    expected = _int8_steps(y * 32.0 + 3)
    assert y1.dtype == torch.int8 and y1.shape == x1.shape
    assert (y1.int() - expected.int()).abs().max() <= 1
    assert (y2 == 0).all()  # no scales2: the page leaves y2 open, the reference zeros it
    torch.testing.assert_close(x, added.to(dtype))
    scales2 = torch.full((16,), 0.0625 if div_mode else 16.0, dtype=scale_dtype)
    _, y2, _ = torch_npu.npu_add_rms_norm_quant(x1, x2, gamma, scales1, None, beta, scales2,
                                                div_mode=div_mode)
    assert (y2.int() - _int8_steps(y * 16.0).int()).abs().max() <= 1


def test_add_rms_norm_quant_saturates(torch_npu):
    x = torch.full((1, 4), 2.0, dtype=torch.float16)
    y1, _, _ = torch_npu.npu_add_rms_norm_quant(x, x, torch.ones(4, dtype=torch.float16),
                                                torch.full((4,), 1e-3), None)
    assert y1.tolist() == [[127] * 4]


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"x1": torch.ones(2, 4)}, RuntimeError, "float16 and bfloat16"),
    ({"scales1": torch.ones(4, dtype=torch.bfloat16)}, RuntimeError,
     "with torch.float16 inputs it must be torch.float32"),
    ({"zero_points1": torch.ones(4, dtype=torch.int8)}, RuntimeError,
     "zero_points1 has dtype torch.int8"),
    ({"scales1": torch.ones(1)}, RuntimeError, "must equal gamma's"),
    ({"scales1": torch.zeros(4)}, RuntimeError, "scales1 holds 0"),
    ({"axis": 0}, RuntimeError, "only the default -1"),
])
def test_add_rms_norm_quant_refuses_what_the_page_rules_out(torch_npu, change, error, match):
    args = {"x1": torch.ones(2, 4, dtype=torch.float16), "x2": torch.ones(2, 4, dtype=torch.float16),
            "gamma": torch.ones(4, dtype=torch.float16), "scales1": torch.ones(4),
            "zero_points1": None, "axis": -1}
    args.update(change)
    x1 = args.pop("x1")
    x2 = args.pop("x2") if x1.dtype == torch.float16 else x1
    with pytest.raises(error, match=match):
        torch_npu.npu_add_rms_norm_quant(x1, x2, args["gamma"], args["scales1"],
                                         args["zero_points1"], axis=args["axis"])


# --- npu_add_rms_norm_dynamic_quant -------------------------------------------------------


def _row_quant(values: torch.Tensor):
    scale = values.abs().amax(-1) / 127
    return _int8_steps(values / scale.unsqueeze(-1)), scale


@pytest.mark.parametrize("dtype", HALF)
def test_add_rms_norm_dynamic_quant_follows_the_formula(torch_npu, dtype):
    torch.manual_seed(2)
    x1, x2 = torch.randn(2, 3, 32, dtype=dtype), torch.randn(2, 3, 32, dtype=dtype)
    gamma = torch.rand(32, dtype=dtype) + 0.5
    smooth1, smooth2 = torch.rand(32, dtype=dtype) + 0.5, torch.rand(32, dtype=dtype) + 0.5
    y1, y2, x, scale1, scale2 = torch_npu.npu_add_rms_norm_dynamic_quant(
        x1, x2, gamma, smooth_scale1=smooth1, smooth_scale2=smooth2, epsilon=1e-6,
        output_mask=[True, True])
    y = F.rms_norm(x1.float() + x2.float(), (32,), weight=gamma.float(), eps=1e-6)
    for got_q, got_scale, smooth in ((y1, scale1, smooth1), (y2, scale2, smooth2)):
        want_q, want_scale = _row_quant(y * smooth.float())
        assert got_scale.shape == (2, 3) and got_scale.dtype == torch.float32
        torch.testing.assert_close(got_scale, want_scale)
        assert (got_q.int() - want_q.int()).abs().max() <= 1
    torch.testing.assert_close(x, (x1.float() + x2.float()).to(dtype))


def test_add_rms_norm_dynamic_quant_output_mask(torch_npu):
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    gamma = torch.ones(16, dtype=torch.bfloat16)
    y1, y2, _, scale1, scale2 = torch_npu.npu_add_rms_norm_dynamic_quant(
        x, x, gamma, output_mask=[True, False])
    assert y1.shape == (3, 16) and scale1.shape == (3,)
    assert y2.shape == () and scale2.shape == ()
    y1, y2, _, _, _ = torch_npu.npu_add_rms_norm_dynamic_quant(x, x, gamma)  # empty mask
    assert y1.shape == (3, 16) and y2.shape == ()
    with pytest.raises(RuntimeError, match="cannot both be False"):
        torch_npu.npu_add_rms_norm_dynamic_quant(x, x, gamma, output_mask=[False, False])
    with pytest.raises(RuntimeError, match="smooth_scale1 is given, so output_mask"):
        torch_npu.npu_add_rms_norm_dynamic_quant(x, x, gamma, smooth_scale1=gamma,
                                                 output_mask=[False, True])
    with pytest.raises(RuntimeError, match="2 to 8 dims"):
        torch_npu.npu_add_rms_norm_dynamic_quant(x[0], x[0], gamma)
    with pytest.raises(NotImplementedError, match="quint4x2"):
        torch_npu.npu_add_rms_norm_dynamic_quant(x, x, gamma, y_dtype=torch.quint4x2)


@pytest.mark.parametrize("mask", [[True, False], [False, True]])
def test_add_rms_norm_dynamic_quant_masked_off_outputs_are_0_dim(torch_npu, mask):
    # The real binding returns a 0-dim tensor (sizes {}, one element) for an output the
    # mask turns off, not an empty (0,) one.
    x = torch.randn(2, 3, 16, dtype=torch.float16)
    gamma = torch.ones(16, dtype=torch.float16)
    y1, y2, _, scale1, scale2 = torch_npu.npu_add_rms_norm_dynamic_quant(
        x, x, gamma, output_mask=mask)
    on, off = ((y1, scale1), (y2, scale2)) if mask[0] else ((y2, scale2), (y1, scale1))
    assert on[0].shape == (2, 3, 16) and on[1].shape == (2, 3)
    for tensor, dtype in zip(off, (torch.int8, torch.float32), strict=True):
        assert tensor.dim() == 0 and tensor.numel() == 1 and tensor.dtype == dtype
    npu_outputs = torch_npu.npu_add_rms_norm_dynamic_quant(
        x.to("npu"), x.to("npu"), gamma.to("npu"), output_mask=mask)
    assert [tuple(t.shape) for t in npu_outputs] == [tuple(t.shape) for t in (y1, y2)] + [
        (2, 3, 16)] + [tuple(t.shape) for t in (scale1, scale2)]
    assert all(t.device.type == "npu" for t in npu_outputs)


# --- npu_dynamic_quant --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF)
def test_dynamic_quant_follows_the_formula(torch_npu, dtype):
    torch.manual_seed(3)
    x = torch.randn(4, 5, 24, dtype=dtype) * 3
    y, scale = torch_npu.npu_dynamic_quant(x)
    want_y, want_scale = _row_quant(x.float())
    assert y.dtype == torch.int8 and y.shape == x.shape and scale.shape == (4, 5)
    torch.testing.assert_close(scale, want_scale)
    assert (y.int() - want_y.int()).abs().max() <= 1
    smooth = torch.rand(24, dtype=dtype) + 0.5
    y, scale = torch_npu.npu_dynamic_quant(x, smooth_scales=smooth)
    torch.testing.assert_close(scale, _row_quant(x.float() * smooth.float())[1])


def test_dynamic_quant_of_the_documented_example(torch_npu):
    # The page's first example: rows scaled by their max so that it maps to 127.
    x = torch.tensor([[0.7261, 0.3726, 0.9126], [0.9023, 0.9990, 0.1279],
                      [0.8628, 0.6240, 0.9028]], dtype=torch.float16)
    y, scale = torch_npu.npu_dynamic_quant(x)
    assert y.tolist() == [[101, 52, 127], [115, 127, 16], [121, 88, 127]]
    torch.testing.assert_close(scale, torch.tensor([0.0072, 0.0079, 0.0071]), atol=1e-4,
                               rtol=0)


@pytest.mark.parametrize("dtype", HALF)
def test_dynamic_quant_smooths_each_group_of_rows_with_its_own_vector(torch_npu, dtype):
    """The MoE form: rows [group_index[g-1], group_index[g]) use smooth_scales[g]; an empty
    group (equal ends) uses none, as the real op's test golden does."""
    torch.manual_seed(5)
    x = torch.randn(2, 3, 16, dtype=dtype) * 2  # 6 rows
    smooth = torch.rand(4, 16, dtype=dtype) + 0.5
    group_index = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    y, scale = torch_npu.npu_dynamic_quant(x, smooth_scales=smooth, group_index=group_index)
    rows = x.float().reshape(6, 16)
    owner = [0, 0, 2, 2, 2, 3]  # group 1 is empty
    smoothed = torch.stack([rows[r] * smooth[owner[r]].float() for r in range(6)])
    want_y, want_scale = _row_quant(smoothed)
    assert y.shape == x.shape and scale.shape == (2, 3)
    torch.testing.assert_close(scale.reshape(6), want_scale)
    assert (y.reshape(6, 16).int() - want_y.int()).abs().max() <= 1
    # One group over every row is the plain smooth_scales form.
    whole, _ = torch_npu.npu_dynamic_quant(x, smooth_scales=smooth[:1],
                                           group_index=torch.tensor([6], dtype=torch.int32))
    plain, _ = torch_npu.npu_dynamic_quant(x, smooth_scales=smooth[0])
    assert torch.equal(whole, plain)


@pytest.mark.parametrize("dtype", HALF)
def test_dynamic_quant_to_int4_packs_values_scaled_to_7(torch_npu, dtype):
    from torch_npu._ops_quant import unpack_int4_words

    torch.manual_seed(6)
    x = torch.randn(3, 32, dtype=dtype) * 4
    x[1] = 0  # a row of zeros: scale 0, values 0
    y, scale = torch_npu.npu_dynamic_quant(x, dst_type=torch.quint4x2)
    assert y.dtype == torch.int32 and y.shape == (3, 4) and scale.dtype == torch.float32
    values = x.float()
    torch.testing.assert_close(scale, values.abs().amax(-1) / 7)
    unpacked = unpack_int4_words(y)
    assert unpacked.abs().max() <= 7 and not unpacked[1].any()
    expected = torch.round(values / torch.where(scale == 0, 1, scale)[:, None])
    assert (unpacked.int() - expected.int()).abs().max() <= 1
    assert (unpacked.abs() == 7).any(dim=-1)[[0, 2]].all()  # each row's largest value maps to 7


@pytest.mark.parametrize(("x", "kwargs", "error", "match"), [
    (torch.ones(2, 4), {}, RuntimeError, "float16 and bfloat16"),
    (torch.ones(4, dtype=torch.float16), {}, RuntimeError, "more than 1 dim"),
    (torch.ones(2, 4, dtype=torch.float16), {"group_index": torch.tensor([2], dtype=torch.int32)},
     RuntimeError, "group_index needs smooth_scales"),
    (torch.ones(2, 4, dtype=torch.float16),
     {"group_index": torch.tensor([2]), "smooth_scales": torch.ones(1, 4, dtype=torch.float16)},
     RuntimeError, "1-D int32"),
    (torch.ones(2, 4, dtype=torch.float16),
     {"group_index": torch.tensor([2], dtype=torch.int32),
      "smooth_scales": torch.ones(4, dtype=torch.float16)}, RuntimeError, "must be 2-D"),
    (torch.ones(3, 4, dtype=torch.float16),
     {"group_index": torch.tensor([2, 1, 3], dtype=torch.int32),
      "smooth_scales": torch.ones(3, 4, dtype=torch.float16)}, RuntimeError, "non-decreasing"),
    (torch.ones(3, 4, dtype=torch.float16),
     {"group_index": torch.tensor([1, 2], dtype=torch.int32),
      "smooth_scales": torch.ones(2, 4, dtype=torch.float16)}, RuntimeError, "number of rows"),
    (torch.ones(2, 4, dtype=torch.float16), {"dst_type": torch.quint4x2},
     RuntimeError, "multiple of 8"),
    (torch.ones(2, 8, dtype=torch.float16), {"dst_type": torch.qint8},
     RuntimeError, "dst_type must be"),
    (torch.ones(2, 4, dtype=torch.float16), {"smooth_scales": torch.ones(3, dtype=torch.float16)},
     RuntimeError, "smooth_scales must be 1-D"),
])
def test_dynamic_quant_refuses_what_the_page_rules_out(torch_npu, x, kwargs, error, match):
    with pytest.raises(error, match=match):
        torch_npu.npu_dynamic_quant(x, **kwargs)


# --- npu_quant_matmul ---------------------------------------------------------------------


def _int8(*shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8)


@pytest.mark.parametrize("output_dtype", HALF)
@pytest.mark.parametrize("bias_dtype", [None, torch.int32, torch.float32])
def test_quant_matmul_follows_the_formula(torch_npu, output_dtype, bias_dtype):
    torch.manual_seed(4)
    x1, x2 = _int8(6, 50), _int8(50, 12)
    scale, pertoken = torch.rand(12) / 100, torch.rand(6) / 100
    bias = None if bias_dtype is None else (
        torch.randint(-50, 50, (12,), dtype=torch.int32) if bias_dtype == torch.int32
        else torch.randn(12))
    out = torch_npu.npu_quant_matmul(x1, x2, scale, pertoken_scale=pertoken, bias=bias,
                                     output_dtype=output_dtype)
    exact = x1.double() @ x2.double()
    if bias_dtype == torch.int32:
        expected = (exact + bias.double()) * scale.double() * pertoken.double()[:, None]
    else:
        expected = exact * scale.double() * pertoken.double()[:, None]
        if bias is not None:
            expected = expected + bias.double()
    assert out.dtype == output_dtype and out.shape == (6, 12)
    torch.testing.assert_close(out.double(), expected, atol=ATOL[output_dtype] * 4,
                               rtol=ATOL[output_dtype])


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"output_dtype": None}, NotImplementedError, "int8/int32 output"),
    ({"output_dtype": torch.float32}, RuntimeError, "output_dtype must be"),
    ({"scale": torch.ones(5)}, RuntimeError, r"scale must be 1-D \(1,\) or \(n,\)"),
    ({"scale": torch.ones(1, dtype=torch.bfloat16), "output_dtype": torch.float16}, RuntimeError,
     "scale has dtype torch.bfloat16"),
    ({"pertoken_scale": torch.ones(4, 1)}, RuntimeError, "pertoken_scale must be float32"),
    ({"bias": torch.ones(3), "output_dtype": torch.float16, "pertoken_scale": None}, RuntimeError,
     "bias has dtype torch.float32"),
    ({"offset": torch.ones(3)}, RuntimeError, "offset applies to int8 output only"),
    ({"x1": torch.ones(4, 8)}, RuntimeError, "x1 and x2 must be int8"),
    ({"x1": _int8(2, 4, 8)}, NotImplementedError, "batched"),
    ({"group_sizes": [1, 1, 128]}, NotImplementedError, "group_sizes"),
    ({"scale": torch.ones(1, dtype=torch.int64)}, RuntimeError,
     r"int64 scale \(from npu_trans_quant_param\) goes with float16"),
])
def test_quant_matmul_refuses_what_the_page_rules_out(torch_npu, kwargs, error, match):
    args = {"x1": _int8(4, 8), "x2": _int8(8, 3), "scale": torch.ones(3),
            "pertoken_scale": torch.ones(4), "output_dtype": torch.bfloat16}
    args.update(kwargs)
    x1, x2, scale = args.pop("x1"), args.pop("x2"), args.pop("scale")
    with pytest.raises(error, match=match):
        torch_npu.npu_quant_matmul(x1, x2, scale, **args)


def test_quant_matmul_limits_the_last_dims(torch_npu):
    with pytest.raises(RuntimeError, match="must not exceed 65535"):
        torch_npu.npu_quant_matmul(_int8(1, 65536), _int8(65536, 1), torch.ones(1),
                                   output_dtype=torch.bfloat16)


# --- npu_rotary_mul and npu_apply_rotary_pos_emb ------------------------------------------


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rotate_interleaved(x):
    out = torch.empty_like(x)
    out[..., 0::2], out[..., 1::2] = -x[..., 1::2], x[..., 0::2]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_is_the_pages_equivalent_computation(torch_npu, dtype, mode):
    torch.manual_seed(5)
    x = torch.randn(4, 3, 32, dtype=dtype)  # TND
    r1, r2 = torch.rand(4, 1, 32, dtype=dtype), torch.rand(4, 1, 32, dtype=dtype)
    out = torch_npu.npu_rotary_mul(x, r1, r2, rotary_mode=mode)
    rotate = _rotate_half if mode == "half" else _rotate_interleaved
    expected = x.float() * r1.float() + rotate(x.float()) * r2.float()
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.float(), expected, atol=ATOL[dtype], rtol=ATOL[dtype])


def test_rotary_mul_takes_the_pages_4d_example_shapes(torch_npu):
    x, r1, r2 = torch.rand(2, 2, 5, 128), torch.rand(1, 2, 1, 128), torch.rand(1, 2, 1, 128)
    assert torch_npu.npu_rotary_mul(x, r1, r2).shape == (2, 2, 5, 128)


@pytest.mark.parametrize(("x", "r", "kwargs", "error", "match"), [
    (torch.ones(2, 32), torch.ones(2, 32), {}, RuntimeError, "3 or 4 dims"),
    (torch.ones(2, 3, 900), torch.ones(2, 1, 900), {}, RuntimeError, "below 896"),
    (torch.ones(2, 3, 31), torch.ones(2, 1, 31), {}, RuntimeError, "must be even"),
    (torch.ones(2, 3, 32), torch.ones(2, 3, 16), {}, RuntimeError, "must broadcast"),
    (torch.ones(2, 3, 32), torch.ones(2, 3, 32), {"rotary_mode": "interleave"}, RuntimeError,
     "only one dim besides D"),
    (torch.ones(2, 3, 32), torch.ones(2, 1, 32), {"rotary_mode": "quarter"}, RuntimeError,
     "'half' or 'interleave'"),
    (torch.ones(2, 3, 32), torch.ones(2, 1, 32), {"rotate": torch.eye(32)},
     NotImplementedError, "rotate"),
])
def test_rotary_mul_refuses_what_the_page_rules_out(torch_npu, x, r, kwargs, error, match):
    with pytest.raises(error, match=match):
        torch_npu.npu_rotary_mul(x, r, r, **kwargs)


@pytest.mark.parametrize("layout", ["TND", "BSND"])
@pytest.mark.parametrize("d", [64, 128])
def test_apply_rotary_pos_emb_rotates_query_and_key_in_place(torch_npu, layout, d):
    torch.manual_seed(6)
    lead = (5,) if layout == "TND" else (2, 3)
    query, key = torch.randn(*lead, 4, d), torch.randn(*lead, 2, d)
    cos, sin = torch.rand(*lead, 1, d), torch.rand(*lead, 1, d)
    expected_q = query * cos + _rotate_half(query) * sin
    expected_k = key * cos + _rotate_half(key) * sin
    q_out, k_out = torch_npu.npu_apply_rotary_pos_emb(query, key, cos, sin, layout=layout)
    assert q_out is query and k_out is key
    torch.testing.assert_close(query, expected_q)
    torch.testing.assert_close(key, expected_k)


@pytest.mark.parametrize(("change", "error", "match"), [
    ({"layout": "BNSD"}, RuntimeError, "'BSND'.*'TND'"),
    ({"rotary_mode": "interleave"}, RuntimeError, "'half' only"),
    ({"query": torch.ones(5, 4, 96)}, RuntimeError, "must be 64 or 128"),
    ({"cos": torch.ones(5, 1, 128, dtype=torch.float16)}, RuntimeError, "share one dtype"),
    ({"cos": torch.ones(4, 1, 128)}, RuntimeError, "leading dims"),
    ({"cos": torch.ones(5, 2, 128), "sin": torch.ones(5, 2, 128)}, RuntimeError, "N=1"),
    ({"query": torch.ones(5, 4, 64), "key": torch.ones(5, 2, 64)}, NotImplementedError,
     "D other than query's"),
])
def test_apply_rotary_pos_emb_refuses_what_the_page_rules_out(torch_npu, change, error, match):
    args = {"query": torch.ones(5, 4, 128), "key": torch.ones(5, 2, 128),
            "cos": torch.ones(5, 1, 128), "sin": torch.ones(5, 1, 128), "layout": "TND",
            "rotary_mode": "half"}
    args.update(change)
    with pytest.raises(error, match=match):
        torch_npu.npu_apply_rotary_pos_emb(args["query"], args["key"], args["cos"],
                                           args["sin"], layout=args["layout"],
                                           rotary_mode=args["rotary_mode"])
