"""Paged attention for the npu target through torch_npu's documented fused ops.

One path serves prefill, decode, chunked prefill on cached context and speculative
verification (several query tokens per request on top of its cache), in any mix:

- the KV write is ``torch_npu.npu_scatter_pa_kv_cache`` in its ND ("Norm") mode, keys and
  values of each token scattered by vLLM's slot mapping;
- attention is ``torch_npu.npu_fused_infer_attention_score`` in its page-attention form:
  the query as ``BSND`` (``[requests, longest query, heads, head_dim]``), the caches read
  through vLLM's block table, ``actual_seq_lengths`` the per-request query lengths and
  ``actual_seq_lengths_kv`` the per-request lengths of cache plus new tokens, and
  ``sparse_mode=3`` (right-down causal) with the page's compressed 2048 x 2048 mask, which
  aligns each request's queries with the end of its keys: query ``i`` of ``q`` sees the
  first ``kv - q + i + 1`` keys. With one query token per request (decode) the op takes
  its incremental branch, where the page makes the mask and ``sparse_mode`` ineffective.

Under FULL decode graphs a uniform batch (decode, or speculative verification with 1 + k
tokens per request) is captured with the same op: its ``.out`` form in a graph task group,
whose host sequence lengths are updated before every replay
(``ascend_core.attention.npu_graph_tasks``).

The TND layout would avoid padding ragged queries, but torch_npu's page restricts TND to
MLA head shapes (D 192, or 512/128 with rope), so ragged batches are padded to BSND here
and uniform ones (decode, speculative verification) are only viewed.

KV cache: two head slots (keys, values) of ``num_kv_heads * head_size`` per token, so that
vLLM's per-layer view is logical ``[num_blocks, 2, block_size, num_kv_heads * head_size]``.
The ops read and write contiguous ``(rows, kernel_block_size, H)`` tensors -- the
``(blocknum, blocksize, H)`` cache layout the fused op reads, and, viewed as ``[rows,
kernel_block_size, num_kv_heads, head_size]``, the ND cache the scatter writes -- where a
row is ``kernel_block_size`` tokens of keys (or values) and ``kernel_block_size`` is the
largest block size the op takes (128 to 512 in steps of 128) that divides vLLM's block
size. Two layouts are taken: ``LHBNC`` (the default: all blocks' keys, then all blocks'
values; rows ``m * b + j`` for block ``b`` of ``m`` rows) and ``LBHNC`` (each block's keys
then its values, ``2 * m * b + j``), the block-compact layout vLLM needs where attention
pages share memory with other states (hybrid models: Qwen3-Next's gated delta-net states).
In both the keys and the values are each one contiguous tensor whose rows are addressed
through a block table in rows (``CacheTiling``), the values' starting ``m`` rows later in
``LBHNC``; with ``m = 1`` in ``LHBNC`` that is vLLM's own block table.

torch_npu is imported inside the functions that run on the device, so this module imports
(and its metadata builds) without it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.utils.torch_utils import get_dtype_size
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from ascend_core.attention import ASCEND_ATTN_NAME, tree_verification

# Page attention with more than one query token per request takes block sizes of 128 to
# 512 in steps of 128 (torch_npu-npu_fused_infer_attention_score.md); vLLM's blocks may be
# any multiple of 128 tokens, read as several of the op's blocks (CacheTiling).
KERNEL_BLOCK_SIZES = (128, 256, 384, 512)
BLOCK_SIZE_BASE = 128
# float16/bfloat16 inputs need head_dim aligned to 16, at most 512.
SUPPORTED_HEAD_SIZES = tuple(range(16, 513, 16))
MAX_HEADS = 256
MAX_GQA_RATIO = 64
# The H of a (blocknum, blocksize, H) cache is limited to 65535 elements.
MAX_KV_HIDDEN = 65535
# sparse_mode=3 takes this optimised mask: 1 strictly above the diagonal (not computed).
COMPRESSED_MASK_SIDE = 2048
SPARSE_MODE_NO_MASK = 0
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3


def is_padded_uniform(query_lens: list[int], decode_query_len: int) -> bool:
    """Whether a batch is uniform decode: requests of ``decode_query_len`` tokens, then
    possibly vLLM's padding requests of a captured size (query length 0)."""
    active = len(query_lens)
    while active and query_lens[active - 1] == 0:
        active -= 1
    return active > 0 and set(query_lens[:active]) == {decode_query_len}


def kernel_block_size(block_size: int) -> int:
    """The op's block size for vLLM's blocks of ``block_size`` tokens: the largest it takes
    that divides them."""
    for size in sorted(KERNEL_BLOCK_SIZES, reverse=True):
        if block_size % size == 0:
            return size
    raise ValueError(
        f"The Ascend attention backend reads paged caches in blocks of "
        f"{list(KERNEL_BLOCK_SIZES)} tokens, so vLLM's block size must be a multiple of "
        f"{BLOCK_SIZE_BASE}; got {block_size}. Pass --block-size 128 (or a multiple).")


@dataclass(frozen=True)
class CacheTiling:
    """How vLLM's blocks map onto the op's rows of ``kernel_block_size`` tokens: block ``b``
    is rows ``row_stride * b + j`` (``j < rows_per_block``) of the key tensor and of the
    value tensor."""

    block_size: int
    kernel_block_size: int
    row_stride: int

    @classmethod
    def of(cls, block_size: int, layout: KVCacheLayout) -> CacheTiling:
        kernel = kernel_block_size(block_size)
        rows = block_size // kernel
        if layout not in AscendAttentionBackend.supported_kv_cache_layouts():
            raise ValueError(
                f"KV cache layout {layout.name}; the Ascend attention backend takes "
                f"{[m.name for m in AscendAttentionBackend.supported_kv_cache_layouts()]}.")
        # LBHNC interleaves each block's keys and values: twice the rows per block.
        return cls(block_size, kernel, rows * (2 if layout == KVCacheLayout.LBHNC else 1))

    @property
    def rows_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    @property
    def is_identity(self) -> bool:
        return self.row_stride == 1

    def kernel_slots(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """vLLM's slots (``block * block_size + offset``) as the op's (``row * kernel_block
        + offset``); elementwise, so graph-safe."""
        if self.is_identity:
            return slot_mapping
        return (slot_mapping // self.block_size) * (self.row_stride * self.kernel_block_size) \
            + slot_mapping % self.block_size

    def kernel_block_table(self, block_table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """vLLM's block table ``[reqs, blocks]`` as rows ``[reqs, blocks * rows_per_block]``,
        written into ``out`` (a persistent buffer, so a captured graph reads this step's)."""
        if self.is_identity:
            return block_table
        reqs, blocks = block_table.shape
        offsets = torch.arange(self.rows_per_block, dtype=block_table.dtype,
                               device=block_table.device)
        rows = block_table[:, :, None] * self.row_stride + offsets
        table = out[:reqs, :blocks * self.rows_per_block]
        table.copy_(rows.view(reqs, -1))
        return table


def _full_graphs_configured() -> bool:
    """Whether the vLLM config being built runs FULL (decode) graphs."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    mode = config.compilation_config.cudagraph_mode if config is not None else None
    return mode is not None and mode.has_full_cudagraphs()


class AscendAttentionBackend(AttentionBackend):
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return ASCEND_ATTN_NAME

    @staticmethod
    def get_impl_cls() -> type[AscendAttentionImpl]:
        return AscendAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[AscendAttentionMetadataBuilder]:
        return AscendAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Any multiple of 128 tokens: the backend reads a block as rows of the op's sizes
        # itself (CacheTiling), since vLLM cannot split blocks of two head slots.
        return [MultipleOf(BLOCK_SIZE_BASE)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Keys and values as two head slots, so each is one contiguous region."""
        if spec.state_content_bytes is not None:
            return spec
        if spec.head_size != spec.head_size_v:
            raise ValueError(
                f"The Ascend attention backend needs equal key and value head sizes, got "
                f"{spec.head_size} and {spec.head_size_v}."
            )
        return replace(
            spec,
            num_head_slots=2,
            state_content_bytes=spec.num_kv_heads * spec.head_size * get_dtype_size(spec.dtype),
        )

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Head slot outermost within a layer (all blocks of keys, then all of values) by
        # default; block-compact LBHNC where other states share the pages (hybrid models).
        return (KVCacheLayout.LHBNC, KVCacheLayout.LBHNC)


@dataclass
class AscendAttentionMetadata:
    """The fused op's arguments for one batch, shared by every layer of a KV group."""

    num_actual_tokens: int  # tokens with a query, in request order
    num_reqs: int
    max_query_len: int  # Q_S of the BSND query
    query_lens: list[int]  # [num_reqs] actual_seq_lengths (per request)
    seq_lens: list[int]  # [num_reqs] actual_seq_lengths_kv: cached + new tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [num_actual_tokens]
    # [num_actual_tokens] row of each token in the flattened [num_reqs * max_query_len]
    # BSND query; None when every request has max_query_len tokens (a plain view).
    padded_rows: torch.Tensor | None
    attn_mask: torch.Tensor | None  # compressed causal mask; None when max_query_len == 1
    sparse_mode: int
    # A uniform decode batch under FULL decode graphs: the kind a graph captures (its
    # fused op in a task group, the lengths updated before each replay).
    graph_decode: bool = False
    # How vLLM's blocks map onto the op's rows; block_table above is in those rows.
    tiling: CacheTiling | None = None


def tree_attention_mask(step: tree_verification.TreeStep, query_lens: list[int],
                        seq_lens: list[int], block_size: int, device: Any) -> torch.Tensor:
    """The op's full mask (``sparse_mode=0``; True: not computed) ``[B, 1, Q_S, KV_S]``
    for a step with Medusa trees: rows right-down causal, as ``sparse_mode=3`` makes
    them, except each tree request's root and nodes, which see the context and their
    ancestors. KV_S spans the longest request's blocks (the page's rule for page attention
    with a full mask); the columns are the requests' key positions."""
    batch, q_s = len(query_lens), max(query_lens)
    kv_s = -(-max(seq_lens) // block_size) * block_size
    rows = torch.arange(q_s).view(1, q_s, 1)
    columns = torch.arange(kv_s).view(1, 1, kv_s)
    shift = torch.tensor([kv - q for q, kv in zip(query_lens, seq_lens, strict=True)])
    hidden = columns > rows + shift.view(batch, 1, 1)
    for request in step.requests:
        m, root = request.num_nodes, request.root_position
        hidden[request.index, :m + 1, root:root + m + 1] = ~request.mask
    return hidden.unsqueeze(1).to(device)


class AscendAttentionMetadataBuilder(AttentionMetadataBuilder[AscendAttentionMetadata]):
    """Metadata for the fused op; graph support: uniform batches (decode, and speculative
    verification with the same query length in every request).

    A captured graph keeps the Python values its ops were called with, and the fused op's
    ``actual_seq_lengths_kv`` is such a host list that changes every step: a captured
    uniform batch (``graph_decode``) issues the op in a graph task group, and before each
    replay the group gets this step's ``query_lens`` and ``seq_lens`` from the metadata
    built here (``npu_graph_tasks``). Padding requests of a captured size (sequence length
    0 in vLLM's buffers) get their query length as sequence length, reading vLLM's null
    block through their zero block-table rows.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # Every batch goes through one path, so requests need no reordering.
    reorder_batch_threshold: int | None = None

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layout_name = vllm_config.cache_config.kv_cache_layout
        layout = (KVCacheLayout[layout_name] if layout_name is not None
                  else AscendAttentionBackend.supported_kv_cache_layouts()[0])
        self.tiling = CacheTiling.of(kv_cache_spec.block_size, layout)
        self._max_reqs = vllm_config.scheduler_config.max_num_seqs
        self._kernel_block_table: torch.Tensor | None = None  # made at the first build
        self._causal_mask: torch.Tensor | None = None
        mode = vllm_config.compilation_config.cudagraph_mode
        self._full_graphs = mode is not None and mode.has_full_cudagraphs()
        speculative = vllm_config.speculative_config
        self._decode_query_len = 1 + ((speculative.num_speculative_tokens or 0)
                                      if speculative is not None else 0)

    def _compressed_causal_mask(self) -> torch.Tensor:
        if self._causal_mask is None:
            side = COMPRESSED_MASK_SIDE
            ones = torch.ones(side, side, dtype=torch.int8, device=self.device)
            self._causal_mask = torch.triu(ones, diagonal=1)
        return self._causal_mask

    def _block_table(self, block_table: torch.Tensor) -> torch.Tensor:
        """The table the op reads: vLLM's, or its rows of the op's blocks (CacheTiling) in
        a buffer kept across steps (vLLM's table is as wide every step)."""
        if self.tiling.is_identity:
            return block_table
        reqs, columns = block_table.shape
        rows = max(reqs, self._max_reqs), columns * self.tiling.rows_per_block
        buffer = self._kernel_block_table
        if buffer is None or buffer.shape[0] < rows[0] or buffer.shape[1] < rows[1]:
            buffer = self._kernel_block_table = block_table.new_zeros(rows)
        return self.tiling.kernel_block_table(block_table, buffer)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AscendAttentionMetadata:
        meta = common_attn_metadata
        if not (isinstance(meta.causal, bool) and meta.causal):
            raise NotImplementedError(
                "The Ascend attention backend computes causal decoder attention only; got "
                f"causal={meta.causal!r}."
            )
        num_reqs = meta.num_reqs
        # The op takes host lists (SymInt[]); query starts are on the host already.
        starts = meta.query_start_loc_cpu[: num_reqs + 1].tolist()
        query_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
        seq_lens = meta.seq_lens[:num_reqs].to("cpu").tolist()
        graph_decode = self._full_graphs and is_padded_uniform(query_lens,
                                                               self._decode_query_len)
        if graph_decode:
            # Padding requests of a captured size (query length and sequence length 0 in
            # vLLM's buffers) become requests of the decode length over the null block.
            query_lens = [self._decode_query_len] * num_reqs
            seq_lens = [kv or q_len for q_len, kv in zip(query_lens, seq_lens, strict=True)]
            starts = [req * self._decode_query_len for req in range(num_reqs + 1)]
        for req, (q_len, kv_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if q_len > kv_len:
                raise ValueError(
                    f"request {req} has {q_len} query tokens but a sequence length of "
                    f"{kv_len}; the sequence length counts cached plus new tokens, so it "
                    "must be at least the query length."
                )
        num_tokens = starts[-1]
        max_query_len = max(query_lens, default=0)

        padded_rows = None
        if any(q_len != max_query_len for q_len in query_lens):
            rows = [
                req * max_query_len + offset
                for req, q_len in enumerate(query_lens)
                for offset in range(q_len)
            ]
            padded_rows = torch.tensor(rows, dtype=torch.long).to(self.device)

        incremental = max_query_len <= 1
        attn_mask = None if incremental else self._compressed_causal_mask()
        sparse_mode = SPARSE_MODE_NO_MASK if incremental else SPARSE_MODE_RIGHT_DOWN_CAUSAL
        tree_step = tree_verification.current_step()
        if tree_step is not None:
            if graph_decode:
                raise RuntimeError("a Medusa tree step was taken for a FULL decode graph; "
                                   "tree verification runs without FULL decode graphs")
            attn_mask = tree_attention_mask(tree_step, query_lens, seq_lens,
                                            self.tiling.kernel_block_size, self.device)
            sparse_mode = SPARSE_MODE_NO_MASK
        return AscendAttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=max_query_len,
            query_lens=query_lens,
            seq_lens=seq_lens,
            block_table=self._block_table(meta.block_table_tensor[:num_reqs]),
            slot_mapping=meta.slot_mapping[:num_tokens],
            padded_rows=padded_rows,
            attn_mask=attn_mask,
            sparse_mode=sparse_mode,
            graph_decode=graph_decode,
            tiling=self.tiling,
        )


class AscendAttentionImpl(AttentionImpl[AscendAttentionMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap or None,
            "sinks": sinks,
        }
        for name, given in unsupported.items():
            if given is not None:
                raise NotImplementedError(
                    f"The Ascend attention backend does not implement {name} (got {given!r}); "
                    "its fused op is called without position biases, windows, soft caps or "
                    "sinks."
                )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"The Ascend attention backend computes decoder attention only, got "
                f"attn_type={attn_type!r}."
            )
        if head_size not in SUPPORTED_HEAD_SIZES:
            raise ValueError(
                f"head_size={head_size} is not supported by the Ascend attention backend: "
                "torch_npu's fused attention needs a multiple of 16 up to 512."
            )
        if num_kv_heads < 1 or num_heads % num_kv_heads or num_heads > MAX_HEADS or (
            num_heads // num_kv_heads > MAX_GQA_RATIO
        ):
            raise ValueError(
                f"num_heads={num_heads}, num_kv_heads={num_kv_heads}: torch_npu's fused "
                f"attention takes at most {MAX_HEADS} query heads, a multiple of the KV "
                f"heads and at most {MAX_GQA_RATIO} times them."
            )
        if num_kv_heads * head_size > MAX_KV_HIDDEN:
            raise ValueError(
                f"num_kv_heads * head_size = {num_kv_heads * head_size} exceeds "
                f"{MAX_KV_HIDDEN}, the largest H of the (blocks, block_size, H) cache."
            )
        if kv_cache_dtype not in AscendAttentionBackend.supported_kv_cache_dtypes:
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the Ascend attention "
                "backend; use 'auto' (the model's float16/bfloat16)."
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # Under FULL decode graphs the slot mapping is vLLM's padded one, -1 for padding.
        self.pad_slots_to_null_block = _full_graphs_configured()

    def _split_cache(
        self, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, CacheTiling]:
        """Keys and values, each one contiguous ``(rows, kernel_block_size, num_kv_heads *
        D)`` tensor over the layer's cache, and how vLLM's blocks map onto their rows."""
        hidden = self.num_kv_heads * self.head_size
        if kv_cache.dim() != 4 or kv_cache.shape[1] != 2 or kv_cache.shape[3] != hidden:
            raise ValueError(
                f"KV cache of shape {tuple(kv_cache.shape)}; the Ascend backend expects "
                f"[num_blocks, 2, block_size, {hidden}] "
                "(AscendAttentionBackend.customize_spec's two head slots)."
            )
        num_blocks, _, block_size, _ = kv_cache.shape
        kernel = kernel_block_size(block_size)
        row = kernel * hidden
        block_stride, slot_stride, token_stride, _ = kv_cache.stride()
        layouts = {block_size * hidden: KVCacheLayout.LHBNC,
                   2 * block_size * hidden: KVCacheLayout.LBHNC}
        layout = layouts.get(block_stride) if (token_stride, kv_cache.stride(3)) == (
            hidden, 1) else None
        if layout is None or (layout == KVCacheLayout.LBHNC) != (
                slot_stride == block_size * hidden):
            raise ValueError(
                f"The KV cache's strides {kv_cache.stride()} are not the LHBNC or LBHNC "
                "layout (AscendAttentionBackend.supported_kv_cache_layouts); torch_npu's "
                "ops need each block's keys and values as contiguous rows.")
        tiling = CacheTiling.of(block_size, layout)
        rows = tiling.row_stride * (num_blocks - 1) + tiling.rows_per_block
        shape, strides = (rows, kernel, hidden), (row, hidden, 1)
        offset = kv_cache.storage_offset()
        key_cache = kv_cache.as_strided(shape, strides, offset)
        value_cache = kv_cache.as_strided(shape, strides, offset + slot_stride)
        return key_cache, value_cache, tiling

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        import torch_npu

        key_cache, value_cache, tiling = self._split_cache(kv_cache)
        rows, kernel_block, _ = key_cache.shape
        block_size = tiling.block_size
        cache_shape = (rows, kernel_block, self.num_kv_heads, self.head_size)
        tokens = slot_mapping.shape[0]
        if self.pad_slots_to_null_block and tokens <= block_size:
            # Padding token i (slot -1) writes into slot i, in vLLM's null block (block 0),
            # which no request reads: npu_scatter_pa_kv_cache takes valid, unique slots
            # only, and a graph replays the KV write of every padded token. The platform
            # caps captured sizes at one block of tokens, so slot i stays in block 0.
            pad_slots = torch.arange(tokens, dtype=slot_mapping.dtype,
                                     device=slot_mapping.device)
            slot_mapping = torch.where(slot_mapping < 0, pad_slots, slot_mapping)
        elif self.pad_slots_to_null_block and bool((slot_mapping < 0).any()):
            # A larger batch is never captured (it runs eagerly, e.g. a draft model's step
            # with a request past max_model_len): its padding tokens write nothing, as slot
            # i would lie in a request's block.
            valid = slot_mapping >= 0
            key, value, slot_mapping = key[:tokens][valid], value[:tokens][valid], \
                slot_mapping[valid]
            tokens = slot_mapping.shape[0]
        # The op takes contiguous [tokens, heads, head_size] inputs; vLLM's key and value
        # are views into the fused QKV projection and may be padded past the slots.
        torch_npu.npu_scatter_pa_kv_cache(
            key[:tokens].contiguous(),
            value[:tokens].contiguous(),
            key_cache.view(cache_shape),
            value_cache.view(cache_shape),
            tiling.kernel_slots(slot_mapping),
            cache_mode="Norm",
        )

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AscendAttentionMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query ``[tokens, num_heads, head_size]``; output the same shape, written in place
        for the batch's tokens."""
        if output is None:
            raise ValueError("The Ascend attention backend writes into vLLM's output buffer; "
                             "output must be given.")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                "Fused output quantization is not supported by the Ascend attention backend."
            )
        if attn_metadata is None:  # profiling run
            return output
        import torch_npu

        meta = attn_metadata
        tokens = meta.num_actual_tokens
        if tokens == 0:
            return output
        key_cache, value_cache, tiling = self._split_cache(kv_cache)
        if meta.tiling is not None and meta.tiling != tiling:
            raise ValueError(
                f"The metadata's block table is in rows of {meta.tiling}, the layer's cache "
                f"is laid out as {tiling}; both come from vLLM's resolved KV cache layout.")
        block_size = tiling.kernel_block_size
        batch, q_s = meta.num_reqs, meta.max_query_len
        bsnd = (batch, q_s, self.num_heads, self.head_size)
        capturing = torch.npu.is_current_stream_capturing()
        if capturing and not meta.graph_decode:
            raise RuntimeError(
                "An NPU graph is capturing a batch whose attention metadata is not the "
                f"graph kind (num_reqs={meta.num_reqs}, query_lens={meta.query_lens}): the "
                "fused op's host sequence lengths would stay frozen in the graph. Only "
                "uniform decode batches under FULL decode graphs can be captured.")
        if meta.padded_rows is None:
            bsnd_query = query[:tokens].contiguous().view(bsnd)
        else:
            padded = query.new_zeros(batch * q_s, self.num_heads, self.head_size)
            padded[meta.padded_rows] = query[:tokens]
            bsnd_query = padded.view(bsnd)
        kwargs = dict(
            atten_mask=meta.attn_mask,
            actual_seq_lengths=meta.query_lens,
            actual_seq_lengths_kv=meta.seq_lens,
            block_table=meta.block_table,
            block_size=block_size,
            num_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            scale=self.scale,
            input_layout="BSND",
            sparse_mode=meta.sparse_mode,
        )
        if capturing:
            self._capture_uniform_batch(layer, bsnd_query, key_cache, value_cache, kwargs,
                                        output[:tokens], meta)
            return output
        attn_out, _ = torch_npu.npu_fused_infer_attention_score(
            bsnd_query, key_cache, value_cache, **kwargs)
        flat = attn_out.view(batch * q_s, self.num_heads, self.head_size)
        output[:tokens] = flat if meta.padded_rows is None else flat[meta.padded_rows]
        return output

    def _capture_uniform_batch(self, layer, bsnd_query, key_cache, value_cache, kwargs,
                               output, meta: AscendAttentionMetadata) -> None:
        """The fused op's ``.out`` form in a graph task group, writing straight into
        vLLM's output buffer where it can; its lengths follow each replayed step."""
        from ascend_core.attention.npu_graph_tasks import capture_fused_attention

        shape = bsnd_query.shape
        direct = output.is_contiguous() and output.dtype == bsnd_query.dtype
        attn_out = output.view(shape) if direct else bsnd_query.new_empty(shape)
        lse = torch.empty(1, dtype=torch.float32, device=bsnd_query.device)

        def host_arguments(step: AscendAttentionMetadata) -> dict:
            # The graph reads the block table captured: vLLM's buffer, refilled each step.
            if (step.num_reqs, step.max_query_len, step.graph_decode,
                    step.block_table.data_ptr()) != (
                    meta.num_reqs, meta.max_query_len, True, meta.block_table.data_ptr()):
                raise ValueError(
                    f"A graph captured for {meta.num_reqs} requests of {meta.max_query_len} "
                    f"tokens is replayed for metadata of {step.num_reqs} requests of "
                    f"{step.max_query_len} (graph_decode={step.graph_decode}); vLLM's "
                    "dispatcher should have picked another graph or run eagerly.")
            return {"actual_seq_lengths": step.query_lens,
                    "actual_seq_lengths_kv": step.seq_lens}

        capture_fused_attention(getattr(layer, "layer_name", None),
                                (bsnd_query, key_cache, value_cache), kwargs,
                                [attn_out, lse], host_arguments)
        if not direct:
            output.copy_(attn_out.view(output.shape))
