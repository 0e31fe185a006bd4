"""The reference's quantized-KV (antiquant) forms of ``npu_fused_infer_attention_score``:
int8 key/value dequantised inside the op as ``(x + offset) * scale``, compared with plain
attention over key/value dequantised here, and the page's rules for the antiquant
arguments (one pair for key and value, or separate key/value scales; per-channel,
per-tensor, per-token)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

CAUSAL_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)


def _attention(q, k, v, scale, q_lens=None, kv_lens=None, causal=False):
    """q [B, Q_S, N, D], k/v float [B, KV_S, KVN, D] -> [B, Q_S, N, D] float32."""
    batch, q_s, heads, _ = q.shape
    group = heads // k.shape[2]
    out = torch.zeros(q.shape[0], q_s, heads, v.shape[-1])
    for b in range(batch):
        q_len = q_s if q_lens is None else q_lens[b]
        kv_len = k.shape[1] if kv_lens is None else kv_lens[b]
        kb = k[b, :kv_len].repeat_interleave(group, dim=1).transpose(0, 1)
        vb = v[b, :kv_len].repeat_interleave(group, dim=1).transpose(0, 1)
        mask = None
        if causal:
            mask = (torch.arange(kv_len)[None] <= torch.arange(q_len)[:, None] + kv_len - q_len)
        out[b, :q_len] = F.scaled_dot_product_attention(
            q[b, :q_len].float().transpose(0, 1), kb, vb, attn_mask=mask,
            scale=scale).transpose(0, 1)
    return out


def _int8(gen, *shape):
    return torch.randint(-128, 128, shape, generator=gen, dtype=torch.int8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["BSND", "BSH", "BNSD"])
def test_per_channel_pair_at_one_query_token(torch_npu, dtype, layout):
    gen = torch.Generator().manual_seed(60)
    batch, kv_s, heads, kv_heads, dim = 2, 9, 4, 2, 32
    q = torch.randn(batch, 1, heads, dim, generator=gen).to(dtype)
    k, v = _int8(gen, batch, kv_s, kv_heads, dim), _int8(gen, batch, kv_s, kv_heads, dim)
    scale = (torch.rand(2, kv_heads, dim, generator=gen) * 0.02 + 0.001).to(dtype)
    offset = torch.randint(-5, 5, (2, kv_heads, dim), generator=gen).to(dtype)
    k_fp = (k.float() + offset[0].float()) * scale[0].float()
    v_fp = (v.float() + offset[1].float()) * scale[1].float()

    def lay(t):
        return {"BSND": t, "BSH": t.flatten(2), "BNSD": t.transpose(1, 2).contiguous()}[layout]

    shaped = {"BSND": lambda s: s, "BSH": lambda s: s.flatten(1),
              "BNSD": lambda s: s.unsqueeze(2)}[layout]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        lay(q), lay(k), lay(v), num_heads=heads, num_key_value_heads=kv_heads,
        input_layout=layout, scale=0.2, antiquant_scale=shaped(scale),
        antiquant_offset=shaped(offset), actual_seq_lengths_kv=[9, 5])
    out = {"BSND": out, "BSH": out.reshape(batch, 1, heads, dim),
           "BNSD": out.transpose(1, 2)}[layout]
    want = _attention(q, k_fp, v_fp, 0.2, kv_lens=[9, 5])
    tol = 2e-3 if dtype == torch.float16 else 2e-2
    torch.testing.assert_close(out.float(), want, atol=tol, rtol=tol)


def test_per_tensor_pair_with_several_query_tokens(torch_npu):
    """Q_S > 1: float16 query, the shape (2,) picks per-tensor; symmetric (no offset)."""
    gen = torch.Generator().manual_seed(61)
    q = torch.randn(1, 4, 2, 32, generator=gen).half()
    k, v = _int8(gen, 1, 6, 2, 32), _int8(gen, 1, 6, 2, 32)
    scale = torch.tensor([0.01, 0.03], dtype=torch.float16)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=2, input_layout="BSND", antiquant_scale=scale,
        atten_mask=CAUSAL_MASK, sparse_mode=3)
    want = _attention(q, k.float() * 0.01, v.float() * scale[1].float(), 1.0, causal=True)
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


def test_per_token_pair_at_one_query_token(torch_npu):
    gen = torch.Generator().manual_seed(62)
    batch, kv_s = 2, 7
    q = torch.randn(batch, 1, 2, 32, generator=gen).half()
    k, v = _int8(gen, batch, kv_s, 1, 32), _int8(gen, batch, kv_s, 1, 32)
    scale = torch.rand(2, batch, kv_s, generator=gen) * 0.02 + 0.001
    offset = torch.randint(-3, 3, (2, batch, kv_s), generator=gen).float()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=2, num_key_value_heads=1, input_layout="BSND",
        antiquant_scale=scale, antiquant_offset=offset, antiquant_mode=1)
    k_fp = (k.float() + offset[0, :, :, None, None]) * scale[0, :, :, None, None]
    v_fp = (v.float() + offset[1, :, :, None, None]) * scale[1, :, :, None, None]
    torch.testing.assert_close(out.float(), _attention(q, k_fp, v_fp, 1.0), atol=2e-3,
                               rtol=2e-3)


def test_per_channel_pair_with_paged_int8_caches_at_decode(torch_npu):
    gen = torch.Generator().manual_seed(63)
    heads, kv_heads, dim, block = 4, 2, 32, 32
    kv_lens = [40, 5]
    cache_k = _int8(gen, 4, block, kv_heads * dim)
    cache_v = _int8(gen, 4, block, kv_heads * dim)
    table = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32)
    q = torch.randn(2, 1, heads, dim, generator=gen).half()
    scale = (torch.rand(2, kv_heads, dim, generator=gen) * 0.02 + 0.001).half()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, cache_k, cache_v, num_heads=heads, num_key_value_heads=kv_heads,
        input_layout="BSND", antiquant_scale=scale, block_table=table, block_size=block,
        actual_seq_lengths_kv=kv_lens)
    for b, kv_len in enumerate(kv_lens):
        rows_k = cache_k[table[b].long()].reshape(-1, kv_heads, dim)[:kv_len]
        rows_v = cache_v[table[b].long()].reshape(-1, kv_heads, dim)[:kv_len]
        want = _attention(q[b:b + 1], (rows_k.float() * scale[0].float())[None],
                          (rows_v.float() * scale[1].float())[None], 1.0)
        torch.testing.assert_close(out[b:b + 1].float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("mode", [0, 1])
def test_separate_key_value_scales_with_several_query_tokens(torch_npu, mode):
    """Q_S 2..16, bfloat16 query: per-channel (N, D) bfloat16 or per-token (B, KV_S) float32;
    the separate scales win over an antiquant_scale also given."""
    gen = torch.Generator().manual_seed(64)
    batch, q_s, kv_s, kv_heads, dim = 2, 3, 8, 2, 32
    q = torch.randn(batch, q_s, 4, dim, generator=gen).bfloat16()
    k, v = _int8(gen, batch, kv_s, kv_heads, dim), _int8(gen, batch, kv_s, kv_heads, dim)
    if mode == 0:
        k_scale = (torch.rand(kv_heads, dim, generator=gen) * 0.02).bfloat16()
        v_scale = (torch.rand(kv_heads, dim, generator=gen) * 0.02).bfloat16()
        k_fp, v_fp = k.float() * k_scale.float(), v.float() * v_scale.float()
    else:
        k_scale = torch.rand(batch, kv_s, generator=gen) * 0.02
        v_scale = torch.rand(batch, kv_s, generator=gen) * 0.02
        k_fp = k.float() * k_scale[:, :, None, None]
        v_fp = v.float() * v_scale[:, :, None, None]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=4, num_key_value_heads=kv_heads, input_layout="BSND",
        key_antiquant_scale=k_scale, value_antiquant_scale=v_scale, key_antiquant_mode=mode,
        value_antiquant_mode=mode, atten_mask=CAUSAL_MASK, sparse_mode=3,
        antiquant_scale=torch.ones(2, dtype=torch.bfloat16))
    torch.testing.assert_close(out.float(), _attention(q, k_fp, v_fp, 1.0, causal=True),
                               atol=2e-2, rtol=2e-2)


def test_separate_scales_at_decode_key_per_channel_value_per_token(torch_npu):
    gen = torch.Generator().manual_seed(65)
    batch, kv_s, dim = 2, 6, 32
    q = torch.randn(batch, 1, 2, dim, generator=gen).half()
    k, v = _int8(gen, batch, kv_s, 2, dim), _int8(gen, batch, kv_s, 2, dim)
    k_scale = (torch.rand(1, 2, dim, generator=gen) * 0.02).half()
    k_offset = torch.randint(-4, 4, (1, 2, dim), generator=gen).half()
    v_scale = torch.rand(1, batch, kv_s, generator=gen) * 0.02
    v_offset = torch.randint(-4, 4, (1, batch, kv_s), generator=gen).float()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=2, input_layout="BSND", key_antiquant_scale=k_scale,
        key_antiquant_offset=k_offset, value_antiquant_scale=v_scale,
        value_antiquant_offset=v_offset, key_antiquant_mode=0, value_antiquant_mode=1)
    k_fp = (k.float() + k_offset[0].float()) * k_scale[0].float()
    v_fp = (v.float() + v_offset[0, :, :, None, None]) * v_scale[0, :, :, None, None]
    torch.testing.assert_close(out.float(), _attention(q, k_fp, v_fp, 1.0), atol=2e-3,
                               rtol=2e-3)


def _call(torch_npu, **overrides):
    kwargs = dict(query=torch.zeros(1, 1, 2, 32, dtype=torch.float16),
                  key=torch.zeros(1, 4, 2, 32, dtype=torch.int8),
                  value=torch.zeros(1, 4, 2, 32, dtype=torch.int8), num_heads=2,
                  input_layout="BSND", antiquant_scale=torch.ones(2, 2, 32, dtype=torch.float16))
    return torch_npu.npu_fused_infer_attention_score(**(kwargs | overrides))


def test_well_formed_antiquant_call_succeeds(torch_npu):
    out, _ = _call(torch_npu)
    assert out.shape == (1, 1, 2, 32) and out.dtype == torch.float16


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"antiquant_scale": None}, RuntimeError, "neither antiquant_scale nor"),
    ({"value": torch.zeros(1, 4, 2, 32, dtype=torch.float16)}, RuntimeError,
     "must both be int8"),
    ({"key": torch.zeros(1, 4, 2, 32, dtype=torch.float16),
      "value": torch.zeros(1, 4, 2, 32, dtype=torch.float16)}, RuntimeError,
     "antiquant_scale is given but key and value are torch.float16"),
    ({"antiquant_scale": torch.ones(2, 64, dtype=torch.float16)}, RuntimeError,
     r"per-channel \(2, 2, 32\) or per-tensor \(2,\)"),
    ({"antiquant_scale": torch.ones(2, 2, 32)}, RuntimeError,
     "antiquant_scale has dtype torch.float32"),
    ({"antiquant_offset": torch.ones(2, dtype=torch.float16)}, RuntimeError,
     "antiquant_offset is torch.float16 .2,.; it must have antiquant_scale's shape"),
    ({"antiquant_mode": 2}, RuntimeError, "antiquant_mode=2; with Q_S = 1"),
    ({"antiquant_mode": 1}, RuntimeError, r"must be \(2, 1, 4\)"),
    ({"query": torch.zeros(1, 2, 2, 32, dtype=torch.bfloat16)}, RuntimeError,
     "query has dtype torch.bfloat16; with antiquant_scale and Q_S > 1"),
    ({"key_antiquant_scale": torch.ones(1, 2, 32, dtype=torch.float16)}, RuntimeError,
     "must be given together"),
    ({"key_antiquant_scale": torch.ones(1, 2, 32, dtype=torch.float16),
      "value_antiquant_scale": torch.ones(1, 2, 32, dtype=torch.float16),
      "key_antiquant_mode": 2, "value_antiquant_mode": 2}, NotImplementedError,
     "key_antiquant_mode=2 is not modelled"),
    ({"key_antiquant_scale": torch.ones(1, 2, 32, dtype=torch.float16),
      "value_antiquant_scale": torch.ones(1, 2, 32, dtype=torch.float16),
      "key_antiquant_mode": 1}, RuntimeError, "key_antiquant_mode=1 and value_antiquant_mode=0"),
    ({"key_antiquant_scale": torch.ones(2, 32, dtype=torch.float16),
      "value_antiquant_scale": torch.ones(2, 32, dtype=torch.float16)}, RuntimeError,
     r"key_antiquant_scale has shape \(2, 32\); with key_antiquant_mode=0 the page takes"),
    ({"key_antiquant_mode": 6}, RuntimeError, "key_antiquant_mode=6"),
    ({"key": torch.zeros(1, 4, 2, 4, dtype=torch.int32),
      "value": torch.zeros(1, 4, 2, 4, dtype=torch.int32)}, NotImplementedError, "int4"),
])
def test_antiquant_refuses_what_the_page_rules_out(torch_npu, overrides, error, match):
    with pytest.raises(error, match=match):
        _call(torch_npu, **overrides)


def test_antiquant_with_page_attention_and_several_query_tokens_is_ruled_out(torch_npu):
    cache = torch.zeros(1, 128, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="rules out antiquant with page attention"):
        torch_npu.npu_fused_infer_attention_score(
            torch.zeros(1, 2, 2, 32, dtype=torch.float16), cache, cache, num_heads=2,
            input_layout="BSND", antiquant_scale=torch.ones(2, dtype=torch.float16),
            block_table=torch.zeros(1, 1, dtype=torch.int32), block_size=128,
            actual_seq_lengths_kv=[2], atten_mask=CAUSAL_MASK, sparse_mode=3)
    with pytest.raises(NotImplementedError, match="antiquant_mode=1 is not modelled"):
        torch_npu.npu_fused_infer_attention_score(
            torch.zeros(1, 1, 2, 32, dtype=torch.float16), cache[:, :32], cache[:, :32],
            num_heads=2, input_layout="BSND", antiquant_scale=torch.ones(2, 1, 32),
            antiquant_mode=1, block_table=torch.zeros(1, 1, dtype=torch.int32),
            block_size=32, actual_seq_lengths_kv=[2])
