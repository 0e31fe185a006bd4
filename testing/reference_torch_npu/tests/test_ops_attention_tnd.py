"""The reference's ``npu_fused_infer_attention_score`` in the TND layouts (TND, TND_NTD,
NTD_TND) against plain per-sequence softmax attention written out here, and the TND rules
of its torch_npu documentation page: cumulative ``actual_seq_lengths``, the dense forms
(D 192 / value 128, D 128 with rope), MLA page attention (D 512 with rope) and GQA page
attention (the form vLLM-Ascend calls)."""

from __future__ import annotations

import math

import pytest
import torch

CAUSAL_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _cumsum(lengths):
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total)
    return out


def _loop_attention(q, k, v, scale, causal, q_rope=None, k_rope=None):
    """One sequence, one head at a time: q [q, N, D], k [k, KVN, D], v [k, KVN, Dv]."""
    q_len, heads = q.shape[0], q.shape[1]
    kv_len, kv_heads = k.shape[0], k.shape[1]
    out = torch.zeros(q_len, heads, v.shape[2])
    lse = torch.zeros(q_len, heads)
    for n in range(heads):
        kn = n // (heads // kv_heads)
        for i in range(q_len):
            scores = []
            for j in range(kv_len):
                if causal and j > i + kv_len - q_len:
                    continue
                s = float(q[i, n].double() @ k[j, kn].double())
                if q_rope is not None:
                    s += float(q_rope[i, n].double() @ k_rope[j, kn].double())
                scores.append((j, s * scale))
            top = max(s for _, s in scores)
            total = sum(math.exp(s - top) for _, s in scores)
            for j, s in scores:
                out[i, n] += math.exp(s - top) / total * v[j, kn].float()
            lse[i, n] = top + math.log(total)
    return out, lse


def _randn(gen, *shape, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=gen).to(dtype)


# --- dense: D 192 with value 128 / 192 ------------------------------------------------------


@pytest.mark.parametrize("value_dim", [128, 192])
def test_dense_tnd_matches_per_sequence_attention(torch_npu, value_dim):
    """MLA prefill as dense attention: q/k of nope 128 + rope 64, v of 128; three prompts of
    different lengths packed along T, each causal on its own keys (one has context)."""
    gen = torch.Generator().manual_seed(40)
    heads = 2
    q_lens, kv_lens = [3, 5, 2], [3, 7, 2]
    q = _randn(gen, sum(q_lens) + 2, heads, 192)           # two padding tokens at the end
    k = _randn(gen, sum(kv_lens), heads, 192)
    v = _randn(gen, sum(kv_lens), heads, value_dim)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=heads, input_layout="TND", scale=0.1, sparse_mode=3,
        atten_mask=CAUSAL_MASK, actual_seq_lengths=_cumsum(q_lens),
        actual_seq_lengths_kv=_cumsum(kv_lens), softmax_lse_flag=True)
    assert out.shape == (q.shape[0], heads, value_dim) and out.dtype == torch.bfloat16
    assert lse.shape == (q.shape[0], heads, 1)
    qs, ks = 0, 0
    for q_len, kv_len in zip(q_lens, kv_lens, strict=True):
        want, want_lse = _loop_attention(q[qs:qs + q_len], k[ks:ks + kv_len],
                                         v[ks:ks + kv_len], 0.1, causal=True)
        torch.testing.assert_close(out[qs:qs + q_len].float(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[qs:qs + q_len, :, 0], want_lse, atol=1e-3, rtol=1e-3)
        qs, ks = qs + q_len, ks + kv_len
    assert not out[qs:].any()                                  # padding tokens


def test_dense_tnd_without_mask_sees_every_key_of_its_batch(torch_npu):
    gen = torch.Generator().manual_seed(41)
    q_lens, kv_lens = [2, 3], [4, 1]
    q = _randn(gen, 5, 4, 192)
    k = _randn(gen, 5, 4, 192)
    v = _randn(gen, 5, 4, 128)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, input_layout="TND", actual_seq_lengths=_cumsum(q_lens),
        actual_seq_lengths_kv=_cumsum(kv_lens))
    assert lse.shape == (1,) and not lse.any()
    want0, _ = _loop_attention(q[:2], k[:4], v[:4], 1.0, causal=False)
    want1, _ = _loop_attention(q[2:], k[4:], v[4:], 1.0, causal=False)
    torch.testing.assert_close(out.float(), torch.cat([want0, want1]), atol=2e-2, rtol=2e-2)


def test_ntd_tnd_takes_ntd_input_and_returns_tnd(torch_npu):
    gen = torch.Generator().manual_seed(42)
    q = _randn(gen, 6, 2, 192)
    k = _randn(gen, 6, 2, 192)
    v = _randn(gen, 6, 2, 128)
    kwargs = dict(num_heads=2, scale=0.2, sparse_mode=3, atten_mask=CAUSAL_MASK,
                  actual_seq_lengths=[2, 6], actual_seq_lengths_kv=[2, 6])
    tnd, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, input_layout="TND", **kwargs)
    ntd, _ = torch_npu.npu_fused_infer_attention_score(
        q.transpose(0, 1).contiguous(), k.transpose(0, 1).contiguous(),
        v.transpose(0, 1).contiguous(), input_layout="NTD_TND", **kwargs)
    assert ntd.shape == (6, 2, 128)
    assert torch.equal(ntd, tnd)


# --- dense with rope: D 128 + 64 -------------------------------------------------------------


def test_dense_tnd_with_rope_adds_the_rope_scores(torch_npu):
    """query D 128 + query_rope 64, key 128 + key_rope 64, value 128: the same result as D 192
    attention over the concatenated heads, and as the per-sequence loop."""
    gen = torch.Generator().manual_seed(43)
    heads, q_lens = 2, [4, 3]
    t = sum(q_lens)
    q, q_rope = _randn(gen, t, heads, 128), _randn(gen, t, heads, 64)
    k, k_rope = _randn(gen, t, heads, 128), _randn(gen, t, heads, 64)
    v = _randn(gen, t, heads, 128)
    kwargs = dict(num_heads=heads, input_layout="TND", scale=0.08, sparse_mode=3,
                  atten_mask=CAUSAL_MASK, actual_seq_lengths=_cumsum(q_lens),
                  actual_seq_lengths_kv=_cumsum(q_lens))
    out, _ = torch_npu.npu_fused_infer_attention_score(q, k, v, query_rope=q_rope,
                                                       key_rope=k_rope, **kwargs)
    assert out.shape == (t, heads, 128)
    want0, _ = _loop_attention(q[:4], k[:4], v[:4], 0.08, True, q_rope[:4], k_rope[:4])
    want1, _ = _loop_attention(q[4:], k[4:], v[4:], 0.08, True, q_rope[4:], k_rope[4:])
    torch.testing.assert_close(out.float(), torch.cat([want0, want1]), atol=2e-2, rtol=2e-2)
    joined, _ = torch_npu.npu_fused_infer_attention_score(
        torch.cat([q, q_rope], -1), torch.cat([k, k_rope], -1), v, **kwargs)
    torch.testing.assert_close(out.float(), joined.float(), atol=1e-2, rtol=1e-2)
    without_rope, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, query_rope=torch.zeros_like(q_rope), key_rope=k_rope, **kwargs)
    assert not torch.allclose(without_rope.float(), out.float(), atol=1e-2)


# --- MLA page attention: D 512 with rope -----------------------------------------------------


def _mla_case(gen, q_lens, kv_lens, heads, block_size, dtype):
    num_blocks = sum(-(-n // block_size) for n in kv_lens) + 2
    latent = torch.randn(num_blocks, block_size, 512, generator=gen).to(dtype)
    rope = torch.randn(num_blocks, block_size, 64, generator=gen).to(dtype)
    width = max(-(-n // block_size) for n in kv_lens)
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(kv_lens), width, dtype=torch.int32)
    used = 0
    for b, n in enumerate(kv_lens):
        count = -(-n // block_size)
        table[b, :count] = order[used:used + count].int()
        used += count
    t = sum(q_lens)
    return (torch.randn(t, heads, 512, generator=gen).to(dtype),
            torch.randn(t, heads, 64, generator=gen).to(dtype), latent, rope, table)


def _unpage(cache, row, length, block_size):
    blocks = -(-length // block_size)
    return cache[row[:blocks].long()].reshape(-1, 1, cache.shape[-1])[:length]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["TND", "TND_NTD"])
def test_mla_tnd_page_attention_matches_per_sequence_attention(torch_npu, dtype, layout):
    gen = torch.Generator().manual_seed(44)
    heads, block_size = 32, 16
    q_lens, kv_lens = [1, 3, 2], [5, 20, 2]                  # decode, MTP-style, fresh prompt
    q, q_rope, latent, rope, table = _mla_case(gen, q_lens, kv_lens, heads, block_size, dtype)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, latent, latent, query_rope=q_rope, key_rope=rope, num_heads=heads,
        num_key_value_heads=1, input_layout=layout, scale=0.05, sparse_mode=3,
        atten_mask=CAUSAL_MASK, actual_seq_lengths=_cumsum(q_lens),
        actual_seq_lengths_kv=kv_lens, block_table=table, block_size=block_size)
    assert lse.shape == (1,)
    out = out.transpose(0, 1) if layout == "TND_NTD" else out
    assert out.shape == (sum(q_lens), heads, 512)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        k = _unpage(latent, table[b], kv_len, block_size)
        k_rope = _unpage(rope, table[b], kv_len, block_size)
        rows = slice(start, start + q_len)
        want, _ = _loop_attention(q[rows], k, k, 0.05, True, q_rope[rows], k_rope)
        torch.testing.assert_close(out[rows].float(), want, atol=TOL[dtype] * 2,
                                   rtol=TOL[dtype] * 2)
        start += q_len


def test_mla_tnd_decode_takes_sparse_mode_zero(torch_npu):
    gen = torch.Generator().manual_seed(45)
    q, q_rope, latent, rope, table = _mla_case(gen, [1, 1], [7, 130], 64, 128, torch.float16)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, latent, latent, query_rope=q_rope, key_rope=rope, num_heads=64,
        num_key_value_heads=1, input_layout="TND", actual_seq_lengths=[1, 2],
        actual_seq_lengths_kv=[7, 130], block_table=table, block_size=128)
    for b, kv_len in enumerate([7, 130]):
        k = _unpage(latent, table[b], kv_len, 128)
        want, _ = _loop_attention(q[b:b + 1, :4], k, k, 1.0, False, q_rope[b:b + 1, :4],
                                  _unpage(rope, table[b], kv_len, 128))
        torch.testing.assert_close(out[b:b + 1, :4].float(), want, atol=4e-3, rtol=4e-3)


# --- GQA page attention in TND -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_form", ["BnBsH", "BnNBsD"])
def test_gqa_tnd_page_attention_matches_per_sequence_attention(torch_npu, dtype, cache_form):
    """Chunked prefill and decode in one call: cumulative query lengths, per-batch key
    lengths, caches as (num_blocks, block_size, KV_N * D) or (num_blocks, KV_N, block_size,
    D)."""
    gen = torch.Generator().manual_seed(46)
    heads, kv_heads, dim, block_size = 4, 2, 32, 128
    q_lens, kv_lens = [1, 4, 3], [9, 200, 3]
    num_blocks = 5
    cache_k = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    cache_v = torch.randn(num_blocks, block_size, kv_heads, dim, generator=gen).to(dtype)
    table = torch.tensor([[3, 0], [1, 4], [2, 0]], dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, dim, generator=gen).to(dtype)
    if cache_form == "BnBsH":
        key, value = cache_k.flatten(2), cache_v.flatten(2)
    else:
        key, value = cache_k.transpose(1, 2).contiguous(), cache_v.transpose(1, 2).contiguous()
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, key, value, num_heads=heads, num_key_value_heads=kv_heads, input_layout="TND",
        scale=0.2, sparse_mode=3, atten_mask=CAUSAL_MASK, actual_seq_lengths=_cumsum(q_lens),
        actual_seq_lengths_kv=kv_lens, block_table=table, block_size=block_size,
        softmax_lse_flag=True)
    start = 0
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        blocks = -(-kv_len // block_size)
        k = cache_k[table[b, :blocks].long()].reshape(-1, kv_heads, dim)[:kv_len]
        v = cache_v[table[b, :blocks].long()].reshape(-1, kv_heads, dim)[:kv_len]
        rows = slice(start, start + q_len)
        want, want_lse = _loop_attention(q[rows], k, v, 0.2, causal=True)
        torch.testing.assert_close(out[rows].float(), want, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse[rows, :, 0], want_lse, atol=1e-3, rtol=1e-3)
        start += q_len


# --- what the page rules out, and what the reference does not model --------------------------


def _dense_call(torch_npu, **overrides):
    q = torch.zeros(4, 2, 192, dtype=torch.bfloat16)
    v = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    kwargs = dict(query=q, key=q, value=v, num_heads=2, input_layout="TND", sparse_mode=3,
                  atten_mask=CAUSAL_MASK, actual_seq_lengths=[1, 4],
                  actual_seq_lengths_kv=[1, 4]) | overrides
    return torch_npu.npu_fused_infer_attention_score(**kwargs)


def test_well_formed_dense_call_succeeds(torch_npu):
    out, _ = _dense_call(torch_npu)
    assert out.shape == (4, 2, 128)


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"actual_seq_lengths": None}, RuntimeError, "actual_seq_lengths is None"),
    ({"actual_seq_lengths_kv": None}, RuntimeError, "actual_seq_lengths_kv is None"),
    ({"actual_seq_lengths": [3, 2]}, RuntimeError,
     r"actual_seq_lengths\[1\] = 2 is below actual_seq_lengths\[0\] = 3"),
    ({"actual_seq_lengths": [1, 5]}, RuntimeError, r"actual_seq_lengths\[-1\] = 5 exceeds"),
    ({"actual_seq_lengths_kv": [4]}, RuntimeError, "has 1 values but actual_seq_lengths has 2"),
    ({"actual_seq_lengths": [2, 4], "actual_seq_lengths_kv": [1, 4]}, RuntimeError,
     "batch 0: query length 2 exceeds key length 1"),
    ({"sparse_mode": 2}, RuntimeError, "sparse_mode=2 with atten_mask given"),
    ({"sparse_mode": 0}, RuntimeError, "sparse_mode=0 with atten_mask given"),
    ({"atten_mask": None}, RuntimeError, "sparse_mode=3 with atten_mask None"),
    ({"query": torch.zeros(4, 2, 192, dtype=torch.float16),
      "key": torch.zeros(4, 2, 192, dtype=torch.float16),
      "value": torch.zeros(4, 2, 128, dtype=torch.float16)}, RuntimeError, "bfloat16 only"),
    ({"query": torch.zeros(4, 2, 128, dtype=torch.bfloat16)}, RuntimeError,
     "requires query and key D 192"),
    ({"value": torch.zeros(4, 2, 64, dtype=torch.bfloat16)}, RuntimeError,
     r"value D=64.*\[128, 192\]"),
    ({"input_layout": "TND_NTD"}, RuntimeError, "TND_NTD only for query D 512"),
    ({"num_heads": 3, "query": torch.zeros(4, 3, 192, dtype=torch.bfloat16)}, RuntimeError,
     r"num_heads=3.*\[2, 4, 8"),
    ({"num_key_value_heads": 1}, RuntimeError, "num_key_value_heads=1"),
    ({"num_heads": 4}, RuntimeError, r"with N=4"),
    ({"query": torch.zeros(4, 2, 128, dtype=torch.bfloat16),
      "key": torch.zeros(4, 2, 128, dtype=torch.bfloat16),
      "query_rope": torch.zeros(4, 2, 64, dtype=torch.bfloat16),
      "key_rope": torch.zeros(4, 2, 64, dtype=torch.bfloat16),
      "block_table": torch.zeros(2, 1, dtype=torch.int32)}, RuntimeError,
     "rules out page attention"),
    ({"pse_shift": torch.zeros(1)}, RuntimeError, "pse_shift is given"),
    ({"antiquant_scale": torch.zeros(1)}, RuntimeError, "antiquant_scale is given"),
    ({"query_rope": torch.zeros(4, 2, 64, dtype=torch.bfloat16)}, RuntimeError,
     "must be given together"),
    ({"inner_precise": 4}, RuntimeError, "inner_precise=4"),
    ({"actual_seq_lengths": [1.0, 4.0]}, TypeError, "list of ints"),
])
def test_dense_tnd_refuses_what_the_page_rules_out(torch_npu, overrides, error, match):
    with pytest.raises(error, match=match):
        _dense_call(torch_npu, **overrides)


def test_dense_tnd_rows_past_their_keys_need_the_row_invalid_correction(torch_npu):
    """sparse_mode 0 never empties a row; an empty key list gives zero output."""
    q = torch.ones(3, 2, 192, dtype=torch.bfloat16)
    v = torch.ones(3, 2, 128, dtype=torch.bfloat16)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, q, v, num_heads=2, input_layout="TND", actual_seq_lengths=[1, 3],
        actual_seq_lengths_kv=[0, 3])
    assert not out[0].any() and out[1:].float().eq(1).all()


def _mla_call(torch_npu, **overrides):
    latent = torch.zeros(2, 16, 512, dtype=torch.float16)
    kwargs = dict(query=torch.zeros(3, 32, 512, dtype=torch.float16), key=latent, value=latent,
                  query_rope=torch.zeros(3, 32, 64, dtype=torch.float16),
                  key_rope=torch.zeros(2, 16, 64, dtype=torch.float16), num_heads=32,
                  num_key_value_heads=1, input_layout="TND", sparse_mode=3,
                  atten_mask=CAUSAL_MASK, actual_seq_lengths=[1, 3], actual_seq_lengths_kv=[4, 9],
                  block_table=torch.tensor([[0], [1]], dtype=torch.int32), block_size=16)
    return torch_npu.npu_fused_infer_attention_score(**(kwargs | overrides))


def test_well_formed_mla_call_succeeds(torch_npu):
    out, _ = _mla_call(torch_npu)
    assert out.shape == (3, 32, 512)


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"input_layout": "NTD_TND"}, RuntimeError, "allows TND and TND_NTD there"),
    ({"block_table": None}, RuntimeError, "requires page attention"),
    ({"block_size": 64}, RuntimeError, r"block_size=64; the MLA form takes \[16, 128\]"),
    ({"num_heads": 16, "query": torch.zeros(3, 16, 512, dtype=torch.float16),
      "query_rope": torch.zeros(3, 16, 64, dtype=torch.float16)}, RuntimeError,
     r"num_heads=16.*\[32, 64, 128\]"),
    ({"num_key_value_heads": 2}, RuntimeError, "num_key_value_heads=2"),
    ({"sparse_mode": 0, "atten_mask": None}, RuntimeError, "more than one query token"),
    ({"softmax_lse_flag": True}, RuntimeError, "rules out the softmax LSE"),
    ({"actual_seq_lengths_kv": [4]}, RuntimeError, "one length per batch"),
    ({"actual_seq_lengths_kv": [4, 17]}, RuntimeError, "fewer than the 3"),
    ({"actual_seq_lengths_kv": [4, 1]}, RuntimeError, "query length 2 exceeds key length 1"),
    ({"actual_seq_lengths": [0, 3]}, RuntimeError, "batch 0 has 0 query tokens"),
    ({"query": torch.zeros(3, 32, 256, dtype=torch.float16)}, RuntimeError,
     "query D 512 .page attention. or 128"),
])
def test_mla_tnd_refuses_what_the_page_rules_out(torch_npu, overrides, error, match):
    with pytest.raises(error, match=match):
        _mla_call(torch_npu, **overrides)


def _gqa_call(torch_npu, **overrides):
    cache = torch.zeros(2, 128, 32, dtype=torch.float16)
    kwargs = dict(query=torch.zeros(3, 2, 16, dtype=torch.float16), key=cache, value=cache,
                  num_heads=2, num_key_value_heads=2, input_layout="TND", sparse_mode=3,
                  atten_mask=CAUSAL_MASK, actual_seq_lengths=[1, 3], actual_seq_lengths_kv=[4, 9],
                  block_table=torch.tensor([[0], [1]], dtype=torch.int32), block_size=128)
    return torch_npu.npu_fused_infer_attention_score(**(kwargs | overrides))


def test_well_formed_gqa_call_succeeds(torch_npu):
    out, _ = _gqa_call(torch_npu)
    assert out.shape == (3, 2, 16)
    # A row with no key: zeros under the row-invalid correction.
    ones = torch.ones(2, 128, 32, dtype=torch.float16)
    out, _ = _gqa_call(torch_npu, key=ones, value=ones, actual_seq_lengths_kv=[4, 1],
                       inner_precise=2)
    assert not out[1].any() and out[2].float().eq(1).all() and out[0].float().eq(1).all()


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"input_layout": "NTD_TND"}, NotImplementedError,
     "input_layout='NTD_TND' with page attention and no rope is not modelled"),
    ({"key_antiquant_scale": torch.zeros(1)}, NotImplementedError,
     "key_antiquant_scale=tensor.* is not modelled"),
    ({"key": torch.zeros(2, 128, 32, dtype=torch.int8)}, NotImplementedError, "int8"),
    ({"block_size": 64}, RuntimeError, "128 to 512"),
    ({"actual_seq_lengths_kv": [4, 9, 1]}, RuntimeError, "one length per batch"),
    ({"key": torch.zeros(2, 128, 64, dtype=torch.float16)}, RuntimeError,
     "same shape"),
    ({"num_key_value_heads": 3}, RuntimeError, "multiple of num_key_value_heads"),
    ({"block_table": torch.tensor([[0], [5]], dtype=torch.int32)}, RuntimeError, "outside"),
    ({"actual_seq_lengths_kv": [4, 1]}, RuntimeError, "no key to attend"),
    ({"actual_seq_lengths_kv": [4, 1], "inner_precise": 2, "softmax_lse_flag": True},
     NotImplementedError, "softmax_lse_flag=True with a row that has no key"),
])
def test_gqa_tnd_refuses_what_it_does_not_take(torch_npu, overrides, error, match):
    with pytest.raises(error, match=match):
        _gqa_call(torch_npu, **overrides)
