"""MLA attention (DeepSeek-V2/V3 style) for the npu target through torch_npu's documented ops.

Built on vLLM's MLA scaffolding (``MLACommonBackend``, ``MLACommonMetadataBuilder``,
``MLACommonImpl``): vLLM's ``MLAAttention`` layer writes the latent cache through
``do_kv_cache_update``, splits each batch into decode and prefill tokens, hands the prefill
tokens to ``forward_mha`` and, for the decode tokens, absorbs ``W_UK`` into the query, calls
``forward_mqa`` and applies ``W_UV`` to its result. What this module adds:

- the latent-cache write, ``torch_npu.npu_scatter_pa_kv_cache`` in its ND ("Norm") mode with
  the normalised latent ``kv_c`` (512) as key and the rotated ``k_pe`` (64) as value, each
  one KV head, scattered by vLLM's slot mapping;
- decode attention, ``torch_npu.npu_fused_infer_attention_score`` in its MLA form: ``query`` the
  absorbed latent query (D 512), ``query_rope`` its rope part (64), ``key`` and ``value``
  both the paged latent cache, ``key_rope`` the paged rope cache, ``num_key_value_heads=1``,
  page attention through vLLM's block table;
- prefill attention, the same op in its dense ``TND`` form (below).

Under FULL decode graphs a uniform batch (decode, or MTP / speculative verification with
1 + k tokens per request) is captured with the same op: its ``.out`` form in a graph task
group, whose host lengths are updated before every replay (``npu_graph_tasks``); padding
tokens of a captured batch write their latent rows into vLLM's null block.

Decode tokens (requests of at most the decode threshold's query tokens: 1, or 1 + k under
MTP / speculative verification) run in the absorbed form. torch_npu's page takes 1 to 16
query tokens per batch row in the MLA form, so the metadata builder cuts each request's new
tokens into pieces of at most 16 and gives every piece its own row of the ``BSND`` query:
the request's block-table row, its query length and its key length (cached tokens plus the
piece's end), with ``sparse_mode=3`` (right-down causal, the compressed 2048 x 2048 mask)
whenever a row holds more than one token.

Prefill tokens (requests above the threshold, as vLLM's MLA builder splits them) run as
dense MHA (``forward_mha``), as vLLM's MLA and vLLM-Ascend do: the latent rows of each
prefill's keys (its cached context gathered from the pages, then its new tokens) are
up-projected with ``kv_b_proj`` into per-head ``k_nope`` and ``v``; keys are ``[k_nope,
k_pe]`` (rope shared by all heads), queries ``[q_nope, q_pe]``, and one call of
``npu_fused_infer_attention_score`` in its dense ``TND`` form (query / key D 192, value D
128, bfloat16) with cumulative ``actual_seq_lengths`` / ``actual_seq_lengths_kv`` and
``sparse_mode=3`` computes every prefill: right-down causal aligns each request's new tokens
to the end of its keys, so a chunked prefill or a prefix-cache hit (keys longer than
queries) needs no second pass and no LSE merge. Smaller MLA heads (``qk_nope_head_dim`` or
``v_head_dim`` below 128) are zero-padded to 128 and head counts to the next of 2, 4, ...,
128 (zeros change no score and the padded output is dropped). The dense form takes bfloat16
only: a float16 model (or nope / value heads above 128) keeps prompts in the absorbed form,
the builder then declaring an unbounded decode threshold so that vLLM hands every token to
``forward_mqa``. FULL decode graphs capture decode-only batches; prefills run eagerly.

The page also limits the MLA form to 32, 64 or 128 query heads: with fewer (tensor
parallelism, small models) the query is padded with zero heads up to the next allowed count
and their rows are dropped; with more than 128 the backend refuses. The latent rank must be
512 and the rope dimension 64 (DeepSeek-V2/V3's shapes); other MLA shapes are refused.

KV cache: vLLM allocates each layer's pages as ``[num_blocks, block_size, 576]``; this
backend stores them as two planes of the same memory, first ``[num_blocks, block_size,
512]`` latent rows, then ``[num_blocks, block_size, 64]`` rope rows, because the fused op
takes the latent and rope caches as separate contiguous tensors. Only this backend reads or
writes these pages.

torch_npu is imported inside the functions that run on the device, so this module imports
(and its metadata builds) without it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    MLACommonPrefillMetadata,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType
from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

from ascend_core.attention import ASCEND_MLA_NAME, configuration_problems
from ascend_core.attention.npu_attention import is_padded_uniform


def _full_graphs_configured() -> bool:
    """Whether the vLLM config being built runs FULL (decode) graphs."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    mode = config.compilation_config.cudagraph_mode if config is not None else None
    return mode is not None and mode.has_full_cudagraphs()


KV_LORA_RANK = 512
ROPE_DIM = 64
SUPPORTED_HEAD_SIZE = KV_LORA_RANK + ROPE_DIM
# Query heads the MLA form takes; fewer are padded up to the next of these.
PADDED_HEAD_COUNTS = (32, 64, 128)
MAX_TOKENS_PER_ROW = 16
SUPPORTED_BLOCK_SIZES = (16, 128)
COMPRESSED_MASK_SIDE = 2048
SPARSE_MODE_NO_MASK = 0
SPARSE_MODE_RIGHT_DOWN_CAUSAL = 3
# Without the dense prefill every request is a "decode" for vLLM's common code: no request
# is ever long enough to reach the dense-MHA prefill path.
UNBOUNDED_DECODE_THRESHOLD = 1 << 30
# The dense TND form (MLA prefill as MHA): query / key D 192 = nope 128 + rope 64, value D
# 128, bfloat16, the same number of query and key heads, one of these counts.
DENSE_NOPE_DIM = 128
DENSE_VALUE_DIM = 128
DENSE_HEAD_COUNTS = (2, 4, 8, 16, 32, 64, 128)
DENSE_DTYPE = torch.bfloat16


def padded_head_count(num_heads: int) -> int:
    """The MLA form's head count for a layer of ``num_heads`` query heads."""
    for count in PADDED_HEAD_COUNTS:
        if num_heads <= count:
            return count
    raise ValueError(
        f"The Ascend MLA backend runs torch_npu's MLA attention, which takes at most "
        f"{PADDED_HEAD_COUNTS[-1]} query heads per device; this layer has {num_heads}. "
        "Raise tensor_parallel_size so that each device holds at most "
        f"{PADDED_HEAD_COUNTS[-1]} heads."
    )


def dense_head_count(num_heads: int) -> int:
    """The dense TND form's head count for a layer of ``num_heads`` (at most 128) heads."""
    return next(count for count in DENSE_HEAD_COUNTS if num_heads <= count)


def dense_prefill_supported(dtype: torch.dtype, qk_nope_head_dim: int,
                            v_head_dim: int) -> bool:
    """Whether prefills can run as dense MHA through the fused op's dense TND form (query /
    key nope heads and value heads up to 128, zero-padded to it; bfloat16 only)."""
    return (dtype == DENSE_DTYPE and qk_nope_head_dim <= DENSE_NOPE_DIM
            and v_head_dim <= DENSE_VALUE_DIM)


def check_mla_shape(kv_lora_rank: int, qk_rope_head_dim: int) -> None:
    if (kv_lora_rank, qk_rope_head_dim) != (KV_LORA_RANK, ROPE_DIM):
        raise ValueError(
            f"The Ascend MLA backend takes kv_lora_rank={KV_LORA_RANK} and "
            f"qk_rope_head_dim={ROPE_DIM} (DeepSeek-V2/V3's MLA shape, the only one "
            "torch_npu's paged MLA attention takes), but this model has "
            f"kv_lora_rank={kv_lora_rank} and qk_rope_head_dim={qk_rope_head_dim}."
        )


class AscendMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        return ASCEND_MLA_NAME

    @staticmethod
    def get_impl_cls() -> type[AscendMLAImpl]:
        return AscendMLAImpl

    @staticmethod
    def get_builder_cls() -> type[AscendMLAMetadataBuilder]:
        return AscendMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [SUPPORTED_HEAD_SIZE]

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int]:
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class AscendMLADecodeMetadata(MLACommonDecodeMetadata):
    """The fused op's arguments for one batch: one ``BSND`` row per piece of at most 16
    query tokens of a request."""

    num_tokens: int
    rows: int  # B of the BSND query
    row_len: int  # Q_S of the BSND query
    row_query_lens: list[int]  # actual_seq_lengths
    row_kv_lens: list[int]  # actual_seq_lengths_kv
    row_block_table: torch.Tensor  # [rows, max blocks] int32
    # [num_tokens] position of each token in the flattened [rows * row_len] query; None
    # when the rows are exactly the tokens in order (a plain view).
    token_rows: torch.Tensor | None
    attn_mask: torch.Tensor | None
    sparse_mode: int
    # A uniform decode batch under FULL decode graphs: the kind a graph captures.
    graph_decode: bool = False


def plan_rows(query_lens: list[int], seq_lens: list[int],
              max_tokens: int = MAX_TOKENS_PER_ROW):
    """Cut each request's query into rows of at most ``max_tokens``.

    Returns ``(row_request, row_query_lens, row_kv_lens, row_len, token_rows)``:
    the request of each row, its query tokens, its keys (the request's cached tokens plus
    everything up to the row's last token), the row width, and for every token (in request
    order) its flat position in a ``[rows, row_len]`` query.
    """
    row_request, row_q, row_kv = [], [], []
    for req, (q_len, kv_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if q_len > kv_len:
            raise ValueError(
                f"request {req} has {q_len} query tokens but a sequence length of {kv_len}; "
                "the sequence length counts cached plus new tokens, so it must be at least "
                "the query length."
            )
        context = kv_len - q_len
        for start in range(0, q_len, max_tokens):
            length = min(max_tokens, q_len - start)
            row_request.append(req)
            row_q.append(length)
            row_kv.append(context + start + length)
    row_len = max(row_q, default=0)
    token_rows = [row * row_len + offset for row, length in enumerate(row_q)
                  for offset in range(length)]
    return row_request, row_q, row_kv, row_len, token_rows


@dataclass
class AscendMLAPrefillMetadata(MLACommonPrefillMetadata):
    """The dense TND call's arguments for the batch's prefills (requests in batch order)."""

    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)  # cached tokens before the queries
    cumulative_query_lens: list[int] = field(default_factory=list)  # actual_seq_lengths
    cumulative_kv_lens: list[int] = field(default_factory=list)  # actual_seq_lengths_kv
    # [sum(context_lens)] flat page slots of every prefill's cached context, request by
    # request; None when no prefill has cached context.
    context_slots: torch.Tensor | None = None
    # [sum(kv lens)] each key's row in cat(context rows, new rows): a request's context,
    # then its new tokens; None when there is no context (the keys are the new rows).
    key_order: torch.Tensor | None = None
    attn_mask: torch.Tensor | None = None


def plan_dense_prefill(query_lens: list[int], seq_lens: list[int],
                       block_table: torch.Tensor, block_size: int):
    """Host plan of the dense prefill: ``(cumulative_query_lens, cumulative_kv_lens,
    context_slots, key_order)`` for requests of ``query_lens`` new tokens and ``seq_lens``
    keys (cached context plus new tokens); ``block_table``: their rows (on the device, where
    the slots are computed)."""
    context_lens = [kv - q for q, kv in zip(query_lens, seq_lens, strict=True)]
    if min(context_lens, default=0) < 0:
        raise ValueError(f"prefill sequence lengths {seq_lens} below their query lengths "
                         f"{query_lens}.")
    cumulative_q = torch.tensor(query_lens, dtype=torch.long).cumsum(0).tolist()
    cumulative_kv = torch.tensor(seq_lens, dtype=torch.long).cumsum(0).tolist()
    total_context = sum(context_lens)
    if total_context == 0:
        return cumulative_q, cumulative_kv, None, None
    context = torch.tensor(context_lens, dtype=torch.long)
    requests = torch.arange(len(context_lens)).repeat_interleave(context)
    context_starts = context.cumsum(0) - context
    positions = torch.arange(total_context) - context_starts.repeat_interleave(context)
    device = block_table.device
    blocks = block_table[requests.to(device), (positions // block_size).to(device)].long()
    context_slots = blocks * block_size + (positions % block_size).to(device)
    # Key rows of request r: its context rows (at context_starts[r] in the context part),
    # then its new rows (at total_context + its query start).
    query = torch.tensor(query_lens, dtype=torch.long)
    query_starts = query.cumsum(0) - query
    order = [torch.cat([torch.arange(c_start, c_start + c_len),
                        torch.arange(total_context + q_start, total_context + q_start + q_len)])
             for c_start, c_len, q_start, q_len in zip(
                 context_starts.tolist(), context_lens, query_starts.tolist(), query_lens,
                 strict=True)]
    key_order = torch.cat(order).to(device)
    return cumulative_q, cumulative_kv, context_slots, key_order


class AscendMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata, decode requests on the latent side, prefills (above the decode
    threshold) on the dense side (``AscendMLAPrefillMetadata``) where the dense TND form
    takes the model (``dense_prefill``), else every request on the latent side. Graph
    support: uniform batches (decode, and MTP / speculative verification with the same query
    length in every request). A captured batch issues the fused op in a graph task group
    whose host lengths (``row_query_lens``, ``row_kv_lens``) are updated before each replay
    from the metadata built here; padding requests of a captured size (sequence length 0 in
    vLLM's buffers) get their query length, reading the null block through zero table rows.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.VARLEN
    reorder_batch_threshold: int = UNBOUNDED_DECODE_THRESHOLD

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        if kv_cache_spec.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"The Ascend MLA backend reads paged latent caches of block size "
                f"{list(SUPPORTED_BLOCK_SIZES)}, got {kv_cache_spec.block_size}; pass "
                "--block-size 128."
            )
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        check_mla_shape(self.mla_dims.kv_lora_rank, self.mla_dims.qk_rope_head_dim)
        self.dense_prefill = dense_prefill_supported(
            self.model_config.dtype, self.mla_dims.qk_nope_head_dim, self.mla_dims.v_head_dim)
        if self.dense_prefill:
            # vLLM's split: one token a request (1 + k with speculative decoding) decodes.
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
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

    def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
        meta = common_attn_metadata
        if meta.causal is not True:
            raise NotImplementedError(
                "The Ascend MLA backend computes causal decoder attention only; got "
                f"causal={meta.causal!r}."
            )
        built = super().build(common_prefix_len, meta, fast_build)
        if built.num_prefills:
            if not self.dense_prefill:
                raise RuntimeError(
                    f"vLLM's MLA metadata split {built.num_prefills} request(s) off as "
                    "prefills, but this model's prefills run in the Ascend MLA backend's "
                    "latent path (the dense TND form takes bfloat16 with nope / value heads "
                    f"up to 128; reorder_batch_threshold was {self.reorder_batch_threshold})."
                )
            first = built.num_decodes
            starts = meta.query_start_loc_cpu[first:meta.num_reqs + 1].tolist()
            query_lens = [end - start for start, end in zip(starts[:-1], starts[1:],
                                                            strict=True)]
            # Exact for prefill rows (vLLM's build relies on it too; no device sync).
            seq_lens = meta.seq_lens_cpu_upper_bound[first:meta.num_reqs].tolist()
            built.prefill = self._build_dense_prefill(
                built.prefill, query_lens, seq_lens, meta.block_table_tensor[first:])
        return built

    def _build_dense_prefill(self, prefill: MLACommonPrefillMetadata, query_lens: list[int],
                             seq_lens: list[int],
                             block_table: torch.Tensor) -> AscendMLAPrefillMetadata:
        cumulative_q, cumulative_kv, context_slots, key_order = plan_dense_prefill(
            query_lens, seq_lens, block_table, self.kv_cache_spec.block_size)
        return AscendMLAPrefillMetadata(
            block_table=block_table,
            query_start_loc=prefill.query_start_loc,
            max_query_len=max(query_lens),
            query_lens=query_lens,
            context_lens=[kv - q for q, kv in zip(query_lens, seq_lens, strict=True)],
            cumulative_query_lens=cumulative_q,
            cumulative_kv_lens=cumulative_kv,
            context_slots=context_slots,
            key_order=key_order,
            attn_mask=self._compressed_causal_mask(),
        )

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len,
                      query_start_loc_cpu, query_start_loc_device, num_decode_tokens,
                      max_query_len, dcp_tot_seq_lens_device):
        if dcp_tot_seq_lens_device is not None:
            raise NotImplementedError(
                "Decode context parallelism is not supported by the Ascend MLA backend."
            )
        starts = query_start_loc_cpu.tolist()
        query_lens = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
        # The op takes host lists (SymInt[]).
        seq_lens = seq_lens_device.to("cpu").tolist()
        graph_decode = (self._full_graphs
                        and is_padded_uniform(query_lens, self._decode_query_len)
                        and self._decode_query_len <= MAX_TOKENS_PER_ROW
                        and block_table_tensor.dtype == torch.int32
                        and block_table_tensor.is_contiguous())
        if graph_decode:
            # Padding requests of a captured size (query length and sequence length 0 in
            # vLLM's buffers) become requests of the decode length over the null block.
            query_lens = [self._decode_query_len] * len(query_lens)
            seq_lens = [kv or q_len for q_len, kv in zip(query_lens, seq_lens, strict=True)]
            starts = [req * self._decode_query_len for req in range(len(query_lens) + 1)]
        row_request, row_q, row_kv, row_len, token_rows = plan_rows(query_lens, seq_lens)
        plain = len(row_q) * row_len == len(token_rows)  # every row full: rows are tokens
        request_index = torch.tensor(row_request, dtype=torch.long)
        incremental = row_len <= 1
        return AscendMLADecodeMetadata(
            block_table=block_table_tensor,
            seq_lens=seq_lens_device,
            dcp_tot_seq_lens=None,
            num_tokens=starts[-1],
            rows=len(row_q),
            row_len=row_len,
            row_query_lens=row_q,
            row_kv_lens=row_kv,
            # A captured batch (one row per request) reads vLLM's block-table buffer itself,
            # so each replay sees the step's table; other batches gather rows per piece.
            row_block_table=block_table_tensor if graph_decode and plain
            else block_table_tensor[request_index.to(block_table_tensor.device)]
            .to(torch.int32).contiguous(),
            token_rows=None if plain else torch.tensor(token_rows, dtype=torch.long)
            .to(self.device),
            attn_mask=None if incremental else self._compressed_causal_mask(),
            sparse_mode=SPARSE_MODE_NO_MASK if incremental else SPARSE_MODE_RIGHT_DOWN_CAUSAL,
            graph_decode=graph_decode,
        )


class NPUMLAPrefillBackend(MLAPrefillBackend):
    """The npu platform's MLA prefill backend for vLLM's selector (vLLM's MLA layer needs
    one). The Ascend MLA backend runs its prefills itself (``AscendMLAImpl.forward_mha``:
    the fused op's dense TND form, or the latent path), so vLLM never calls these; if it
    did, they refuse instead of computing something else."""

    @staticmethod
    def get_name() -> str:
        return "ASCEND_MLA_PREFILL"

    def run_prefill_new_tokens(self, q, k, v, return_softmax_lse, out=None,
                               output_scale=None):
        raise NotImplementedError(
            "The npu target's MLA prefills run inside the Ascend MLA backend "
            f"({ASCEND_MLA_NAME}: AscendMLAImpl.forward_mha), not through vLLM's prefill "
            "backends; select that attention backend."
        )

    def run_prefill_context_chunk(self, chunk, q, k, v, out=None):
        raise NotImplementedError(
            "The npu target's MLA prefills run inside the Ascend MLA backend "
            f"({ASCEND_MLA_NAME}: AscendMLAImpl.forward_mha), not through vLLM's prefill "
            "backends; select that attention backend."
        )


class AscendMLAImpl(MLACommonImpl[MLACommonMetadata]):
    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                 kv_sharing_target_layer_name, **mla_args) -> None:
        unsupported = {
            "alibi_slopes": alibi_slopes,
            "sliding_window": sliding_window,
            "logits_soft_cap": logits_soft_cap or None,
        }
        for name, given in unsupported.items():
            if given is not None:
                raise NotImplementedError(
                    f"The Ascend MLA backend does not implement {name} (got {given!r})."
                )
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(
                f"The Ascend MLA backend computes decoder attention only, got "
                f"attn_type={attn_type!r}."
            )
        if kv_cache_dtype not in AscendMLABackend.supported_kv_cache_dtypes:
            raise NotImplementedError(
                f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the Ascend MLA "
                "backend; use 'auto' (the model's float16/bfloat16)."
            )
        if mla_args.get("indexer") is not None:
            raise NotImplementedError(
                "Sparse MLA (an indexer, DeepSeek-V3.2) is not supported by the Ascend MLA "
                "backend."
            )
        check_mla_shape(mla_args["kv_lora_rank"], mla_args["qk_rope_head_dim"])
        self.padded_heads = padded_head_count(num_heads)
        self.dense_heads = dense_head_count(num_heads)
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        if self.dcp_world_size > 1:
            raise NotImplementedError(
                "Decode context parallelism is not supported by the Ascend MLA backend."
            )
        # No fp8 query: the fused op's MLA form takes float16/bfloat16.
        self.supports_quant_query_input = False
        self._use_flashinfer_concat_mla_k = False
        # Under FULL decode graphs the slot mapping is vLLM's padded one, -1 for padding.
        self.pad_slots_to_null_block = _full_graphs_configured()

    def split_cache(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's pages as the latent plane ``(num_blocks, block_size, 512)`` and the
        rope plane ``(num_blocks, block_size, 64)``, both contiguous, over the same memory."""
        width = self.kv_lora_rank + self.qk_rope_head_dim
        if kv_cache.dim() != 3 or kv_cache.shape[2] != width or not kv_cache.is_contiguous():
            raise ValueError(
                f"KV cache of shape {tuple(kv_cache.shape)} (contiguous: "
                f"{kv_cache.is_contiguous()}); the Ascend MLA backend expects vLLM's "
                f"contiguous [num_blocks, block_size, {width}] MLA pages."
            )
        num_blocks, block_size, _ = kv_cache.shape
        flat = kv_cache.view(-1)
        latent_size = num_blocks * block_size * self.kv_lora_rank
        latent = flat[:latent_size].view(num_blocks, block_size, self.kv_lora_rank)
        rope = flat[latent_size:].view(num_blocks, block_size, self.qk_rope_head_dim)
        return latent, rope

    def do_kv_cache_update(self, kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype,
                           k_scale) -> None:
        import torch_npu

        if kv_cache.numel() == 0:
            return
        latent_cache, rope_cache = self.split_cache(kv_cache)
        num_blocks, block_size, _ = latent_cache.shape
        tokens = slot_mapping.shape[0]
        latent = kv_c_normed[:tokens].reshape(tokens, 1, self.kv_lora_rank)
        rope = k_pe[:tokens].reshape(tokens, 1, self.qk_rope_head_dim)
        if self.pad_slots_to_null_block and tokens <= block_size:
            # As AscendAttentionImpl.do_kv_cache_update: padding token i (slot -1) writes
            # slot i of vLLM's null block, which no request reads; no host sync, so a graph
            # can hold it (the platform caps captured sizes at one block of tokens).
            pad_slots = torch.arange(tokens, dtype=slot_mapping.dtype,
                                     device=slot_mapping.device)
            slot_mapping = torch.where(slot_mapping < 0, pad_slots, slot_mapping)
        else:  # eager; above one block (never captured) slot i would be a request's
            valid = slot_mapping >= 0
            if not bool(valid.all()):  # padding tokens (slot -1) write nothing
                latent, rope, slot_mapping = latent[valid], rope[valid], slot_mapping[valid]
        torch_npu.npu_scatter_pa_kv_cache(
            latent.to(latent_cache.dtype).contiguous(),
            rope.to(rope_cache.dtype).contiguous(),
            latent_cache.view(num_blocks, block_size, 1, self.kv_lora_rank),
            rope_cache.view(num_blocks, block_size, 1, self.qk_rope_head_dim),
            slot_mapping,
            cache_mode="Norm",
        )

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    k_scale: torch.Tensor, output: torch.Tensor,
                    output_scale: torch.Tensor | None = None) -> None:
        """Dense-MHA attention of the batch's prefill tokens. ``q``: ``[T, N, nope +
        rope]``; ``kv_c_normed`` ``[T, 512]`` and ``k_pe`` ``[T, (1,) 64]``: the new tokens'
        latent and rope rows; writes ``output`` ``[T, N * v_head_dim]``."""
        import torch_npu

        meta = attn_metadata.prefill
        if not isinstance(meta, AscendMLAPrefillMetadata):
            raise TypeError(
                "The Ascend MLA backend's dense prefill needs its own prefill metadata, got "
                f"{type(meta).__name__}."
            )
        if output_scale is not None:
            raise NotImplementedError(
                "The Ascend MLA backend's dense prefill does not fuse output quantization.")
        if torch.npu.is_current_stream_capturing():
            raise RuntimeError(
                "An NPU graph is capturing an MLA prefill (query lengths "
                f"{meta.query_lens}): the fused op's host lengths would stay frozen in the "
                "graph. Only uniform decode batches can be captured.")
        tokens, heads = q.shape[0], self.num_heads
        if tokens != meta.cumulative_query_lens[-1]:
            raise ValueError(f"forward_mha got {tokens} query tokens, the metadata "
                             f"{meta.cumulative_query_lens[-1]}.")
        nope, rope_dim, v_dim = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        latent = kv_c_normed[:tokens]
        rope = k_pe[:tokens].reshape(tokens, rope_dim)
        if meta.context_slots is not None:
            latent_cache, rope_cache = self.split_cache(kv_c_and_k_pe_cache)
            slots = meta.context_slots
            latent = torch.cat([latent_cache.view(-1, self.kv_lora_rank)[slots],
                                latent.to(latent_cache.dtype)])[meta.key_order]
            rope = torch.cat([rope_cache.view(-1, rope_dim)[slots],
                              rope.to(rope_cache.dtype)])[meta.key_order]
        kv_nope = self.kv_b_proj(latent)[0].view(-1, heads, nope + v_dim)
        k_nope, value_part = kv_nope.split([nope, v_dim], dim=-1)
        keys = kv_nope.shape[0]

        # The dense form's shapes: nope and value heads zero-padded to 128, heads to the
        # next allowed count. Zeros add nothing to a score; padded outputs are dropped.
        padded, qk_dim = self.dense_heads, DENSE_NOPE_DIM + rope_dim
        query = q.new_zeros(tokens, padded, qk_dim, dtype=DENSE_DTYPE)
        query[:, :heads, :nope] = q[..., :nope]
        query[:, :heads, DENSE_NOPE_DIM:] = q[..., nope:]
        key = q.new_zeros(keys, padded, qk_dim, dtype=DENSE_DTYPE)
        key[:, :heads, :nope] = k_nope
        key[:, :heads, DENSE_NOPE_DIM:] = rope.unsqueeze(1)
        value = q.new_zeros(keys, padded, DENSE_VALUE_DIM, dtype=DENSE_DTYPE)
        value[:, :heads, :v_dim] = value_part
        out, _ = torch_npu.npu_fused_infer_attention_score(
            query, key, value,
            atten_mask=meta.attn_mask,
            actual_seq_lengths=meta.cumulative_query_lens,
            actual_seq_lengths_kv=meta.cumulative_kv_lens,
            num_heads=padded,
            num_key_value_heads=padded,
            scale=self.scale,
            input_layout="TND",
            sparse_mode=SPARSE_MODE_RIGHT_DOWN_CAUSAL,
        )
        output.view(tokens, heads, v_dim).copy_(out[:, :heads, :v_dim])

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: MLACommonMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, None]:
        """``q``: ``(q_latent [T, N, 512], q_rope [T, N, 64])`` or their concatenation;
        returns ``([T, N, 512], None)``, the attention over latent rows that vLLM then
        up-projects with ``W_UV``."""
        import torch_npu

        meta = attn_metadata.decode
        if not isinstance(meta, AscendMLADecodeMetadata):
            raise TypeError(
                f"The Ascend MLA backend needs its own metadata, got {type(meta).__name__}."
            )
        if isinstance(q, tuple):
            q_latent, q_rope = q
        else:
            q_latent, q_rope = q.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        tokens, heads = q_latent.shape[0], q_latent.shape[1]
        if tokens != meta.num_tokens:
            raise ValueError(f"forward_mqa got {tokens} query tokens, the metadata "
                             f"{meta.num_tokens}.")
        latent_cache, rope_cache = self.split_cache(kv_c_and_k_pe_cache)
        rows, row_len, padded = meta.rows, meta.row_len, self.padded_heads

        def bsnd(part: torch.Tensor) -> torch.Tensor:
            width = part.shape[-1]
            full = part.new_zeros(rows * row_len, padded, width)
            if meta.token_rows is None:
                full[:, :heads] = part
            else:
                full[meta.token_rows, :heads] = part
            return full.view(rows, row_len, padded, width)

        capturing = torch.npu.is_current_stream_capturing()
        if capturing and not meta.graph_decode:
            raise RuntimeError(
                "An NPU graph is capturing an MLA batch whose metadata is not the graph kind "
                f"(row query lengths {meta.row_query_lens}): the fused op's host lengths "
                "would stay frozen in the graph. Only uniform decode batches under FULL "
                "decode graphs can be captured.")
        query = bsnd(q_latent)
        kwargs = dict(
            query_rope=bsnd(q_rope),
            key_rope=rope_cache,
            atten_mask=meta.attn_mask,
            actual_seq_lengths=meta.row_query_lens,
            actual_seq_lengths_kv=meta.row_kv_lens,
            block_table=meta.row_block_table,
            block_size=latent_cache.shape[1],
            num_heads=padded,
            num_key_value_heads=1,
            scale=self.scale,
            input_layout="BSND",
            sparse_mode=meta.sparse_mode,
        )
        if capturing:
            out = self._capture_uniform_batch(layer, query, latent_cache, kwargs, meta)
        else:
            out, _ = torch_npu.npu_fused_infer_attention_score(
                query, latent_cache, latent_cache, **kwargs)
        flat = out.view(rows * row_len, padded, self.kv_lora_rank)
        if meta.token_rows is not None:
            flat = flat[meta.token_rows]
        return flat[:, :heads].contiguous(), None

    def _capture_uniform_batch(self, layer, query, latent_cache, kwargs,
                               meta: AscendMLADecodeMetadata) -> torch.Tensor:
        """The fused op's MLA form as ``.out`` in a graph task group; returns its output
        buffer, which every replay refills with the step's lengths."""
        from ascend_core.attention.npu_graph_tasks import capture_fused_attention

        out = torch.empty(query.shape[:-1] + (self.kv_lora_rank,), dtype=query.dtype,
                          device=query.device)
        lse = torch.empty(1, dtype=torch.float32, device=query.device)

        def host_arguments(step: MLACommonMetadata) -> dict:
            decode = step.decode
            if not isinstance(decode, AscendMLADecodeMetadata) or (
                    decode.rows, decode.row_len, decode.graph_decode,
                    decode.row_block_table.data_ptr()) != (
                    meta.rows, meta.row_len, True, meta.row_block_table.data_ptr()):
                raise ValueError(
                    f"An MLA graph captured for {meta.rows} rows of {meta.row_len} tokens is "
                    f"replayed for other metadata ({decode!r:.200}); vLLM's dispatcher "
                    "should have picked another graph or run eagerly.")
            return {"actual_seq_lengths": decode.row_query_lens,
                    "actual_seq_lengths_kv": decode.row_kv_lens}

        capture_fused_attention(getattr(layer, "layer_name", None),
                                (query, latent_cache, latent_cache), kwargs, [out, lse],
                                host_arguments)
        return out


def select_mla_backend(selected_backend, config, path: str) -> str:
    """The npu platform's answer for an MLA model: this backend, or a clear error saying
    why it cannot run the model's attention (``config``: vLLM's selector config)."""
    ours = AscendMLABackend.get_name()
    if selected_backend is not None and selected_backend.name != ours:
        raise ValueError(
            f"Attention backend {selected_backend.name} was requested for an MLA model on "
            f"the npu target, which has only {ours}; leave the attention backend unset."
        )
    if config.use_sparse:
        raise NotImplementedError(
            "Sparse MLA (DeepSeek-V3.2's indexer) is not supported by the Ascend MLA backend."
        )
    reasons = configuration_problems(AscendMLABackend, config)
    if reasons:
        raise ValueError(
            f"The Ascend MLA backend cannot run this model's attention ({config}): "
            f"{'; '.join(reasons)}. It takes float16/bfloat16 MLA with a latent cache of "
            f"{KV_LORA_RANK} + {ROPE_DIM} (head size {SUPPORTED_HEAD_SIZE}) and block sizes "
            f"{list(SUPPORTED_BLOCK_SIZES)}."
        )
    return path
