"""FULL decode graphs of the npu attention backend on the reference torch_npu: a decode step
captured once in ``torch.npu.NPUGraph`` and replayed on new queries, sequence lengths, block
tables and slots gives what the same step computes eagerly, and plain attention.

Helpers (batches, vLLM's cache allocation, the expected attention) come from
test_attention_npu.py.
"""

from __future__ import annotations

import pytest
import torch
from test_attention_npu import TOL, Batch, _allocate_cache, _spec, torch_npu  # noqa: F401
from vllm.config import CUDAGraphMode, VllmConfig, set_current_vllm_config

from ascend_core.attention.npu_attention import (
    AscendAttentionImpl,
    AscendAttentionMetadataBuilder,
    graph_decode_attention,
)

HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 32


def _graph_config() -> VllmConfig:
    """A config with FULL decode graphs on, as the npu platform leaves it (this process's
    platform, the CPU one, turns graphs off while the config is built)."""
    config = VllmConfig()
    config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
    return config


@pytest.mark.parametrize("q_len", [1, 3])
def test_device_only_decode_attention_is_plain_attention(torch_npu, q_len):  # noqa: F811
    batch = Batch([q_len] * 3, [5, 130, 0], heads=HEADS, kv_heads=KV_HEADS,
                  head_size=HEAD_SIZE, dtype=torch.bfloat16, seed=3)
    impl = AscendAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS,
                               alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    kv_cache = _allocate_cache(_spec(KV_HEADS, HEAD_SIZE, torch.bfloat16))
    for key, value, slots in (batch.context_tokens(), batch.new_tokens()):
        impl.do_kv_cache_update(None, key, value, kv_cache, slots)
    key_cache, value_cache = impl._split_cache(kv_cache)
    out = graph_decode_attention(batch.query.view(3, q_len, HEADS, HEAD_SIZE), key_cache,
                                 value_cache, batch.block_table,
                                 torch.tensor(batch.seq_lens), KV_HEADS, HEAD_SIZE ** -0.5)
    torch.testing.assert_close(out.reshape(-1, HEADS, HEAD_SIZE),
                               batch.expected(HEAD_SIZE ** -0.5), atol=TOL[torch.bfloat16],
                               rtol=TOL[torch.bfloat16])


@torch.inference_mode()  # as vLLM runs the model
def test_captured_decode_step_replays_like_eager_on_new_inputs(torch_npu):  # noqa: F811
    """Static buffers as vLLM's runner keeps them (query, KV, seq lens, block table, slots
    for a padded batch of 4 requests); capture with one batch, replay with two others of 3
    real requests plus one padding request, against the eager step on the same inputs."""
    npu = torch.device("npu")
    dtype, padded = torch.bfloat16, 4
    spec = _spec(KV_HEADS, HEAD_SIZE, dtype)
    with set_current_vllm_config(_graph_config()):
        impl = AscendAttentionImpl(HEADS, HEAD_SIZE, HEAD_SIZE ** -0.5, KV_HEADS,
                                   alibi_slopes=None, sliding_window=None,
                                   kv_cache_dtype="auto")
    builder = AscendAttentionMetadataBuilder(spec, ["layer.0"], _graph_config(), npu)
    kv_cache = _allocate_cache(spec).to(npu)
    width = 4
    static = {
        "query": torch.zeros(padded, HEADS, HEAD_SIZE, dtype=dtype, device=npu),
        "key": torch.zeros(padded, KV_HEADS, HEAD_SIZE, dtype=dtype, device=npu),
        "value": torch.zeros(padded, KV_HEADS, HEAD_SIZE, dtype=dtype, device=npu),
        "seq_lens": torch.zeros(padded, dtype=torch.int32, device=npu),
        "block_table": torch.zeros(padded, width, dtype=torch.int32, device=npu),
        "slots": torch.full((padded,), -1, dtype=torch.int64, device=npu),
        "output": torch.zeros(padded, HEADS, HEAD_SIZE, dtype=dtype, device=npu),
    }

    def load(batch: Batch) -> None:
        """Fill the static buffers (outside the graph, as vLLM's input preparation)."""
        n = len(batch.query_lens)
        key, value, slots = batch.new_tokens()
        static["query"][:n].copy_(batch.query)
        static["key"][:n].copy_(key)
        static["value"][:n].copy_(value)
        static["seq_lens"].zero_()
        static["seq_lens"][:n].copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))
        static["block_table"].zero_()
        static["block_table"][:n, :batch.block_table.shape[1]].copy_(batch.block_table)
        static["slots"].fill_(-1)
        static["slots"][:n].copy_(slots)
        context_key, context_value, context_slots = batch.context_tokens()
        impl.do_kv_cache_update(None, context_key.to(npu), context_value.to(npu), kv_cache,
                                context_slots.to(npu))

    def metadata():
        starts = torch.arange(padded + 1, dtype=torch.int32)
        from vllm.v1.attention.backend import CommonAttentionMetadata

        common = CommonAttentionMetadata(
            query_start_loc=starts.to(npu), query_start_loc_cpu=starts,
            seq_lens=static["seq_lens"], num_reqs=padded, num_actual_tokens=padded,
            max_query_len=1, max_seq_len=width * 128,
            block_table_tensor=static["block_table"], slot_mapping=static["slots"])
        return builder.build(0, common)

    def step(meta) -> None:
        impl.do_kv_cache_update(None, static["key"], static["value"], kv_cache,
                                static["slots"])
        impl.forward(None, static["query"], static["key"], static["value"], kv_cache, meta,
                     output=static["output"])

    def batch(seed: int, context: list[int]) -> Batch:
        return Batch([1, 1, 1], context, heads=HEADS, kv_heads=KV_HEADS, head_size=HEAD_SIZE,
                     dtype=dtype, seed=seed)

    load(batch(10, [3, 140, 9]))
    meta = metadata()
    assert meta.graph_seq_lens is not None  # the device-only path, not the fused op
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        step(meta)
    for seed, context in ((11, [200, 0, 17]), (12, [1, 2, 300])):
        new = batch(seed, context)
        load(new)
        graph.replay()
        replayed = static["output"][:3].cpu().clone()
        step(metadata())  # eagerly, on the same inputs
        torch.testing.assert_close(replayed, static["output"][:3].cpu())
        torch.testing.assert_close(replayed.float(), new.expected(HEAD_SIZE ** -0.5),
                                   atol=TOL[dtype], rtol=TOL[dtype])
