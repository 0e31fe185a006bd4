"""The reference's paged KV-cache write and fused inference attention against plain torch
attention (``scaled_dot_product_attention`` over the unpaged keys) and the argument rules
of their torch_npu documentation pages."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

HALF = [torch.float16, torch.bfloat16]
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
CAUSAL_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)




# --- npu_scatter_pa_kv_cache --------------------------------------------------------------


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_scatter_writes_each_token_at_its_slot(torch_npu, slot_dtype):
    torch.manual_seed(0)
    blocks, block_size, heads, dim = 4, 16, 2, 32
    key = torch.randn(10, heads, dim, dtype=torch.float16)
    value = torch.randn(10, heads, dim, dtype=torch.float16)
    key_cache = torch.zeros(blocks, block_size, heads, dim, dtype=torch.float16)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(blocks * block_size)[:10].to(slot_dtype)
    assert torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slots,
                                             cache_mode="Norm") is None
    for t, slot in enumerate(slots.tolist()):
        torch.testing.assert_close(key_cache[slot // block_size, slot % block_size], key[t])
        torch.testing.assert_close(value_cache[slot // block_size, slot % block_size],
                                   value[t])
    written = torch.zeros(blocks * block_size, dtype=torch.bool)
    written[slots.long()] = True
    assert not key_cache.view(-1, heads, dim)[~written].any()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"cache_mode": "PA_NZ"}, RuntimeError, "with cache_mode='PA_NZ' it must be"),
    ({}, RuntimeError, r"num_head \* head_size // 16 = 1"),
    ({"cache_mode": "Norm", "seq_lens": torch.ones(1, dtype=torch.int32)},
     NotImplementedError, "seq_lens"),
    ({"cache_mode": "ND"}, RuntimeError, "allows None, 'Norm' or 'PA_NZ'"),
])
def test_scatter_refuses_unmodelled_modes(torch_npu, kwargs, error, match):
    key = torch.ones(2, 1, 16, dtype=torch.float16)
    cache = torch.zeros(1, 16, 1, 16, dtype=torch.float16)
    with pytest.raises(error, match=match):
        torch_npu.npu_scatter_pa_kv_cache(key, key, cache, cache.clone(),
                                          torch.tensor([0, 1]), **kwargs)


@pytest.mark.parametrize(("dtype", "row"), [(torch.float16, 16), (torch.bfloat16, 16),
                                            (torch.int8, 32)])
def test_pa_nz_scatter_cuts_each_token_into_32_byte_rows(torch_npu, dtype, row):
    """The default cache_mode: [num_blocks, H / L, block_size, L] caches, token t's values
    row c to cache[block, c, offset] (the real op's test golden, written out here)."""
    gen = torch.Generator().manual_seed(30)
    tokens, heads, k_dim, v_dim, blocks, block_size = 6, 2, 32, 64, 3, 16
    key = torch.randint(-100, 100, (tokens, heads, k_dim), generator=gen).to(dtype)
    value = torch.randint(-100, 100, (tokens, heads, v_dim), generator=gen).to(dtype)
    key_cache = torch.zeros(blocks, heads * k_dim // row, block_size, row, dtype=dtype)
    value_cache = torch.zeros(blocks, heads * v_dim // row, block_size, row, dtype=dtype)
    slots = torch.tensor([0, 17, 5, 47, 16, 33], dtype=torch.int32)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        flat_k, flat_v = key[t].reshape(-1), value[t].reshape(-1)
        for c in range(want_k.shape[1]):
            want_k[block, c, offset] = flat_k[c * row:(c + 1) * row]
        for c in range(want_v.shape[1]):
            want_v[block, c, offset] = flat_v[c * row:(c + 1) * row]
    torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


def test_pa_nz_takes_fractal_nz_npu_caches_and_norm_takes_nd(torch_npu):
    key = torch.ones(2, 1, 16, dtype=torch.float16, device="npu")
    nd = torch.zeros(1, 1, 16, 16, dtype=torch.float16, device="npu")
    nz_k = torch_npu.npu_format_cast(nd, 29)
    nz_v = torch_npu.npu_format_cast(nd.clone(), 29)
    torch_npu.npu_scatter_pa_kv_cache(key, key, nz_k, nz_v, torch.tensor([0, 3], device="npu"))
    assert nz_k[0, 0, [0, 3]].eq(1).all() and not nz_k[0, 0, [1, 2]].any()
    with pytest.raises(RuntimeError, match="key_cache is NCHW but cache_mode='PA_NZ' takes"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, nd, nd.clone(),
                                          torch.tensor([0, 3], device="npu"))
    norm = torch.zeros(1, 16, 1, 16, dtype=torch.float16, device="npu")
    with pytest.raises(RuntimeError, match="FRACTAL_NZ but cache_mode=.Norm. takes caches not cast"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, torch_npu.npu_format_cast(norm, 29),
                                          norm.clone(), torch.tensor([0, 3], device="npu"),
                                          cache_mode="Norm")


@pytest.mark.parametrize(("slots", "cache_dtype", "match"), [
    (torch.tensor([0, -1]), torch.float16, r"values in \[-1, 0\]"),
    (torch.tensor([0, 32]), torch.float16, r"\[0, 31\]"),
    (torch.tensor([3, 3]), torch.float16, "duplicate"),
    (torch.tensor([0, 1, 2]), torch.float16, "one slot per token"),
    (torch.tensor([0.0, 1.0]), torch.float16, "int32 or int64"),
    (torch.tensor([0, 1]), torch.bfloat16, "identical dtypes"),
])
def test_scatter_rejects_bad_slots_and_dtypes(torch_npu, slots, cache_dtype, match):
    key = torch.ones(2, 1, 16, dtype=torch.float16)
    cache = torch.zeros(2, 16, 1, 16, dtype=cache_dtype)
    with pytest.raises((RuntimeError, RuntimeError), match=match):
        torch_npu.npu_scatter_pa_kv_cache(key, key, cache, cache.clone(), slots,
                                          cache_mode="Norm")


def test_scatter_rejects_cache_of_wrong_head_shape(torch_npu):
    key = torch.ones(2, 2, 16, dtype=torch.float16)
    cache = torch.zeros(2, 16, 1, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match=r"\[num_blocks, block_size, 2, 16\]"):
        torch_npu.npu_scatter_pa_kv_cache(key, key, cache, cache.clone(),
                                          torch.tensor([0, 1]), cache_mode="Norm")


# --- npu_fused_infer_attention_score ------------------------------------------------------


def _paged(sequences, block_size, num_blocks, generator):
    """Each [len, KVH, D] sequence scattered into shuffled blocks of a (num_blocks,
    block_size, KVH*D) cache; returns (cache, int32 block table)."""
    kv_heads, dim = sequences[0].shape[1:]
    cache = torch.randn(num_blocks, block_size, kv_heads * dim, generator=generator)
    cache = cache.to(sequences[0].dtype)
    width = max(-(-s.shape[0] // block_size) for s in sequences)
    order = torch.randperm(num_blocks, generator=generator)
    table = torch.zeros(len(sequences), width, dtype=torch.int32)
    used = 0
    for b, seq in enumerate(sequences):
        count = -(-seq.shape[0] // block_size)
        table[b, :count] = order[used:used + count].int()
        used += count
        flat = cache[table[b, :count].long()].reshape(-1, kv_heads, dim)
        flat[:seq.shape[0]] = seq
        cache[table[b, :count].long()] = flat.reshape(count, block_size, -1)
    return cache, table


def _sdpa(q, k, v, scale, causal_offset):
    """Plain attention for one batch: q [q, N, D], k/v [k, KVH, D]; query row i sees keys
    j <= i + causal_offset (None: all)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    mask = None
    if causal_offset is not None:
        rows = torch.arange(q.shape[0]).unsqueeze(1)
        mask = torch.arange(k.shape[0]).unsqueeze(0) <= rows + causal_offset
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.transpose(0, 1),
                                         v.transpose(0, 1), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("layout", "split_cache"), [
    ("BSND", False), ("BSH", False), ("BNSD", False), ("BNSD", True)])
def test_causal_paged_prefill_matches_plain_attention(torch_npu, dtype, layout, split_cache):
    """Page attention for each query layout; a BNSD query also takes (num_blocks, KV_N,
    block_size, D) caches (``split_cache``)."""
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim, block_size = 4, 2, 32, 128
    q_lens, kv_lens = [5, 130, 1], [5, 300, 40]   # fresh prompt, chunk on context, decode
    q_s = max(q_lens)
    keys = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in kv_lens]
    values = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in kv_lens]
    key_cache, table = _paged(keys, block_size, 8, gen)
    value_cache = torch.zeros_like(key_cache)      # the same blocks, through key's table
    for b, seq in enumerate(values):
        count = -(-seq.shape[0] // block_size)
        flat = torch.zeros(count * block_size, kv_heads, dim, dtype=dtype)
        flat[:seq.shape[0]] = seq
        value_cache[table[b, :count].long()] = flat.reshape(count, block_size, -1)
    query = torch.randn(len(q_lens), q_s, heads, dim, generator=gen).to(dtype)
    scale = dim ** -0.5
    if split_cache:  # the same blocks, each as (KV_N, block_size, D)
        key_cache, value_cache = (
            cache.reshape(cache.shape[0], block_size, kv_heads, dim).transpose(1, 2).contiguous()
            for cache in (key_cache, value_cache))
    given = {"BSND": query, "BSH": query.reshape(len(q_lens), q_s, heads * dim),
             "BNSD": query.transpose(1, 2).contiguous()}[layout]
    out, lse = torch_npu.npu_fused_infer_attention_score(
        given, key_cache, value_cache, atten_mask=CAUSAL_MASK.to(torch.int8),
        actual_seq_lengths=q_lens, actual_seq_lengths_kv=kv_lens, block_table=table,
        block_size=block_size, num_heads=heads, num_key_value_heads=kv_heads, scale=scale,
        input_layout=layout, sparse_mode=3, softmax_lse_flag=True)
    out = out.transpose(1, 2) if layout == "BNSD" else out.reshape(len(q_lens), q_s, heads, dim)
    assert out.dtype == dtype
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        expected = _sdpa(query[b, :q_len], keys[b], values[b], scale, kv_len - q_len)
        torch.testing.assert_close(out[b, :q_len].float(), expected, atol=TOL[dtype],
                                   rtol=TOL[dtype])
        assert not out[b, q_len:].any()            # padding rows
        group = heads // kv_heads
        k = keys[b].float().repeat_interleave(group, dim=1)
        scores = scale * torch.einsum("qnd,knd->nqk", query[b, :q_len].float(), k)
        allowed = (torch.arange(kv_len).unsqueeze(0)
                   <= torch.arange(q_len).unsqueeze(1) + kv_len - q_len)
        expected_lse = torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), -1)
        torch.testing.assert_close(lse[b, :, :q_len, 0], expected_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", HALF)
def test_decode_sees_every_cached_key(torch_npu, dtype):
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, block_size = 8, 1, 64, 16
    kv_lens = [1, 17, 48]
    keys = [torch.randn(n, kv_heads, dim, generator=gen).to(dtype) for n in kv_lens]
    key_cache, table = _paged(keys, block_size, 6, gen)
    query = torch.randn(3, 1, heads, dim, generator=gen).to(dtype)
    out, lse = torch_npu.npu_fused_infer_attention_score(
        query, key_cache, key_cache, actual_seq_lengths_kv=kv_lens, block_table=table,
        block_size=block_size, num_heads=heads, num_key_value_heads=kv_heads, scale=0.3,
        input_layout="BSND", sparse_mode=3)
    assert lse.shape == (1,) and not lse.any()
    for b in range(3):
        expected = _sdpa(query[b], keys[b], keys[b], 0.3, None)
        torch.testing.assert_close(out[b].float(), expected, atol=TOL[dtype], rtol=TOL[dtype])


def test_sparse_mode_zero_attends_without_mask(torch_npu):
    gen = torch.Generator().manual_seed(3)
    keys = [torch.randn(6, 1, 16, generator=gen).half()]
    cache, table = _paged(keys, 128, 1, gen)
    query = torch.randn(1, 6, 2, 16, generator=gen).half()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query, cache, cache, actual_seq_lengths=[6], actual_seq_lengths_kv=[6],
        block_table=table, block_size=128, num_heads=2, num_key_value_heads=1,
        input_layout="BSND", sparse_mode=0)
    expected = _sdpa(query[0], keys[0], keys[0], 1.0, None)
    torch.testing.assert_close(out[0].float(), expected, atol=2e-3, rtol=2e-3)


def _call(torch_npu, **overrides):
    cache = torch.zeros(2, 128, 32, dtype=torch.float16)
    kwargs = dict(query=torch.zeros(1, 2, 2, 16, dtype=torch.float16), key=cache,
                  value=cache, atten_mask=CAUSAL_MASK, actual_seq_lengths=[2],
                  actual_seq_lengths_kv=[2], block_table=torch.zeros(1, 1, dtype=torch.int32),
                  block_size=128, num_heads=2, num_key_value_heads=2, input_layout="BSND",
                  sparse_mode=3)
    kwargs.update(overrides)
    return torch_npu.npu_fused_infer_attention_score(**kwargs)


def test_well_formed_call_succeeds(torch_npu):
    out, _ = _call(torch_npu)
    assert out.shape == (1, 2, 2, 16)


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"key_shared_prefix": torch.zeros(1)}, NotImplementedError,
     "key_shared_prefix is not modelled"),
    ({"query_rope": torch.zeros(1)}, RuntimeError, "must be given together"),
    ({"antiquant_scale": torch.zeros(1)}, RuntimeError, "antiquant_scale is given but key"),
    ({"dequant_scale1": torch.zeros(1)}, NotImplementedError, "dequant_scale1 is not modelled"),
    ({"input_layout": "TND"}, RuntimeError, "with input_layout='TND' it must be 3-D"),
    # (num_blocks, KV_N, block_size, D) caches are for BNSD / TND queries only (the page).
    ({"key": torch.zeros(2, 2, 128, 16, dtype=torch.float16),
      "value": torch.zeros(2, 2, 128, 16, dtype=torch.float16)}, RuntimeError,
     r"must be \(num_blocks, block_size=128"),
    ({"block_table": None}, RuntimeError, "without block_table"),
    ({"sparse_mode": 4, "pre_tokens": -3, "next_tokens": 1}, RuntimeError,
     "band they span is empty"),
    ({"sparse_mode": 7}, RuntimeError, "allows 0 to 4"),
    ({"sparse_mode": 0, "atten_mask": torch.zeros(2, 64, dtype=torch.bool)}, RuntimeError,
     "KV_S=128"),
    ({"atten_mask": None}, RuntimeError, "needs the compressed"),
    ({"atten_mask": CAUSAL_MASK[:1024, :1024]}, RuntimeError, "compressed"),
    ({"atten_mask": ~CAUSAL_MASK}, RuntimeError, "not the compressed causal mask"),
    ({"query": torch.zeros(1, 2, 2, 16)}, RuntimeError, "float16 and bfloat16"),
    ({"key": torch.zeros(2, 128, 32, dtype=torch.int8)}, RuntimeError, "must both be int8"),
    ({"query": torch.zeros(1, 2, 2, 16, dtype=torch.int8)}, NotImplementedError,
     "query in int8"),
    ({"query": torch.zeros(1, 2, 2, 24, dtype=torch.float16)}, RuntimeError, "multiple of 16"),
    ({"block_size": 64}, RuntimeError, "128 to 512"),
    ({"num_key_value_heads": 3}, RuntimeError, "multiple of num_key_value_heads"),
    ({"actual_seq_lengths_kv": None}, RuntimeError, "needs actual_seq_lengths_kv"),
    ({"actual_seq_lengths": [3]}, RuntimeError, r"actual_seq_lengths\[0\] = 3"),
    ({"actual_seq_lengths_kv": [200]}, RuntimeError, "needs 2 blocks"),
    ({"actual_seq_lengths": [2], "actual_seq_lengths_kv": [1]}, RuntimeError, "no key"),
    ({"block_table": torch.zeros(1, 1, dtype=torch.int64)}, RuntimeError, "int32"),
    ({"block_table": torch.full((1, 1), 5, dtype=torch.int32)}, RuntimeError, "outside"),
])
def test_fused_attention_refuses_what_it_does_not_model(torch_npu, overrides, error, match):
    with pytest.raises(error, match=match):
        _call(torch_npu, **overrides)


def test_a_full_mask_with_page_attention_hides_logical_positions(torch_npu):
    """The page allows a full mask with page attention when its KV_S covers the longest
    batch's blocks; its columns are each batch's key positions, wherever the blocks lie."""
    gen = torch.Generator().manual_seed(24)
    heads, dim, block_size = 2, 16, 128
    kv_lens = [100, 140]
    keys = [torch.randn(n, heads, dim, generator=gen).half() for n in kv_lens]
    cache, table = _paged(keys, block_size, 4, gen)
    query = torch.randn(2, 3, heads, dim, generator=gen).half()
    mask = torch.rand(2, 1, 3, 256, generator=gen) < 0.5
    mask[..., 0] = False
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query, cache, cache, atten_mask=mask, actual_seq_lengths_kv=kv_lens, block_table=table,
        block_size=block_size, num_heads=heads, input_layout="BSND", sparse_mode=1)
    for b, kv_len in enumerate(kv_lens):
        want, _ = _masked_attention(query[b], keys[b], keys[b], 1.0, ~mask[b, 0, :, :kv_len])
        torch.testing.assert_close(out[b].float(), want, atol=2e-3, rtol=2e-3)
    with pytest.raises(RuntimeError, match="KV_S=256"):
        torch_npu.npu_fused_infer_attention_score(
            query, cache, cache, atten_mask=mask[..., :200], actual_seq_lengths_kv=kv_lens,
            block_table=table, block_size=block_size, num_heads=heads, input_layout="BSND",
            sparse_mode=1)


# --- dense key/value, BNSD, user masks ------------------------------------------------------


def _dense(tensor_bsnd: torch.Tensor, layout: str) -> torch.Tensor:
    """[B, S, N, D] -> the layout's tensor."""
    if layout == "BSH":
        return tensor_bsnd.flatten(2)
    return tensor_bsnd.transpose(1, 2).contiguous() if layout == "BNSD" else tensor_bsnd


def _masked_attention(q, k, v, scale, allowed):
    """One batch: q [q, N, D], k/v [k, KVH, D], allowed [q, k] bool."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = scale * torch.einsum("qnd,knd->nqk", q.float(), k)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("nqk,knd->qnd", probs, v), torch.logsumexp(
        scores.masked_fill(~allowed, float("-inf")), -1)


@pytest.mark.parametrize("layout", ["BSND", "BSH", "BNSD"])
@pytest.mark.parametrize("dtype", HALF)
def test_dense_key_value_in_each_layout_matches_plain_attention(torch_npu, layout, dtype):
    gen = torch.Generator().manual_seed(20)
    batch, q_s, kv_s, heads, kv_heads, dim = 2, 5, 9, 4, 2, 32
    q = torch.randn(batch, q_s, heads, dim, generator=gen).to(dtype)
    k = torch.randn(batch, kv_s, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(batch, kv_s, kv_heads, dim, generator=gen).to(dtype)
    kv_lens = [9, 6]
    out, lse = torch_npu.npu_fused_infer_attention_score(
        _dense(q, layout), _dense(k, layout), _dense(v, layout), num_heads=heads,
        num_key_value_heads=kv_heads, input_layout=layout, scale=0.2,
        actual_seq_lengths_kv=kv_lens, softmax_lse_flag=True)
    assert out.shape == _dense(q, layout).shape and out.dtype == dtype
    out_bsnd = out if layout == "BSND" else (
        out.reshape(batch, q_s, heads, dim) if layout == "BSH" else out.transpose(1, 2))
    for b, kv_len in enumerate(kv_lens):
        want, want_lse = _masked_attention(q[b], k[b, :kv_len], v[b, :kv_len], 0.2,
                                           torch.ones(q_s, kv_len, dtype=torch.bool))
        torch.testing.assert_close(out_bsnd[b].float(), want, atol=TOL[dtype], rtol=TOL[dtype])
        torch.testing.assert_close(lse[b, :, :, 0], want_lse, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask_shape", ["QK", "1QK", "BQK", "B1QK", "11QK"])
@pytest.mark.parametrize("sparse_mode", [0, 1])
def test_a_full_user_mask_hides_what_it_marks(torch_npu, mask_shape, sparse_mode):
    """sparse_mode 0 / 1 with the full mask: 1 (True) is not computed; the mask's S dims
    may be padded up to an aligned size and the padding is not read."""
    gen = torch.Generator().manual_seed(21)
    batch, q_s, kv_s, heads, dim = 2, 3, 5, 2, 16
    q = torch.randn(batch, heads, q_s, dim, generator=gen).half()
    k = torch.randn(batch, heads, kv_s, dim, generator=gen).half()
    padded = torch.rand(batch, 16, 32, generator=gen) < 0.4
    padded[:, :, 0] = False  # every row keeps key 0
    if mask_shape in ("QK", "1QK", "11QK"):
        padded[1] = padded[0]
    mask = {"QK": padded[0], "1QK": padded[:1], "BQK": padded, "B1QK": padded[:, None],
            "11QK": padded[:1, None]}[mask_shape].to(torch.int8)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=heads, input_layout="BNSD", atten_mask=mask,
        sparse_mode=sparse_mode)
    for b in range(batch):
        allowed = ~padded[b, :q_s, :kv_s]
        want, _ = _masked_attention(q[b].transpose(0, 1), k[b].transpose(0, 1),
                                    k[b].transpose(0, 1), 1.0, allowed)
        torch.testing.assert_close(out[b].transpose(0, 1).float(), want, atol=2e-3, rtol=2e-3)


def test_left_up_causal_sees_keys_up_to_its_own_row(torch_npu):
    gen = torch.Generator().manual_seed(22)
    q = torch.randn(1, 4, 2, 16, generator=gen).half()
    k = torch.randn(1, 7, 2, 16, generator=gen).half()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=2, input_layout="BSND", atten_mask=CAUSAL_MASK, sparse_mode=2)
    rows, cols = torch.arange(4)[:, None], torch.arange(7)[None]
    want, _ = _masked_attention(q[0], k[0], k[0], 1.0, cols <= rows)
    torch.testing.assert_close(out[0].float(), want, atol=2e-3, rtol=2e-3)
    right, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=2, input_layout="BSND", atten_mask=CAUSAL_MASK, sparse_mode=3)
    want_right, _ = _masked_attention(q[0], k[0], k[0], 1.0, cols <= rows + 3)
    torch.testing.assert_close(right[0].float(), want_right, atol=2e-3, rtol=2e-3)


def test_decode_mask_hides_padding_keys(torch_npu):
    gen = torch.Generator().manual_seed(23)
    q = torch.randn(2, 1, 2, 16, generator=gen).half()
    k = torch.randn(2, 6, 2, 16, generator=gen).half()
    mask = torch.zeros(2, 1, 1, 16, dtype=torch.bool)
    mask[0, ..., 4:] = True
    mask[1, ..., :2] = True
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=2, input_layout="BSND", atten_mask=mask, sparse_mode=3)
    for b in range(2):
        allowed = ~mask[b, 0, :, :6]
        want, _ = _masked_attention(q[b], k[b], k[b], 1.0, allowed)
        torch.testing.assert_close(out[b].float(), want, atol=2e-3, rtol=2e-3)


def test_rows_with_no_key_need_the_row_invalid_correction(torch_npu):
    q = torch.ones(1, 2, 2, 16, dtype=torch.float16)
    k = torch.ones(1, 3, 2, 16, dtype=torch.float16)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    mask[1] = True  # row 1 sees nothing
    with pytest.raises(RuntimeError, match="no key to attend"):
        torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=2, input_layout="BSND",
                                                  atten_mask=mask)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=2, input_layout="BSND", atten_mask=mask, inner_precise=2)
    assert not out[0, 1].any() and out[0, 0].float().allclose(torch.ones(2, 16))
    with pytest.raises(NotImplementedError, match="softmax_lse of a row"):
        torch_npu.npu_fused_infer_attention_score(
            q, k, k, num_heads=2, input_layout="BSND", atten_mask=mask, inner_precise=2,
            softmax_lse_flag=True)


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"sparse_mode": 1}, RuntimeError, "needs the full atten_mask"),
    ({"pre_tokens": -2, "next_tokens": 1, "atten_mask": torch.zeros(2, 3, dtype=torch.bool)},
     RuntimeError, r"pre_tokens=-2 and next_tokens=1 with sparse_mode=0"),
    ({"sparse_mode": 4, "atten_mask": torch.zeros(2, 3, dtype=torch.bool)}, RuntimeError,
     "sparse_mode=4 it must be the compressed"),
    ({"atten_mask": torch.zeros(2, 3)}, RuntimeError, "bool, int8 and uint8"),
    ({"atten_mask": torch.zeros(2, 2, dtype=torch.bool)}, RuntimeError,
     r"with B=1, Q_S=2, KV_S=3"),
    ({"atten_mask": torch.zeros(3, 2, 3, dtype=torch.bool)}, RuntimeError, "it must be"),
    ({"value": torch.zeros(1, 4, 2, 16, dtype=torch.float16)}, RuntimeError, "same shape"),
    ({"key": torch.zeros(1, 3, 1, 16, dtype=torch.float16),
      "value": torch.zeros(1, 3, 1, 16, dtype=torch.float16)}, RuntimeError,
     "num_key_value_heads=2"),
    ({"actual_seq_lengths_kv": [4]}, RuntimeError, r"actual_seq_lengths_kv\[0\] = 4"),
])
def test_dense_attention_refuses_what_the_page_rules_out(torch_npu, overrides, error, match):
    kwargs = dict(query=torch.zeros(1, 2, 2, 16, dtype=torch.float16),
                  key=torch.zeros(1, 3, 2, 16, dtype=torch.float16),
                  value=torch.zeros(1, 3, 2, 16, dtype=torch.float16), num_heads=2,
                  input_layout="BSND") | overrides
    with pytest.raises(error, match=match):
        torch_npu.npu_fused_infer_attention_score(**kwargs)


# --- bands: sparse_mode 4, and pre_tokens / next_tokens with sparse_mode 0 -------------------


def _band(q_len, kv_len, pre, nxt, right_down):
    """allowed[i, j] for a band written out cell by cell."""
    allowed = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for i in range(q_len):
        diagonal = i + (kv_len - q_len if right_down else 0)
        for j in range(kv_len):
            allowed[i, j] = diagonal - pre <= j <= diagonal + nxt
    return allowed


@pytest.mark.parametrize(("pre", "nxt"), [(2, 0), (1, 1), (4, -1), (-1, 2), (0, 0)])
def test_band_mode_counts_from_the_bottom_right(torch_npu, pre, nxt):
    """sparse_mode 4: the band around each batch's right-down diagonal (its actual lengths),
    with the compressed mask; negative values shift the band."""
    gen = torch.Generator().manual_seed(25)
    q_lens, kv_lens = [4, 3], [7, 5]
    q = torch.randn(2, 4, 2, 16, generator=gen).half()
    k = torch.randn(2, 7, 2, 16, generator=gen).half()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=2, input_layout="BSND", atten_mask=CAUSAL_MASK, sparse_mode=4,
        pre_tokens=pre, next_tokens=nxt, actual_seq_lengths=q_lens,
        actual_seq_lengths_kv=kv_lens, inner_precise=2)
    for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
        allowed = _band(q_len, kv_len, pre, nxt, right_down=True)
        want, _ = _masked_attention(q[b, :q_len], k[b, :kv_len], k[b, :kv_len], 1.0, allowed)
        torch.testing.assert_close(out[b, :q_len].float(), want.nan_to_num(0.0), atol=2e-3,
                                   rtol=2e-3)


@pytest.mark.parametrize(("pre", "nxt"), [(1, 0), (0, 2), (3, -1)])
def test_default_mask_band_counts_from_the_top_left(torch_npu, pre, nxt):
    """sparse_mode 0 with a full mask and pre_tokens / next_tokens: the mask and the band
    around the top-left diagonal both apply."""
    gen = torch.Generator().manual_seed(26)
    q = torch.randn(1, 4, 2, 16, generator=gen).half()
    k = torch.randn(1, 6, 2, 16, generator=gen).half()
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 5] = True
    mask[2, 0] = True
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=2, input_layout="BSND", atten_mask=mask, sparse_mode=0,
        pre_tokens=pre, next_tokens=nxt, inner_precise=2)
    allowed = _band(4, 6, pre, nxt, right_down=False) & ~mask
    want, _ = _masked_attention(q[0], k[0], k[0], 1.0, allowed)
    torch.testing.assert_close(out[0].float(), want.nan_to_num(0.0), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize(("sparse_mode", "mask"), [
    (0, None), (1, torch.zeros(3, 5, dtype=torch.bool)), (2, CAUSAL_MASK), (3, CAUSAL_MASK)])
def test_pre_and_next_tokens_are_ignored_where_the_page_says(torch_npu, sparse_mode, mask):
    gen = torch.Generator().manual_seed(27)
    q = torch.randn(1, 3, 2, 16, generator=gen).half()
    k = torch.randn(1, 5, 2, 16, generator=gen).half()
    kwargs = dict(num_heads=2, input_layout="BSND", atten_mask=mask, sparse_mode=sparse_mode)
    plain, _ = torch_npu.npu_fused_infer_attention_score(q, k, k, **kwargs)
    banded, _ = torch_npu.npu_fused_infer_attention_score(q, k, k, pre_tokens=0,
                                                          next_tokens=0, **kwargs)
    assert torch.equal(plain, banded)


def test_a_band_at_one_query_token_has_no_effect(torch_npu):
    gen = torch.Generator().manual_seed(28)
    q = torch.randn(1, 1, 2, 16, generator=gen).half()
    k = torch.randn(1, 5, 2, 16, generator=gen).half()
    plain, _ = torch_npu.npu_fused_infer_attention_score(q, k, k, num_heads=2,
                                                         input_layout="BSND")
    banded, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, k, num_heads=2, input_layout="BSND", sparse_mode=4, atten_mask=None,
        pre_tokens=0, next_tokens=0)
    assert torch.equal(plain, banded)
