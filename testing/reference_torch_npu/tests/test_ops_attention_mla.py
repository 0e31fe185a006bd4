"""The reference's MLA form of ``npu_fused_infer_attention_score`` (``query_rope`` and
``key_rope``; one latent KV head read as key and value from a paged cache) against plain
torch MLA attention over the unpaged latent and rope rows, and the MLA form's argument
rules from its torch_npu documentation page. The latent + rope cache is written with
``npu_scatter_pa_kv_cache`` in its ND mode, key and value of different head sizes."""

from __future__ import annotations

import math

import pytest
import torch

TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
CAUSAL_MASK = torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1)
LATENT, ROPE = 512, 64




class Case:
    """Per-batch latent and rope rows, written into paged caches through the scatter op,
    with a shuffled block table."""

    def __init__(self, torch_npu, q_lens, kv_lens, heads, dtype, block_size=128,
                 num_blocks=8, seed=0, q_s=None):
        gen = torch.Generator().manual_seed(seed)
        self.q_lens, self.kv_lens, self.heads, self.dtype = q_lens, kv_lens, heads, dtype
        self.block_size = block_size
        self.q_s = q_s or max(q_lens)

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        self.latent = [randn(n, LATENT) for n in kv_lens]
        self.rope = [randn(n, ROPE) for n in kv_lens]
        batch = len(q_lens)
        self.query = randn(batch, self.q_s, heads, LATENT)
        self.query_rope = randn(batch, self.q_s, heads, ROPE)
        counts = [math.ceil(n / block_size) for n in kv_lens]
        order = torch.randperm(num_blocks, generator=gen)
        self.block_table = torch.zeros(batch, max(counts) + 1, dtype=torch.int32)
        used = 0
        for b, count in enumerate(counts):
            self.block_table[b, :count] = order[used:used + count].int()
            used += count
        self.latent_cache = torch.zeros(num_blocks, block_size, LATENT, dtype=dtype)
        self.rope_cache = torch.zeros(num_blocks, block_size, ROPE, dtype=dtype)
        slots = [int(self.block_table[b, p // block_size]) * block_size + p % block_size
                 for b, n in enumerate(kv_lens) for p in range(n)]
        torch_npu.npu_scatter_pa_kv_cache(
            torch.cat(self.latent).unsqueeze(1), torch.cat(self.rope).unsqueeze(1),
            self.latent_cache.view(num_blocks, block_size, 1, LATENT),
            self.rope_cache.view(num_blocks, block_size, 1, ROPE),
            torch.tensor(slots), cache_mode="Norm")

    def kwargs(self, **overrides):
        causal = self.q_s > 1
        kwargs = dict(
            query=self.query, key=self.latent_cache, value=self.latent_cache,
            query_rope=self.query_rope, key_rope=self.rope_cache,
            atten_mask=CAUSAL_MASK if causal else None, actual_seq_lengths=self.q_lens,
            actual_seq_lengths_kv=self.kv_lens, block_table=self.block_table,
            block_size=self.block_size, num_heads=self.heads, num_key_value_heads=1,
            scale=0.07, input_layout="BSND", sparse_mode=3 if causal else 0)
        kwargs.update(overrides)
        return kwargs

    def expected(self, scale=0.07):
        """Plain MLA attention per batch in float32: the query's latent part against the
        latent rows plus its rope part against the rope rows, causal aligned to the end."""
        out = torch.zeros(len(self.q_lens), self.q_s, self.heads, LATENT)
        for b, (q_len, kv_len) in enumerate(zip(self.q_lens, self.kv_lens, strict=True)):
            q = self.query[b, :q_len].float().transpose(0, 1)          # [N, q, 512]
            q_rope = self.query_rope[b, :q_len].float().transpose(0, 1)
            k = self.latent[b].float()
            scores = scale * (q @ k.T + q_rope @ self.rope[b].float().T)
            visible = torch.arange(kv_len)[None, :] <= (
                torch.arange(q_len)[:, None] + kv_len - q_len)
            scores = scores.masked_fill(~visible, float("-inf"))
            out[b, :q_len] = (torch.softmax(scores, -1) @ k).transpose(0, 1)
        return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("q_lens", "kv_lens", "heads", "block_size"), [
    ([1, 1, 1], [5, 130, 300], 32, 128),          # decode, one token per batch
    ([4, 4], [4, 200], 64, 128),                  # verification of 3 drafts / a prefill
    ([16, 3, 9], [16, 140, 9], 128, 128),         # ragged, padded rows at the end
    ([2, 7], [40, 7], 32, 16),                    # block size 16
])
def test_mla_form_matches_plain_mla_attention(torch_npu, dtype, q_lens, kv_lens, heads,
                                              block_size):
    case = Case(torch_npu, q_lens, kv_lens, heads, dtype, block_size=block_size,
                num_blocks=sum(math.ceil(n / block_size) for n in kv_lens) + 2)
    out, lse = torch_npu.npu_fused_infer_attention_score(**case.kwargs())
    assert out.shape == case.query.shape and out.dtype == dtype
    assert lse.shape == (1,) and not lse.any()
    expected = case.expected()
    for b, q_len in enumerate(q_lens):
        torch.testing.assert_close(out[b, :q_len].float(), expected[b, :q_len],
                                   atol=TOL[dtype], rtol=TOL[dtype])
        assert not out[b, q_len:].any()  # padding rows


def test_mla_form_bsh_layout_equals_bsnd(torch_npu):
    case = Case(torch_npu, [3, 5], [10, 5], 32, torch.float16)
    bsnd, _ = torch_npu.npu_fused_infer_attention_score(**case.kwargs())
    bsh, _ = torch_npu.npu_fused_infer_attention_score(**case.kwargs(
        query=case.query.reshape(2, 5, -1), query_rope=case.query_rope.reshape(2, 5, -1),
        input_layout="BSH"))
    torch.testing.assert_close(bsh, bsnd.reshape(2, 5, -1))


def test_mla_form_rope_part_matters(torch_npu):
    """The rope rows take part in the scores: zeroing them changes the output."""
    case = Case(torch_npu, [1], [50], 32, torch.float16)
    with_rope, _ = torch_npu.npu_fused_infer_attention_score(**case.kwargs())
    zero_rope, _ = torch_npu.npu_fused_infer_attention_score(**case.kwargs(
        key_rope=torch.zeros_like(case.rope_cache)))
    assert (with_rope.float() - zero_rope.float()).abs().max() > 1e-2


@pytest.mark.parametrize(("overrides", "error", "match"), [
    ({"key_rope": None}, RuntimeError, "must be given together"),
    ({"num_heads": 16}, RuntimeError, r"query heads \[32, 64, 128\]"),
    ({"num_key_value_heads": 0}, RuntimeError, "num_key_value_heads=1"),
    ({"sparse_mode": 0, "atten_mask": None}, RuntimeError, "sparse_mode=3"),
    ({"atten_mask": None}, RuntimeError, "sparse_mode=3"),
    ({"block_size": 256}, RuntimeError, r"block_size=256; the MLA form takes \[16, 128\]"),
    ({"block_table": None}, RuntimeError, "needs page attention"),
    ({"softmax_lse_flag": True}, RuntimeError, "softmax_lse_flag"),
    ({"dequant_scale1": torch.zeros(1)}, NotImplementedError, "dequant_scale1"),
    ({"actual_seq_lengths_kv": [1, 200]}, RuntimeError, "exceeds actual_seq_lengths_kv"),
])
def test_mla_form_rejects_what_the_page_rules_out(torch_npu, overrides, error, match):
    case = Case(torch_npu, [2, 3], [9, 200], 32, torch.float16)
    with pytest.raises(error, match=match):
        torch_npu.npu_fused_infer_attention_score(**case.kwargs(**overrides))


def test_mla_form_rejects_bad_shapes(torch_npu):
    case = Case(torch_npu, [1], [9], 32, torch.float16)
    with pytest.raises(RuntimeError, match="Q_S=17"):
        big = Case(torch_npu, [17], [17], 32, torch.float16)
        torch_npu.npu_fused_infer_attention_score(**big.kwargs())
    with pytest.raises(RuntimeError, match="query D=256"):
        torch_npu.npu_fused_infer_attention_score(**case.kwargs(
            query=torch.zeros(1, 1, 32, 256, dtype=torch.float16)))
    with pytest.raises(RuntimeError, match="query D 128 with rope takes input_layout"):
        torch_npu.npu_fused_infer_attention_score(**case.kwargs(
            query=torch.zeros(1, 1, 32, 128, dtype=torch.float16)))
    with pytest.raises(RuntimeError, match="D, which is 64"):
        torch_npu.npu_fused_infer_attention_score(**case.kwargs(
            query_rope=torch.zeros(1, 1, 32, 32, dtype=torch.float16)))
    with pytest.raises(RuntimeError, match="key_rope has shape"):
        torch_npu.npu_fused_infer_attention_score(**case.kwargs(
            key_rope=torch.zeros(8, 128, 32, dtype=torch.float16)))
    with pytest.raises(RuntimeError, match="query_rope has dtype"):
        torch_npu.npu_fused_infer_attention_score(**case.kwargs(
            query_rope=case.query_rope.to(torch.bfloat16)))


def test_mla_form_tnd_equals_bsnd(torch_npu):
    """The same batches packed along T (cumulative query lengths, per-batch key lengths)
    give the BSND result row for row."""
    case = Case(torch_npu, [2, 3], [9, 200], 32, torch.float16, seed=5)
    bsnd, _ = torch_npu.npu_fused_infer_attention_score(**case.kwargs())
    query = torch.cat([case.query[0, :2], case.query[1, :3]])
    query_rope = torch.cat([case.query_rope[0, :2], case.query_rope[1, :3]])
    tnd, _ = torch_npu.npu_fused_infer_attention_score(**case.kwargs(
        query=query, query_rope=query_rope, input_layout="TND", actual_seq_lengths=[2, 5]))
    torch.testing.assert_close(tnd, torch.cat([bsnd[0, :2], bsnd[1, :3]]), atol=1e-3,
                               rtol=1e-3)
