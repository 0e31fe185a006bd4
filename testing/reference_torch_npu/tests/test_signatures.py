"""The reference's Python signatures against the real bindings' schemas (op-plugin's
``op_plugin/config/op_plugin_functions.yaml`` and the ops' documentation pages): the same
names, order, positional / keyword-only split and defaults, so a call the real binding takes
is never refused for its form; an accepted argument the reference does not model raises the
unmodelled error (NotImplementedError) naming the op and the argument."""

from __future__ import annotations

import inspect

import pytest
import torch


def _parameters(function):
    """``[(name, kind, default)]`` of a reference function, through its npu wrapper."""
    return [(p.name, p.kind.name, p.default)
            for p in inspect.signature(function).parameters.values()]


def _rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


# --- npu_apply_rotary_pos_emb ---------------------------------------------------------------


def test_apply_rotary_pos_emb_takes_layout_and_mode_positionally(torch_npu):
    # Schema: (Tensor query, Tensor key, Tensor cos, Tensor sin, str layout='BSH',
    # str rotary_mode='half').
    assert _parameters(torch_npu.npu_apply_rotary_pos_emb)[4:] == [
        ("layout", "POSITIONAL_OR_KEYWORD", "BSH"),
        ("rotary_mode", "POSITIONAL_OR_KEYWORD", "half")]
    torch.manual_seed(1)
    query, key = torch.randn(2, 3, 4, 64), torch.randn(2, 3, 2, 64)
    cos, sin = torch.rand(2, 3, 1, 64), torch.rand(2, 3, 1, 64)
    expected_q = query * cos + _rotate_half(query) * sin
    q_out, _ = torch_npu.npu_apply_rotary_pos_emb(query.clone(), key.clone(), cos, sin, "BSND",
                                                  "half")
    torch.testing.assert_close(q_out, expected_q)
    # The default 'BSH' reads 4-D (b, s, n, d) tensors as BSND, as callers use it.
    q_default, _ = torch_npu.npu_apply_rotary_pos_emb(query.clone(), key.clone(), cos, sin)
    torch.testing.assert_close(q_default, expected_q)
    q_t, k_t = query[0].clone(), key[0].clone()
    torch_npu.npu_apply_rotary_pos_emb(q_t, k_t, cos[0], sin[0], "TND")
    torch.testing.assert_close(q_t, expected_q[0])
    with pytest.raises(RuntimeError, match="'half'"):
        torch_npu.npu_apply_rotary_pos_emb(query, key, cos, sin, "BSND", "quarter")


# --- npu_top_k_top_p ------------------------------------------------------------------------


def test_top_k_top_p_takes_either_filter_alone(torch_npu):
    # Schema: (Tensor logits, Tensor? p=None, Tensor? k=None).
    assert _parameters(torch_npu.npu_top_k_top_p) == [
        ("logits", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("p", "POSITIONAL_OR_KEYWORD", None), ("k", "POSITIONAL_OR_KEYWORD", None)]
    logits = torch.tensor([[1.0, 4.0, 2.0, 3.0], [0.0, 0.5, 3.0, 1.0]])
    k = torch.tensor([2, 1], dtype=torch.int32)
    only_k = torch_npu.npu_top_k_top_p(logits, None, k)
    inf = float("-inf")
    assert only_k.tolist() == [[inf, 4.0, inf, 3.0], [inf, inf, 3.0, inf]]
    p = torch.tensor([1.0, 0.5])
    only_p = torch_npu.npu_top_k_top_p(logits, p)
    assert only_p[0].tolist() == logits[0].tolist()  # p = 1 keeps the whole row
    probs = logits[1].softmax(-1)
    assert probs.max() > 0.5 and only_p[1].tolist() == [inf, inf, 3.0, inf]
    assert torch.equal(torch_npu.npu_top_k_top_p(logits, p, k),
                       torch_npu.npu_top_k_top_p(logits, k=k, p=p))
    with pytest.raises(NotImplementedError, match="npu_top_k_top_p: p and k"):
        torch_npu.npu_top_k_top_p(logits)


# --- npu_grouped_matmul ---------------------------------------------------------------------


def test_grouped_matmul_signature_has_the_dtype_arguments(torch_npu):
    names = [name for name, kind, _ in _parameters(torch_npu.npu_grouped_matmul)]
    assert names[-10:] == ["split_item", "group_type", "group_list_type", "act_type",
                           "tuning_config", "output_dtype", "x_dtype", "weight_dtype",
                           "scale_dtype", "per_token_scale_dtype"]
    assert all(kind == "KEYWORD_ONLY"
               for _, kind, _ in _parameters(torch_npu.npu_grouped_matmul)[2:])


@pytest.mark.parametrize("argument", ["x_dtype", "weight_dtype", "scale_dtype",
                                      "per_token_scale_dtype"])
def test_grouped_matmul_dtype_arguments_default_or_unmodelled(torch_npu, argument):
    torch.manual_seed(2)
    x = torch.randn(6, 16, dtype=torch.float16)
    w = torch.randn(2, 16, 8, dtype=torch.float16)
    group_list = torch.tensor([2, 6])
    expected = torch.cat((x[:2].float() @ w[0].float(), x[2:].float() @ w[1].float()))
    (out,) = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=2,
                                         group_type=0, **{argument: None})
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    with pytest.raises(NotImplementedError, match=f"npu_grouped_matmul: {argument}=1"):
        torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=2,
                                     group_type=0, **{argument: 1})


def test_grouped_matmul_optional_ints_take_none_as_their_default(torch_npu):
    # Schema: int? split_item=0, int? group_list_type=0, int? act_type=0.
    torch.manual_seed(3)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(2, 16, 8, dtype=torch.bfloat16)
    group_list = torch.tensor([1, 4])
    (default,) = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=2,
                                             group_type=0)
    (with_none,) = torch_npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=2,
                                               group_type=0, group_list_type=None,
                                               act_type=None)
    assert torch.equal(default, with_none)


# --- npu_quant_matmul / npu_weight_quant_batchmatmul / npu_add_rms_norm_quant ---------------


def test_quant_matmul_takes_its_dtype_and_scale_arguments(torch_npu):
    # Documented prototype: (x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
    # output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
    # scale_dtype=None, group_sizes=None, y_scale=None).
    params = _parameters(torch_npu.npu_quant_matmul)
    assert [name for name, _, _ in params] == [
        "x1", "x2", "scale", "offset", "pertoken_scale", "bias", "output_dtype", "x1_dtype",
        "x2_dtype", "pertoken_scale_dtype", "scale_dtype", "group_sizes", "y_scale"]
    assert all(kind == "KEYWORD_ONLY" and default is None for _, kind, default in params[3:])
    x1 = torch.randint(-5, 5, (3, 16), dtype=torch.int8)
    x2 = torch.randint(-5, 5, (16, 8), dtype=torch.int8)
    scale = torch.full((8,), 0.5)
    out = torch_npu.npu_quant_matmul(x1, x2, scale, output_dtype=torch.bfloat16, x1_dtype=None,
                                     x2_dtype=None, pertoken_scale_dtype=None,
                                     scale_dtype=None, y_scale=None)
    torch.testing.assert_close(out.float(), (x1.float() @ x2.float()) * 0.5)
    for argument, value in (("x1_dtype", 1), ("x2_dtype", 1), ("pertoken_scale_dtype", 1),
                            ("scale_dtype", 1), ("y_scale", torch.ones(8))):
        with pytest.raises(NotImplementedError, match=f"npu_quant_matmul: {argument}="):
            torch_npu.npu_quant_matmul(x1, x2, scale, output_dtype=torch.bfloat16,
                                       **{argument: value})


def test_weight_quant_batchmatmul_takes_weight_dtype_positionally(torch_npu):
    # Schema: (..., int antiquant_group_size=0, int inner_precise=0, int? weight_dtype=None).
    assert _parameters(torch_npu.npu_weight_quant_batchmatmul)[-1] == (
        "weight_dtype", "POSITIONAL_OR_KEYWORD", None)
    x = torch.randn(2, 32, dtype=torch.float16)
    weight = torch.randint(-8, 8, (32, 4), dtype=torch.int8)
    scale = torch.full((4,), 0.25, dtype=torch.float16)
    out = torch_npu.npu_weight_quant_batchmatmul(x, weight, scale, None, None, None, None, 0, 0,
                                                 None)
    torch.testing.assert_close(out.float(), x.float() @ (weight.float() * 0.25), atol=2e-2,
                               rtol=2e-2)
    with pytest.raises(NotImplementedError,
                       match="npu_weight_quant_batchmatmul: weight_dtype=29"):
        torch_npu.npu_weight_quant_batchmatmul(x, weight, scale, None, None, None, None, 0, 0,
                                               29)


def test_add_rms_norm_quant_takes_dst_type(torch_npu):
    # Schema: (..., *, int axis=-1, float epsilon=1e-06, bool div_mode=True,
    # int? dst_type=None).
    assert _parameters(torch_npu.npu_add_rms_norm_quant)[-1] == ("dst_type", "KEYWORD_ONLY",
                                                                 None)
    x = torch.randn(2, 16, dtype=torch.float16)
    gamma = torch.ones(16, dtype=torch.float16)
    scales = torch.ones(16, dtype=torch.float32)
    y1, _, _ = torch_npu.npu_add_rms_norm_quant(x, x, gamma, scales, None, dst_type=None)
    assert y1.dtype == torch.int8
    with pytest.raises(NotImplementedError, match="npu_add_rms_norm_quant: dst_type=2"):
        torch_npu.npu_add_rms_norm_quant(x, x, gamma, scales, None, dst_type=2)


# --- npu_fused_infer_attention_score.out ------------------------------------------------------


def test_fused_attention_out_form_takes_no_workspace(torch_npu):
    # Schema: ..., bool softmax_lse_flag=False, Tensor? workspace=None, Tensor(a!)
    # attention_out, Tensor(b!) softmax_lse.
    assert ("workspace", "KEYWORD_ONLY", None) in _parameters(
        torch_npu.npu_fused_infer_attention_score.out)
    torch.manual_seed(4)
    query = torch.randn(2, 1, 2, 16, dtype=torch.float16)
    key = torch.randn(4, 16, 2 * 16, dtype=torch.float16)
    value = torch.randn(4, 16, 2 * 16, dtype=torch.float16)
    kwargs = dict(num_heads=2, num_key_value_heads=2, input_layout="BSND", scale=0.25,
                  block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
                  block_size=16, actual_seq_lengths_kv=[20, 7])
    expected, _ = torch_npu.npu_fused_infer_attention_score(query, key, value, **kwargs)
    out = torch.empty_like(expected)
    lse = torch.empty(1)
    torch_npu.npu_fused_infer_attention_score.out(query, key, value, out=[out, lse], **kwargs)
    assert torch.equal(out, expected)
