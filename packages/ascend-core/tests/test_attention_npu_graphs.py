"""FULL decode graphs of the npu attention backend on the reference torch_npu: a decode step
(one token or 1 + k tokens per request) captured once -- the fused attention op in a graph
task group -- and replayed on new queries, sequence lengths, block tables and slots, its
task group updated from each step's metadata, gives what the same step computes eagerly,
and plain attention.

Helpers (batches, vLLM's cache allocation, the expected attention) come from
test_attention_npu.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_attention_npu import TOL, Batch, _allocate_cache, _spec, torch_npu  # noqa: F401
from vllm.config import CUDAGraphMode, VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context

from ascend_core.attention.npu_attention import (
    AscendAttentionImpl,
    AscendAttentionMetadataBuilder,
)
from ascend_core.attention.npu_graph_tasks import graph_cls_with_task_updates, task_counts

HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 32


def _graph_config() -> VllmConfig:
    """A config with FULL decode graphs on, as the npu platform leaves it (this process's
    platform, the CPU one, turns graphs off while the config is built)."""
    config = VllmConfig()
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    return config


LAYER = SimpleNamespace(layer_name="layer.0")


@pytest.mark.parametrize("q_len", [1, 3])
@torch.inference_mode()  # as vLLM runs the model
def test_captured_decode_step_replays_like_eager_on_new_inputs(torch_npu, q_len):  # noqa: F811
    """Static buffers as vLLM's runner keeps them (query, KV, seq lens, block table, slots
    for a padded batch of 4 requests of q_len tokens); capture with one batch, replay with
    two others of 3 real requests plus one padding request, against the eager step on the
    same inputs."""
    npu = torch.device("npu")
    dtype, padded = torch.bfloat16, 4
    tokens = padded * q_len
    spec = _spec(KV_HEADS, HEAD_SIZE, dtype)
    with set_current_vllm_config(_graph_config()):
        impl = AscendAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS,
                                   alibi_slopes=None, sliding_window=None,
                                   kv_cache_dtype="auto")
    builder = AscendAttentionMetadataBuilder(spec, ["layer.0"], _graph_config(), npu)
    # What a config with q_len - 1 speculative tokens gives (a SpeculativeConfig needs a
    # model to build).
    builder._decode_query_len = q_len
    kv_cache = _allocate_cache(spec).to(npu)
    width = 4
    static = {
        "query": torch.zeros(tokens, HEADS, HEAD_SIZE, dtype=dtype, device=npu),
        "key": torch.zeros(tokens, KV_HEADS, HEAD_SIZE, dtype=dtype, device=npu),
        "value": torch.zeros(tokens, KV_HEADS, HEAD_SIZE, dtype=dtype, device=npu),
        "seq_lens": torch.zeros(padded, dtype=torch.int32, device=npu),
        "block_table": torch.zeros(padded, width, dtype=torch.int32, device=npu),
        "slots": torch.full((tokens,), -1, dtype=torch.int64, device=npu),
        "output": torch.zeros(tokens, HEADS, HEAD_SIZE, dtype=dtype, device=npu),
    }

    def load(batch: Batch) -> int:
        """Fill the static buffers (outside the graph, as vLLM's input preparation)."""
        n = len(batch.query_lens)
        real = n * q_len
        key, value, slots = batch.new_tokens()
        static["query"][:real].copy_(batch.query)
        static["key"][:real].copy_(key)
        static["value"][:real].copy_(value)
        static["seq_lens"].zero_()
        static["seq_lens"][:n].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))
        static["block_table"].zero_()
        static["block_table"][:n, :batch.block_table.shape[1]].copy_(batch.block_table)
        static["slots"].fill_(-1)
        static["slots"][:real].copy_(slots)
        context_key, context_value, context_slots = batch.context_tokens()
        impl.do_kv_cache_update(None, context_key.to(npu), context_value.to(npu), kv_cache,
                                context_slots.to(npu))
        return real

    def metadata():
        starts = torch.arange(padded + 1, dtype=torch.int32) * q_len
        from vllm.v1.attention.backend import CommonAttentionMetadata

        common = CommonAttentionMetadata(
            query_start_loc=starts.to(npu), query_start_loc_cpu=starts,
            seq_lens=static["seq_lens"], num_reqs=padded, num_actual_tokens=tokens,
            max_query_len=q_len, max_seq_len=width * 128,
            block_table_tensor=static["block_table"], slot_mapping=static["slots"])
        return builder.build(0, common)

    def step(meta) -> None:
        impl.do_kv_cache_update(None, static["key"], static["value"], kv_cache,
                                static["slots"])
        impl.forward(LAYER, static["query"], static["key"], static["value"], kv_cache, meta,
                     output=static["output"])

    def batch(seed: int, context: list[int]) -> Batch:
        return Batch([q_len] * 3, context, heads=HEADS, kv_heads=KV_HEADS,
                     head_size=HEAD_SIZE, dtype=dtype, seed=seed)

    config = _graph_config()
    load(batch(10, [3, 140, 9]))
    meta = metadata()
    assert meta.graph_decode and meta.seq_lens[-1] == q_len  # padding request
    # A plain NPUGraph would freeze the fused op's lengths: capturing it there refuses.
    with pytest.raises(RuntimeError, match="outside an NPUGraphWithTaskUpdates capture"):
        with torch.npu.graph(torch.npu.NPUGraph()):
            step(meta)
    graph = graph_cls_with_task_updates()()
    with torch.npu.graph(graph):
        step(meta)
    assert "torch_npu.npu_fused_infer_attention_score.out" in graph.step_names()
    assert task_counts(graph) == (1, 0)
    for replay, (seed, context) in enumerate(((11, [200, 0, 17]), (12, [1, 2, 300])), 1):
        new = batch(seed, context)
        real = load(new)
        with set_forward_context({"layer.0": metadata()}, config):
            graph.replay()
        assert task_counts(graph) == (1, replay)  # one update of the group per replay
        replayed = static["output"][:real].cpu().clone()
        step(metadata())  # eagerly, on the same inputs
        torch.testing.assert_close(replayed, static["output"][:real].cpu(), rtol=0, atol=0)
        torch.testing.assert_close(replayed.float(), new.expected(HEAD_SIZE ** -0.5),
                                   atol=TOL[dtype], rtol=TOL[dtype])
    # Outside vLLM's forward context there is no metadata to update the lengths from.
    with pytest.raises(RuntimeError, match="outside vLLM's forward context"):
        graph.replay()


@torch.inference_mode()
def test_captured_mla_verification_step_replays_like_eager(torch_npu):  # noqa: F811
    """The MLA backend under FULL decode graphs: a step of 2 tokens per request (MTP with
    one draft) for 3 requests, one of them padding, captured once and replayed for two other
    batches; each replay against plain MLA and against the eager step."""
    from test_attention_npu_mla import LATENT, ROPE, make_impl
    from test_attention_npu_mla import TOL as MLA_TOL
    from test_attention_npu_mla import Batch as MLABatch

    from ascend_core.attention.npu_mla import AscendMLAMetadataBuilder

    npu, dtype, heads, q_len, padded, block, width = (torch.device("npu"), torch.bfloat16, 2,
                                                      2, 3, 128, 4)
    tokens = padded * q_len
    impl = make_impl(heads)
    impl.pad_slots_to_null_block = True  # what a FULL-graph config sets
    builder = AscendMLAMetadataBuilder.__new__(AscendMLAMetadataBuilder)
    builder.device, builder._causal_mask = npu, None
    builder._full_graphs, builder._decode_query_len = True, q_len
    kv_cache = torch.zeros(12, block, LATENT + ROPE, dtype=dtype, device=npu)
    static = {
        "q_latent": torch.zeros(tokens, heads, LATENT, dtype=dtype, device=npu),
        "q_pe": torch.zeros(tokens, heads, ROPE, dtype=dtype, device=npu),
        "latent": torch.zeros(tokens, LATENT, dtype=dtype, device=npu),
        "k_pe": torch.zeros(tokens, 1, ROPE, dtype=dtype, device=npu),
        "slots": torch.full((tokens,), -1, dtype=torch.int64, device=npu),
        "seq_lens": torch.zeros(padded, dtype=torch.int32, device=npu),
        "block_table": torch.zeros(padded, width, dtype=torch.int32, device=npu),
    }
    starts = torch.arange(padded + 1, dtype=torch.int32) * q_len

    def load(seed: int, context: list[int]) -> MLABatch:
        batch = MLABatch([q_len] * 2, context, heads, dtype, block, seed=seed)
        batch.block_table += 1  # block 0 is vLLM's null block, where padding writes
        real = 2 * q_len
        latent, k_pe, slots = batch.rows("new")
        static["q_latent"][:real].copy_(torch.einsum("tnk,nkl->tnl", batch.q_nope, batch.w_uk))
        static["q_pe"][:real].copy_(batch.q_pe)
        static["latent"][:real].copy_(latent)
        static["k_pe"][:real].copy_(k_pe)
        static["slots"].fill_(-1)
        static["slots"][:real].copy_(slots)
        static["seq_lens"].zero_()
        static["seq_lens"][:2].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))
        static["block_table"].zero_()
        static["block_table"][:2, :batch.block_table.shape[1]].copy_(batch.block_table)
        latent, k_pe, slots = batch.rows("context")
        impl.do_kv_cache_update(latent.to(npu), k_pe.to(npu), kv_cache, slots.to(npu),
                                "auto", None)
        return batch

    def metadata():
        decode = builder._build_decode(
            block_table_tensor=static["block_table"], seq_lens_device=static["seq_lens"],
            max_seq_len=width * block, query_start_loc_cpu=starts,
            query_start_loc_device=starts.to(npu), num_decode_tokens=tokens,
            max_query_len=q_len, dcp_tot_seq_lens_device=None)
        return SimpleNamespace(decode=decode)

    def step(meta) -> torch.Tensor:
        impl.do_kv_cache_update(static["latent"], static["k_pe"], kv_cache, static["slots"],
                                "auto", None)
        out, _ = impl.forward_mqa((static["q_latent"], static["q_pe"]), kv_cache, meta,
                                  LAYER)
        return out

    load(20, [5, 140])
    meta = metadata()
    assert meta.decode.graph_decode and meta.decode.row_kv_lens[-1] == q_len  # padding
    graph = graph_cls_with_task_updates()()
    with torch.npu.graph(graph):
        captured_out = step(meta)
    assert "torch_npu.npu_fused_infer_attention_score.out" in graph.step_names()
    for replay, (seed, context) in enumerate(((21, [300, 0]), (22, [17, 250])), 1):
        batch = load(seed, context)
        with set_forward_context({"layer.0": metadata()}, _graph_config()):
            graph.replay()
        assert task_counts(graph) == (1, replay)
        replayed = captured_out[:2 * q_len].cpu().clone()
        eager = step(metadata())[:2 * q_len].cpu()
        torch.testing.assert_close(replayed, eager, rtol=0, atol=0)
        up = torch.einsum("tnl,nlv->tnv", replayed.float(), batch.w_uv.float())
        torch.testing.assert_close(up, batch.expected(impl.scale), atol=MLA_TOL[dtype],
                                   rtol=MLA_TOL[dtype])


@pytest.mark.parametrize("backend", ["dense", "mla"])
@torch.inference_mode()
def test_padding_beyond_one_block_writes_no_request_block(torch_npu, backend):  # noqa: F811
    """Under a FULL-graph config, padding token i (slot -1) of a captured batch writes slot i
    of the null block. A batch of more than one block of tokens is never captured (it runs
    eagerly, e.g. a draft model's step with requests past max_model_len): there slot i would
    be in a request's block, so its padding tokens must write nothing."""
    npu, dtype = torch.device("npu"), torch.bfloat16
    if backend == "dense":
        spec = _spec(KV_HEADS, HEAD_SIZE, dtype)
        with set_current_vllm_config(_graph_config()):
            impl = AscendAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS,
                                       alibi_slopes=None, sliding_window=None,
                                       kv_cache_dtype="auto")
        assert impl.pad_slots_to_null_block  # set from the FULL-graph config
        kv_cache = _allocate_cache(spec).to(npu)
        block = kv_cache.shape[2]
        width = KV_HEADS * HEAD_SIZE
    else:
        from test_attention_npu_mla import LATENT, ROPE, make_impl

        impl = make_impl(2)
        block, width = 16, LATENT + ROPE
        kv_cache = torch.zeros(4, block, width, dtype=dtype, device=npu)
    impl.pad_slots_to_null_block = True  # what a FULL-graph config sets
    tokens = block + 4
    # Real tokens write block 2; token `block + 1` (would be slot block + 1, in block 1) and
    # token 0 are padding.
    slots = torch.arange(2 * block, 2 * block + tokens, dtype=torch.int64)
    slots[[0, block + 1]] = -1
    generator = torch.Generator().manual_seed(0)
    if backend == "dense":
        key = torch.randn(tokens, KV_HEADS, HEAD_SIZE, generator=generator).to(dtype)
        value = torch.randn(tokens, KV_HEADS, HEAD_SIZE, generator=generator).to(dtype)
        impl.do_kv_cache_update(LAYER, key.to(npu), value.to(npu), kv_cache,
                                slots.to(npu))
        pages = kv_cache.cpu()  # [num_blocks, 2, block, width]
        written = [pages[:, 0].reshape(-1, width), pages[:, 1].reshape(-1, width)]
        sources = [key.reshape(tokens, width), value.reshape(tokens, width)]
    else:
        latent = torch.randn(tokens, LATENT, generator=generator).to(dtype)
        k_pe = torch.randn(tokens, 1, ROPE, generator=generator).to(dtype)
        impl.do_kv_cache_update(latent.to(npu), k_pe.to(npu), kv_cache, slots.to(npu),
                                "auto", None)
        latent_cache, rope_cache = (t.cpu() for t in impl.split_cache(kv_cache))
        written = [latent_cache.reshape(-1, LATENT), rope_cache.reshape(-1, ROPE)]
        sources = [latent, k_pe.reshape(tokens, ROPE)]
    real = slots >= 0
    for cache_rows, source in zip(written, sources, strict=True):
        # Blocks 0 and 1 (the null block, and the block slot block + 1 lies in) untouched.
        assert not cache_rows[: 2 * block].any()
        assert torch.equal(cache_rows[slots[real]], source[real])
