"""The npu attention backend on the reference torch_npu, against plain torch attention.

Each case builds vLLM's ``CommonAttentionMetadata`` by hand (query start locations,
sequence lengths, a shuffled block table, the slot mapping), allocates the KV cache through
vLLM's own layout code (``create_kv_cache_views`` with the backend's spec and layout),
writes earlier steps' context and this step's keys/values with ``do_kv_cache_update`` and
compares ``forward`` with ``scaled_dot_product_attention`` over each request's unpaged keys
and values. The reference (``testing/reference_torch_npu``) is first on ``sys.path`` for
this module only.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from vllm.config import VllmConfig
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.selector import AttentionSelectorConfig
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)

from ascend_core.attention import ASCEND_ATTN_BACKEND
from ascend_core.attention.npu_attention import (
    AscendAttentionBackend,
    AscendAttentionImpl,
    AscendAttentionMetadataBuilder,
)

from npu_reference import reference_on_path

TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
BLOCK_SIZE = 128
NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def torch_npu():
    with reference_on_path(forget=["ascend_core.platform.npu"]):
        yield importlib.import_module("torch_npu")


def _spec(kv_heads, head_size, dtype, block_size=BLOCK_SIZE):
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads,
                             head_size=head_size, dtype=dtype)
    return AscendAttentionBackend.customize_spec(spec)


def _allocate_cache(spec, num_blocks=NUM_BLOCKS, layout=KVCacheLayout.LHBNC):
    """One layer's cache as vLLM's generic allocation lays it out for the backend."""
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, 1, layout)
    size = spec.page_size_bytes * num_blocks
    tensor = KVCacheTensor(size=size, layers=["layer.0"], layer_stride=layer_stride,
                           block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    (view,) = create_kv_cache_views(raw, spec, num_blocks, layout, tensor)
    return view


class Batch:
    """Requests with ``context`` cached tokens and ``query`` new ones each, their keys and
    values, a shuffled block table and the metadata vLLM would hand the builder."""

    def __init__(self, query_lens, context_lens, heads, kv_heads, head_size, dtype, seed,
                 block_size=BLOCK_SIZE):
        gen = torch.Generator().manual_seed(seed)
        self.block_size = block_size
        self.query_lens, self.context_lens = query_lens, context_lens
        self.seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
        self.heads, self.kv_heads, self.head_size, self.dtype = heads, kv_heads, head_size, dtype

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(dtype)

        self.keys = [randn(n, kv_heads, head_size) for n in self.seq_lens]
        self.values = [randn(n, kv_heads, head_size) for n in self.seq_lens]
        self.query = randn(sum(query_lens), heads, head_size)
        counts = [math.ceil(n / block_size) for n in self.seq_lens]
        order = torch.randperm(NUM_BLOCKS, generator=gen)
        # One column more than needed, as vLLM's table is max_num_blocks_per_req wide.
        self.block_table = torch.zeros(len(query_lens), max(counts) + 1, dtype=torch.int32)
        used = 0
        for req, count in enumerate(counts):
            self.block_table[req, :count] = order[used:used + count].int()
            used += count

    def slots(self, req, positions):
        table = self.block_table[req]
        size = self.block_size
        return [int(table[p // size]) * size + p % size for p in positions]

    def new_tokens(self):
        """This step's (keys, values, slot_mapping) in request order."""
        keys, values, slots = [], [], []
        for req, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            keys.append(self.keys[req][c:c + q])
            values.append(self.values[req][c:c + q])
            slots += self.slots(req, range(c, c + q))
        return torch.cat(keys), torch.cat(values), torch.tensor(slots, dtype=torch.int64)

    def context_tokens(self):
        keys, values, slots = [], [], []
        for req, c in enumerate(self.context_lens):
            keys.append(self.keys[req][:c])
            values.append(self.values[req][:c])
            slots += self.slots(req, range(c))
        return torch.cat(keys), torch.cat(values), torch.tensor(slots, dtype=torch.int64)

    def common_metadata(self, causal=True):
        starts = torch.tensor([0, *torch.tensor(self.query_lens).cumsum(0).tolist()],
                              dtype=torch.int32)
        _, _, slots = self.new_tokens()
        return CommonAttentionMetadata(
            query_start_loc=starts,
            query_start_loc_cpu=starts.clone(),
            seq_lens=torch.tensor(self.seq_lens, dtype=torch.int32),
            num_reqs=len(self.query_lens),
            num_actual_tokens=int(starts[-1]),
            max_query_len=max(self.query_lens),
            max_seq_len=max(self.seq_lens),
            block_table_tensor=self.block_table,
            slot_mapping=slots,
            causal=causal,
        )

    def expected(self, scale):
        """Plain causal attention: new token i of a request sees its first c + i + 1 keys."""
        outputs = []
        group = self.heads // self.kv_heads
        start = 0
        for req, (q, c) in enumerate(zip(self.query_lens, self.context_lens, strict=True)):
            query = self.query[start:start + q].float().transpose(0, 1)
            keys = self.keys[req].float().repeat_interleave(group, 1).transpose(0, 1)
            values = self.values[req].float().repeat_interleave(group, 1).transpose(0, 1)
            mask = torch.arange(c + q).unsqueeze(0) <= torch.arange(q).unsqueeze(1) + c
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask,
                                                 scale=scale)
            outputs.append(out.transpose(0, 1))
            start += q
        return torch.cat(outputs)


def _config(layout=None) -> VllmConfig:
    config = VllmConfig()
    config.cache_config.kv_cache_layout = None if layout is None else layout.name
    return config


def _run(batch, kv_cache=None, layout=KVCacheLayout.LHBNC):
    spec = _spec(batch.kv_heads, batch.head_size, batch.dtype, batch.block_size)
    kv_cache = _allocate_cache(spec, layout=layout) if kv_cache is None else kv_cache
    scale = batch.head_size ** -0.5
    impl = AscendAttentionImpl(batch.heads, batch.head_size, scale, batch.kv_heads,
                               alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    builder = AscendAttentionMetadataBuilder(spec, ["layer.0"], _config(layout),
                                             torch.device("cpu"))
    if sum(batch.context_lens):   # what earlier steps left in the cache
        context_key, context_value, context_slots = batch.context_tokens()
        impl.do_kv_cache_update(None, context_key, context_value, kv_cache, context_slots)
    metadata = builder.build(0, batch.common_metadata())
    key, value, slots = batch.new_tokens()
    impl.do_kv_cache_update(None, key, value, kv_cache, slots)
    output = torch.full_like(batch.query, float("nan"))
    returned = impl.forward(None, batch.query, key, value, kv_cache, metadata, output=output)
    assert returned is output
    return output, metadata, scale


def _check(batch, output, scale):
    torch.testing.assert_close(output.float(), batch.expected(scale), atol=TOL[batch.dtype],
                               rtol=TOL[batch.dtype])


# --- the four kinds of batch, one path ----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_of_ragged_prompts(torch_npu, dtype):
    batch = Batch([7, 200, 1, 33], [0, 0, 0, 0], heads=4, kv_heads=2, head_size=64,
                  dtype=dtype, seed=1)
    output, metadata, scale = _run(batch)
    assert metadata.padded_rows is not None and metadata.sparse_mode == 3
    _check(batch, output, scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_over_a_shuffled_paged_cache(torch_npu, dtype):
    batch = Batch([1, 1, 1], [5, 260, 128], heads=8, kv_heads=1, head_size=32, dtype=dtype,
                  seed=2)
    output, metadata, scale = _run(batch)
    # One query token each: the op's incremental branch, no mask, no padding.
    assert metadata.padded_rows is None and metadata.attn_mask is None
    assert metadata.sparse_mode == 0 and metadata.seq_lens == [6, 261, 129]
    _check(batch, output, scale)


def test_chunked_prefill_on_cached_context_mixed_with_decodes(torch_npu):
    batch = Batch([1, 100, 3, 1], [40, 150, 0, 255], heads=4, kv_heads=4, head_size=48,
                  dtype=torch.float16, seed=3)
    output, metadata, scale = _run(batch)
    assert metadata.query_lens == [1, 100, 3, 1] and metadata.max_query_len == 100
    _check(batch, output, scale)


@pytest.mark.parametrize("drafts", [1, 3])
def test_speculative_verification_of_k_plus_one_tokens(torch_npu, drafts):
    batch = Batch([drafts + 1] * 3, [9, 127, 300], heads=4, kv_heads=2, head_size=32,
                  dtype=torch.bfloat16, seed=4 + drafts)
    output, metadata, scale = _run(batch)
    assert metadata.padded_rows is None and metadata.sparse_mode == 3
    _check(batch, output, scale)


@pytest.mark.parametrize(("layout", "block_size", "kernel_rows"), [
    (KVCacheLayout.LBHNC, 128, 1),    # block-compact, as hybrid models need: rows 2b
    (KVCacheLayout.LBHNC, 640, 5),    # a hybrid model's large block: 5 rows of 128 each
    (KVCacheLayout.LHBNC, 1024, 2),   # a large block in the default layout: 2 rows of 512
])
def test_blocks_read_as_rows_of_the_ops_block_size(torch_npu, layout, block_size,
                                                   kernel_rows):
    batch = Batch([1, 90, 3, 1], [40, 300, 0, 500], heads=4, kv_heads=2, head_size=32,
                  dtype=torch.float16, seed=10, block_size=block_size)
    output, metadata, scale = _run(batch, layout=layout)
    tiling = metadata.tiling
    assert (tiling.row_stride, tiling.rows_per_block) == (
        kernel_rows * (2 if layout == KVCacheLayout.LBHNC else 1), kernel_rows)
    assert metadata.block_table.shape[1] == batch.block_table.shape[1] * kernel_rows
    _check(batch, output, scale)


def test_output_rows_past_the_batch_are_left_alone(torch_npu):
    batch = Batch([2, 1], [3, 0], heads=2, kv_heads=2, head_size=16, dtype=torch.float16,
                  seed=7)
    spec = _spec(2, 16, torch.float16)
    kv_cache = _allocate_cache(spec)
    impl = AscendAttentionImpl(2, 16, 0.25, 2, None, None, "auto")
    builder = AscendAttentionMetadataBuilder(spec, ["layer.0"], VllmConfig(),
                                             torch.device("cpu"))
    context_key, context_value, context_slots = batch.context_tokens()
    impl.do_kv_cache_update(None, context_key, context_value, kv_cache, context_slots)
    key, value, slots = batch.new_tokens()
    impl.do_kv_cache_update(None, key, value, kv_cache, slots)
    padded_query = torch.cat([batch.query, torch.zeros(2, 2, 16, dtype=torch.float16)])
    output = torch.full_like(padded_query, 7.0)
    impl.forward(None, padded_query, key, value, kv_cache,
                 builder.build(0, batch.common_metadata()), output=output)
    assert torch.equal(output[3:], torch.full((2, 2, 16), 7.0, dtype=torch.float16))
    _check(batch, output[:3], 0.25)


# --- wiring into vLLM ---------------------------------------------------------------------


def test_cache_halves_from_vllm_allocation_are_the_ops_layouts(torch_npu):
    assert AscendAttentionBackend.supported_kv_cache_layouts() == (KVCacheLayout.LHBNC,
                                                                   KVCacheLayout.LBHNC)
    spec = _spec(2, 32, torch.float16)
    assert spec.num_head_slots == 2 and spec.page_size_bytes == 2 * BLOCK_SIZE * 2 * 32 * 2
    kv_cache = _allocate_cache(spec)
    assert kv_cache.shape == (NUM_BLOCKS, 2, BLOCK_SIZE, 64)
    key_cache, value_cache = kv_cache.unbind(1)
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    assert value_cache.data_ptr() - key_cache.data_ptr() == key_cache.numel() * 2


def test_npu_platform_selects_the_backend(torch_npu):
    npu = importlib.import_module("ascend_core.platform.npu")
    config = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16,
                                     kv_cache_dtype="auto", block_size=128)
    path = npu.AscendPlatform.get_attn_backend_cls(None, config)
    assert path == ASCEND_ATTN_BACKEND
    assert resolve_obj_by_qualname(path) is AscendAttentionBackend
    assert AttentionBackendEnum[AscendAttentionBackend.get_name()].get_path() == path
    # Idempotent: a second selection (another layer, another process's plugin load).
    assert npu.AscendPlatform.get_attn_backend_cls(None, config) == path


@pytest.mark.parametrize(("changes", "error", "match"), [
    ({"dtype": torch.float32}, ValueError, "dtype not supported"),
    ({"head_size": 24}, ValueError, "head_size not supported"),
    ({"block_size": 16}, ValueError, "block_size not supported"),
    ({"kv_cache_dtype": "fp8"}, ValueError, "kv_cache_dtype not supported"),
    ({"has_sliding_window": True}, ValueError, "sliding window not supported"),
    ({"attn_type": "encoder_only"}, ValueError, "attention type encoder_only"),
    # MLA models go to the Ascend MLA backend (test_attention_npu_mla), which takes only
    # the 512 + 64 latent cache.
    ({"use_mla": True}, ValueError, "Ascend MLA backend cannot run"),
])
def test_npu_platform_refuses_what_the_backend_cannot_run(torch_npu, changes, error, match):
    npu = importlib.import_module("ascend_core.platform.npu")
    config = AttentionSelectorConfig(head_size=128, dtype=torch.bfloat16,
                                     kv_cache_dtype="auto", block_size=128)._replace(**changes)
    with pytest.raises(error, match=match):
        npu.AscendPlatform.get_attn_backend_cls(None, config)


# --- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"head_size": 24}, ValueError, "multiple of 16 up to 512"),
    ({"head_size": 528}, ValueError, "multiple of 16 up to 512"),
    ({"num_kv_heads": 3}, ValueError, "multiple of the KV heads"),
    ({"sliding_window": 64}, NotImplementedError, "sliding_window"),
    ({"alibi_slopes": [0.5] * 4}, NotImplementedError, "alibi_slopes"),
    ({"logits_soft_cap": 30.0}, NotImplementedError, "logits_soft_cap"),
    ({"kv_cache_dtype": "fp8"}, NotImplementedError, "kv_cache_dtype='fp8'"),
    ({"attn_type": "encoder"}, NotImplementedError, "decoder attention only"),
])
def test_impl_rejects_what_it_cannot_compute(kwargs, error, match):
    arguments = dict(num_heads=4, head_size=32, scale=0.1, num_kv_heads=2, alibi_slopes=None,
                     sliding_window=None, kv_cache_dtype="auto")
    arguments.update(kwargs)
    with pytest.raises(error, match=match):
        AscendAttentionImpl(**arguments)


def test_builder_rejects_small_blocks_and_non_causal_batches(torch_npu):
    with pytest.raises(ValueError, match="must be a multiple of 128; got 16"):
        AscendAttentionMetadataBuilder(_spec(2, 32, torch.float16, block_size=16),
                                       ["layer.0"], VllmConfig(), torch.device("cpu"))
    builder = AscendAttentionMetadataBuilder(_spec(2, 32, torch.float16), ["layer.0"],
                                             VllmConfig(), torch.device("cpu"))
    batch = Batch([2], [0], heads=2, kv_heads=2, head_size=32, dtype=torch.float16, seed=8)
    with pytest.raises(NotImplementedError, match="causal decoder attention only"):
        builder.build(0, batch.common_metadata(causal=False))
    bad = batch.common_metadata().replace(seq_lens=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="at least the query length"):
        builder.build(0, bad)


def test_cache_not_in_the_backends_layout_is_refused(torch_npu):
    batch = Batch([1], [4], heads=2, kv_heads=2, head_size=32, dtype=torch.float16, seed=9)
    # LBNHC: each token's key and value side by side, no contiguous rows of keys.
    token_interleaved = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, 2, 64,
                                    dtype=torch.float16).transpose(1, 2)
    with pytest.raises(ValueError, match="not the LHBNC or LBHNC layout"):
        _run(batch, kv_cache=token_interleaved)


def test_padding_slot_is_refused_by_the_kv_write(torch_npu):
    spec = _spec(2, 32, torch.float16)
    impl = AscendAttentionImpl(2, 32, 0.1, 2, None, None, "auto")
    key = torch.zeros(2, 2, 32, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="Drop padding tokens"):
        impl.do_kv_cache_update(None, key, key, _allocate_cache(spec), torch.tensor([0, -1]))
