"""The npu MLA backend on the reference torch_npu, against plain (non-absorbed) torch MLA.

Each case draws per-request latent rows ``c`` (512) and rope keys ``k_pe`` (64), per-head
up-projections ``W_UK`` / ``W_UV`` and queries ``(q_nope, q_pe)``; writes the earlier steps'
context and this step's tokens into the layer's pages with ``do_kv_cache_update``; builds the
metadata with the backend's builder from vLLM-style query starts, sequence lengths and a
shuffled block table; and runs ``forward_mqa`` on the absorbed query ``q_nope @ W_UK`` as
vLLM's ``MLAAttention`` does, then ``@ W_UV``. The expectation is MLA written out: keys
``[c @ W_UK^T, k_pe]``, values ``c @ W_UV``, causal softmax attention per request aligned
to the end of its keys. The dense-prefill cases run prefills through ``forward_mha`` (the
fused op's dense TND form) and compare them with the absorbed path and with that expectation.
"""

from __future__ import annotations

import importlib
import math
from types import SimpleNamespace

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig

from ascend_core.attention import ASCEND_MLA_BACKEND
from ascend_core.attention.npu_mla import (
    AscendMLABackend,
    AscendMLADecodeMetadata,
    AscendMLAImpl,
    AscendMLAMetadataBuilder,
    AscendMLAPrefillMetadata,
    dense_head_count,
    dense_prefill_supported,
    padded_head_count,
    plan_dense_prefill,
    plan_rows,
)

from npu_reference import reference_on_path

LATENT, ROPE, NOPE, V_DIM = 512, 64, 32, 32
TOL = {torch.float16: 3e-3, torch.bfloat16: 3e-2}


@pytest.fixture(scope="module")
def torch_npu():
    with reference_on_path(forget=["ascend_core.platform.npu"]):
        yield importlib.import_module("torch_npu")


def make_impl(num_heads, kv_lora_rank=LATENT, rope=ROPE, **overrides):
    args = dict(num_heads=num_heads, head_size=kv_lora_rank + rope, scale=0.1,
                num_kv_heads=1, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto", logits_soft_cap=None, attn_type="decoder",
                kv_sharing_target_layer_name=None, q_lora_rank=None,
                kv_lora_rank=kv_lora_rank, qk_nope_head_dim=NOPE, qk_rope_head_dim=rope,
                qk_head_dim=NOPE + rope, v_head_dim=V_DIM, kv_b_proj=None)
    args.update(overrides)
    with set_current_vllm_config(VllmConfig()):
        return AscendMLAImpl(**args)


def decode_metadata(query_lens, seq_lens, block_table) -> AscendMLADecodeMetadata:
    """The backend builder's decode half, on the batch's host tensors (what vLLM's common
    ``build`` hands it when every request is a decode, as this backend asks)."""
    builder = AscendMLAMetadataBuilder.__new__(AscendMLAMetadataBuilder)
    builder.device = torch.device("cpu")
    builder._causal_mask = None
    builder._full_graphs, builder._decode_query_len = False, 1  # eager, no speculation
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return builder._build_decode(
        block_table_tensor=block_table, seq_lens_device=torch.tensor(seq_lens),
        max_seq_len=max(seq_lens), query_start_loc_cpu=starts, query_start_loc_device=starts,
        num_decode_tokens=int(starts[-1]), max_query_len=max(query_lens),
        dcp_tot_seq_lens_device=None)


class Batch:
    def __init__(self, query_lens, context_lens, heads, dtype, block_size, seed=0,
                 nope=NOPE, v_dim=V_DIM):
        gen = torch.Generator().manual_seed(seed)
        self.query_lens, self.context_lens = query_lens, context_lens
        self.nope, self.v_dim = nope, v_dim
        self.seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        self.heads, self.dtype, self.block_size = heads, dtype, block_size

        def randn(*shape, std=1.0):
            return (torch.randn(*shape, generator=gen) * std).to(dtype)

        self.latent = [randn(n, LATENT) for n in self.seq_lens]
        self.k_pe = [randn(n, ROPE) for n in self.seq_lens]
        self.w_uk = randn(heads, nope, LATENT, std=LATENT ** -0.5)
        self.w_uv = randn(heads, LATENT, v_dim, std=LATENT ** -0.5)
        tokens = sum(query_lens)
        self.q_nope = randn(tokens, heads, nope)
        self.q_pe = randn(tokens, heads, ROPE)
        counts = [math.ceil(n / block_size) for n in self.seq_lens]
        self.num_blocks = sum(counts) + 3
        order = torch.randperm(self.num_blocks, generator=gen)
        self.block_table = torch.zeros(len(query_lens), max(counts) + 1, dtype=torch.int32)
        used = 0
        for req, count in enumerate(counts):
            self.block_table[req, :count] = order[used:used + count].int()
            used += count

    def rows(self, which):
        latent, k_pe, slots = [], [], []
        for req, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            span = range(c) if which == "context" else range(c, c + q)
            latent.append(self.latent[req][span.start:span.stop])
            k_pe.append(self.k_pe[req][span.start:span.stop])
            table = self.block_table[req]
            slots += [int(table[p // self.block_size]) * self.block_size
                      + p % self.block_size for p in span]
        return torch.cat(latent), torch.cat(k_pe).unsqueeze(1), torch.tensor(slots)

    def expected(self, scale):
        out, start = [], 0
        for req, q_len in enumerate(self.query_lens):
            c = self.latent[req].float()
            keys = torch.cat([torch.einsum("sl,nkl->snk", c, self.w_uk.float()),
                              self.k_pe[req].float()[:, None].expand(-1, self.heads, -1)], -1)
            values = torch.einsum("sl,nlv->snv", c, self.w_uv.float())
            q = torch.cat([self.q_nope[start:start + q_len], self.q_pe[start:start + q_len]],
                          -1).float()
            scores = scale * torch.einsum("qnd,knd->nqk", q, keys)
            kv_len = self.seq_lens[req]
            visible = torch.arange(kv_len)[None] <= torch.arange(q_len)[:, None] + kv_len - q_len
            probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
            out.append(torch.einsum("nqk,knv->qnv", probs, values))
            start += q_len
        return torch.cat(out)


def run_backend(impl, batch):
    kv_cache = torch.full((batch.num_blocks, batch.block_size, LATENT + ROPE), float("nan"),
                          dtype=batch.dtype)
    for which in ("context", "new"):
        latent, k_pe, slots = batch.rows(which)
        if slots.numel():
            impl.do_kv_cache_update(latent, k_pe, kv_cache, slots, "auto", None)
    meta = decode_metadata(batch.query_lens, batch.seq_lens, batch.block_table)
    attn_metadata = type("Meta", (), {"decode": meta})()
    q_latent = torch.einsum("tnk,nkl->tnl", batch.q_nope, batch.w_uk)
    out, lse = impl.forward_mqa((q_latent, batch.q_pe), kv_cache, attn_metadata, None)
    assert lse is None and out.shape == (sum(batch.query_lens), batch.heads, LATENT)
    return torch.einsum("tnl,nlv->tnv", out.float(), batch.w_uv.float()), meta


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("query_lens", "context_lens", "heads", "block_size"), [
    ([20, 7], [0, 0], 2, 128),             # prefill; 20 tokens become rows of 16 and 4
    ([1, 1, 1], [5, 130, 260], 2, 128),    # decode
    ([1, 4, 19, 3], [30, 10, 0, 140], 40, 128),  # mixed: decode, verification, prefill,
    ([9, 1], [23, 40], 2, 16),                   # chunked prefill; block size 16
])
def test_forward_matches_plain_mla(torch_npu, dtype, query_lens, context_lens, heads,
                                   block_size):
    impl = make_impl(heads)
    batch = Batch(query_lens, context_lens, heads, dtype, block_size)
    out, meta = run_backend(impl, batch)
    assert meta.row_len <= 16 and sum(meta.row_query_lens) == sum(query_lens)
    torch.testing.assert_close(out, batch.expected(impl.scale), atol=TOL[dtype],
                               rtol=TOL[dtype])


# --- prefills as dense MHA (the fused op's dense TND form) ------------------------------------


def dense_impl(batch: Batch) -> AscendMLAImpl:
    """An impl whose ``kv_b_proj`` up-projects latent rows into each head's ``[k_nope, v]``
    with the batch's ``W_UK`` / ``W_UV`` (in the batch's dtype, as the model's layer)."""
    weight = torch.cat([batch.w_uk, batch.w_uv.transpose(1, 2)], dim=1).reshape(-1, LATENT)
    return make_impl(batch.heads, qk_nope_head_dim=batch.nope, qk_head_dim=batch.nope + ROPE,
                     v_head_dim=batch.v_dim, kv_b_proj=lambda x: (x @ weight.T, None))


def prefill_metadata(query_lens, seq_lens, block_table, block_size) -> AscendMLAPrefillMetadata:
    """The backend builder's dense-prefill half (what ``build`` adds for vLLM's prefills)."""
    builder = AscendMLAMetadataBuilder.__new__(AscendMLAMetadataBuilder)
    builder.device = torch.device("cpu")
    builder._causal_mask = None
    builder.kv_cache_spec = SimpleNamespace(block_size=block_size)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    return builder._build_dense_prefill(SimpleNamespace(query_start_loc=starts), query_lens,
                                        seq_lens, block_table)


def run_split(impl, batch, num_decodes):
    """vLLM's MLA forward with the batch split as its builder splits it: the first
    ``num_decodes`` requests through ``forward_mqa`` (absorbed), the rest through
    ``forward_mha`` (dense); returns ``[tokens, heads, v_dim]``."""
    kv_cache = torch.full((batch.num_blocks, batch.block_size, LATENT + ROPE), float("nan"),
                          dtype=batch.dtype)
    latent, k_pe, slots = batch.rows("context")
    if slots.numel():
        impl.do_kv_cache_update(latent, k_pe, kv_cache, slots, "auto", None)
    latent, k_pe, slots = batch.rows("new")
    impl.do_kv_cache_update(latent, k_pe, kv_cache, slots, "auto", None)
    split = sum(batch.query_lens[:num_decodes])
    decode = prefill = None
    if num_decodes:
        decode = decode_metadata(batch.query_lens[:num_decodes], batch.seq_lens[:num_decodes],
                                 batch.block_table[:num_decodes])
    prefill = prefill_metadata(batch.query_lens[num_decodes:], batch.seq_lens[num_decodes:],
                               batch.block_table[num_decodes:], batch.block_size)
    attn_metadata = SimpleNamespace(decode=decode, prefill=prefill)
    out = torch.empty(sum(batch.query_lens), batch.heads, batch.v_dim)
    if num_decodes:
        q_latent = torch.einsum("tnk,nkl->tnl", batch.q_nope[:split], batch.w_uk)
        latent_out, _ = impl.forward_mqa((q_latent, batch.q_pe[:split]), kv_cache,
                                         attn_metadata, None)
        out[:split] = torch.einsum("tnl,nlv->tnv", latent_out.float(), batch.w_uv.float())
    q = torch.cat([batch.q_nope[split:], batch.q_pe[split:]], dim=-1)
    dense = torch.empty(q.shape[0], batch.heads * batch.v_dim, dtype=batch.dtype)
    impl.forward_mha(q, latent[split:], k_pe[split:], kv_cache, attn_metadata, None, dense)
    out[split:] = dense.view(-1, batch.heads, batch.v_dim).float()
    return out


@pytest.fixture
def layouts(torch_npu, monkeypatch):
    """The ``input_layout`` of every fused-attention call, in order."""
    calls, fused = [], torch_npu.npu_fused_infer_attention_score

    def recording(*args, **kwargs):
        calls.append(kwargs["input_layout"])
        return fused(*args, **kwargs)

    monkeypatch.setattr(torch_npu, "npu_fused_infer_attention_score", recording)
    return calls


@pytest.mark.parametrize(("query_lens", "context_lens", "heads", "dims", "block_size",
                          "num_decodes"), [
    ([5, 33, 130], [0, 0, 0], 2, (NOPE, V_DIM), 128, 0),      # prompts of several lengths
    ([9, 24], [0, 0], 128, (128, 128), 128, 0),               # DeepSeek's heads, no padding
    ([9, 20], [23, 140], 2, (NOPE, V_DIM), 16, 0),            # chunked prefill on context
    ([1, 1, 19, 7], [30, 140, 0, 50], 40, (NOPE, V_DIM), 128, 2),  # decodes and prefills
    ([4, 4, 12], [10, 3, 17], 4, (64, 128), 16, 2),           # verification + cached prefill
])
def test_dense_prefill_equals_the_absorbed_path(layouts, query_lens, context_lens, heads,
                                                dims, block_size, num_decodes):
    nope, v_dim = dims
    batch = Batch(query_lens, context_lens, heads, torch.bfloat16, block_size, nope=nope,
                  v_dim=v_dim)
    impl = dense_impl(batch)
    dense = run_split(impl, batch, num_decodes)
    # One absorbed call for the decodes (if any), then one dense TND call for all prefills.
    assert layouts == ["BSND"] * bool(num_decodes) + ["TND"]
    absorbed, _ = run_backend(impl, batch)  # every token in the latent path
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(dense, absorbed, atol=tol, rtol=tol)
    torch.testing.assert_close(dense, batch.expected(impl.scale), atol=tol, rtol=tol)


def test_dense_prefill_plan_gathers_each_context_before_its_new_tokens():
    block_table = torch.tensor([[7, 2, 0], [5, 0, 0], [3, 9, 4]], dtype=torch.int32)
    cumulative_q, cumulative_kv, slots, order = plan_dense_prefill(
        [2, 3, 1], [5, 3, 18], block_table, block_size=16)
    assert cumulative_q == [2, 5, 6] and cumulative_kv == [5, 8, 26]
    # Contexts: request 0 positions 0-2 (block 7), request 2 positions 0-16 (blocks 3, 9).
    assert slots.tolist() == [7 * 16 + p for p in range(3)] + [
        3 * 16 + p for p in range(16)] + [9 * 16]
    context = 3 + 17
    assert order.tolist() == [0, 1, 2, context, context + 1,             # request 0
                              context + 2, context + 3, context + 4,      # request 1 (new)
                              *range(3, 20), context + 5]                 # request 2
    assert plan_dense_prefill([4, 2], [4, 2], block_table[:2], 16)[2:] == (None, None)


def test_dense_prefill_takes_bfloat16_with_heads_up_to_128():
    assert dense_prefill_supported(torch.bfloat16, 128, 128)
    assert dense_prefill_supported(torch.bfloat16, 32, 32)
    assert not dense_prefill_supported(torch.float16, 128, 128)
    assert not dense_prefill_supported(torch.bfloat16, 192, 128)
    assert not dense_prefill_supported(torch.bfloat16, 128, 256)
    assert [dense_head_count(n) for n in (1, 2, 3, 40, 128)] == [2, 2, 4, 64, 128]


def test_dense_prefill_refuses_graph_capture(torch_npu, monkeypatch):
    batch = Batch([6], [0], 2, torch.bfloat16, 16)
    impl = dense_impl(batch)
    monkeypatch.setattr(torch.npu, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="capturing an MLA prefill"):
        run_split(impl, batch, 0)


def test_rows_cut_each_request_into_pieces_of_at_most_16():
    request, q, kv, width, token_rows = plan_rows([1, 35, 4], [11, 35, 20])
    assert request == [0, 1, 1, 1, 2]
    assert q == [1, 16, 16, 3, 4]
    assert kv == [11, 16, 32, 35, 20]
    assert width == 16 and len(token_rows) == 1 + 35 + 4
    assert token_rows[:3] == [0, 16, 17] and token_rows[-1] == 4 * 16 + 3
    with pytest.raises(ValueError, match="at least the query length"):
        plan_rows([5], [4])


def test_heads_are_padded_to_what_the_op_takes():
    assert [padded_head_count(n) for n in (1, 32, 33, 64, 100, 128)] == [32, 32, 64, 64,
                                                                          128, 128]
    with pytest.raises(ValueError, match="at most 128 query heads.*has 129"):
        padded_head_count(129)


def test_padding_slots_write_nothing(torch_npu):
    impl = make_impl(2)
    kv_cache = torch.zeros(2, 16, LATENT + ROPE, dtype=torch.float16)
    latent = torch.ones(3, LATENT, dtype=torch.float16)
    k_pe = torch.ones(3, 1, ROPE, dtype=torch.float16) * 2
    impl.do_kv_cache_update(latent, k_pe, kv_cache, torch.tensor([5, -1, 17]), "auto", None)
    latent_plane, rope_plane = impl.split_cache(kv_cache)
    assert latent_plane.view(-1, LATENT).sum(1).nonzero().flatten().tolist() == [5, 17]
    assert rope_plane.view(-1, ROPE).sum(1).nonzero().flatten().tolist() == [5, 17]
    assert latent_plane.is_contiguous() and rope_plane.is_contiguous()


# --- selection and bad input --------------------------------------------------------------


def test_npu_platform_selects_the_mla_backend(torch_npu):
    npu = importlib.import_module("ascend_core.platform.npu")
    config = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16,
                                     kv_cache_dtype="auto", block_size=128, use_mla=True)
    path = npu.AscendPlatform.get_attn_backend_cls(None, config)
    assert path == ASCEND_MLA_BACKEND
    assert resolve_obj_by_qualname(path) is AscendMLABackend
    assert AttentionBackendEnum[AscendMLABackend.get_name()].get_path() == path
    prefill = npu.AscendPlatform.get_mla_prefill_backend_cls(None)
    with pytest.raises(NotImplementedError, match="prefills run inside the Ascend MLA"):
        prefill(num_heads=2, scale=1.0, kv_lora_rank=512, qk_nope_head_dim=32,
                qk_rope_head_dim=64, v_head_dim=32, vllm_config=None
                ).run_prefill_new_tokens(None, None, None, False)


@pytest.mark.parametrize(("changes", "match"), [
    ({"head_size": 320}, "head_size not supported.*512 \\+ 64"),
    ({"block_size": 24}, "block_size not supported"),
    ({"dtype": torch.float32}, "dtype not supported"),
])
def test_npu_platform_refuses_mla_shapes_it_does_not_model(torch_npu, changes, match):
    npu = importlib.import_module("ascend_core.platform.npu")
    config = AttentionSelectorConfig(head_size=576, dtype=torch.bfloat16,
                                     kv_cache_dtype="auto", block_size=128,
                                     use_mla=True)._replace(**changes)
    with pytest.raises(ValueError, match=match):
        npu.AscendPlatform.get_attn_backend_cls(None, config)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"kv_lora_rank": 256}, ValueError, "kv_lora_rank=512.*this model has kv_lora_rank=256"),
    ({"rope": 32}, ValueError, "qk_rope_head_dim=32"),
    ({"num_heads": 256}, ValueError, "at most 128 query heads"),
    ({"sliding_window": 64}, NotImplementedError, "sliding_window"),
    ({"kv_cache_dtype": "fp8"}, NotImplementedError, "kv_cache_dtype='fp8'"),
])
def test_impl_refuses_what_it_does_not_model(kwargs, error, match):
    heads = kwargs.pop("num_heads", 2)
    with pytest.raises(error, match=match):
        make_impl(heads, **kwargs)
