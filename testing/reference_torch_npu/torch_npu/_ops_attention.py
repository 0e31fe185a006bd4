"""torch_npu's paged KV-cache write and fused inference attention, on CPU tensors.

The same rules as ``torch_npu._ops``: each function follows its Ascend/op-plugin
``docs/context/`` page (argument names, shapes, dtype rules; the Atlas A2/A3 rows, the
modelled machine being an Ascend 910B), raises ``RuntimeError`` on what the page rules
out and ``NotImplementedError`` on what it documents but the reference does not model (the
errors of ``torch_npu._ops``). Attention is computed in float32 and cast once to the query's dtype.

Modelled forms:

- ``npu_scatter_pa_kv_cache`` with ``cache_mode="Norm"``: 3-D ``key``/``value`` of
  ``[tokens, num_head, head_size]`` scattered by ``slot_mapping`` into ND caches of
  ``[num_blocks, block_size, num_head, head_size]``.
- ``npu_fused_infer_attention_score`` in ``"BSND"``, ``"BSH"`` and ``"BNSD"``: page
  attention (``block_table`` and ``block_size``; the caches as ``(num_blocks, block_size,
  H)``, or, for a BNSD query, also ``(num_blocks, KV_N, block_size, D)``) or dense
  key/value; per-batch ``actual_seq_lengths`` / ``actual_seq_lengths_kv``;
  GQA through ``num_key_value_heads``; ``sparse_mode`` 0-4 (full masks, causal modes with
  the compressed 2048 x 2048 mask, bands from ``pre_tokens`` / ``next_tokens``);
  optionally the softmax log-sum-exp; int8 key/value through the antiquant arguments
  (``torch_npu._ops_attention_antiquant``). The TND layouts are in
  ``torch_npu._ops_attention_tnd``.
- the same op's MLA form (``query_rope`` and ``key_rope``) in BSND / BSH: query D 512 with
  a rope part of 64, one latent KV head read as both key and value from a paged
  ``(num_blocks, block_size, 512)`` cache beside a ``(num_blocks, block_size, 64)`` rope
  cache, 32/64/128 query heads, 1 to 16 query tokens per batch.
"""

from __future__ import annotations

import inspect
import math

import torch

from torch_npu._ops import _require_tensor

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_INT_MAX = 2147483647
_COMPRESSED_MASK_SIDE = 2048
_MASK_DTYPES = (torch.bool, torch.int8, torch.uint8)


def _require_contiguous(name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise RuntimeError(f"{name} is not contiguous; the page rules out non-contiguous "
                           "tensors.")


def _require_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    return value


def _check_block_table(block_table, batch: int) -> None:
    _require_tensor("block_table", block_table)
    if block_table.dtype != torch.int32 or block_table.dim() != 2 \
            or block_table.shape[0] != batch:
        raise RuntimeError(f"block_table has dtype {block_table.dtype} and shape "
                           f"{tuple(block_table.shape)}; it must be int32 [B={batch}, "
                           "max blocks per batch].")


# --- npu_scatter_pa_kv_cache --------------------------------------------------------------


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode="PA_NZ"):
    """``torch_npu.npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping,
    *, compress_lens=None, compress_seq_offsets=None, seq_lens=None, cache_mode='PA_NZ')``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_scatter_pa_kv_cache.md`` and, for
    the ND ("Norm") cache shapes that page names only through ``cache_mode``, the
    aclnnScatterPaKvCache page of CANN's ops-transformer (its "Norm" scenario):

    - ``key``: ``[tokens, num_head, k_head_size]``; ``value``: ``[tokens, num_head,
      v_head_size]`` of ``key``'s dtype; contiguous.
    - ``key_cache``: ``[num_blocks, block_size, num_head, k_head_size]``, ``value_cache``:
      ``[num_blocks, block_size, num_head, v_head_size]``, the dtype of ``key``.
    - ``slot_mapping``: int32 or int64, ``[tokens]``, values in ``[0, num_blocks *
      block_size - 1]`` and unique (the page does not guarantee duplicates).
    - ``cache_mode``: ``"Norm"`` (or None), or ``"PA_NZ"`` (the default): caches cast to
      FRACTAL_NZ (``npu_format_cast(cache, 29)``) of ``[num_blocks, num_head * head_size //
      L, block_size, L]`` with ``L`` the elements of 32 bytes (16 for float16/bfloat16, 32
      for int8), the page's first scenario. The compression arguments (4-D keys) are not
      modelled.

    Token ``t`` goes to block ``slot // block_size`` at offset ``slot % block_size``; in
    PA_NZ its ``num_head * head_size`` values are cut into rows of ``L``, row ``c`` to
    ``cache[block, c, offset, :]`` (the real op's test golden). Updates the caches in place
    and returns None.
    """
    if cache_mode not in (None, "Norm", "PA_NZ"):
        raise RuntimeError(f"cache_mode={cache_mode!r}: the page allows None, 'Norm' or "
                           "'PA_NZ'.")
    for name, extra in (("compress_lens", compress_lens),
                        ("compress_seq_offsets", compress_seq_offsets),
                        ("seq_lens", seq_lens)):
        if extra is not None:
            raise NotImplementedError(f"{name} (the compressing 4-D scenario) is not modelled "
                                      "by the reference torch_npu.")
    for name, tensor in (("key", key), ("value", value), ("key_cache", key_cache),
                         ("value_cache", value_cache), ("slot_mapping", slot_mapping)):
        _require_tensor(name, tensor)
        _require_contiguous(name, tensor)
    if key.dim() != 3 or value.dim() != 3:
        raise RuntimeError(f"key and value must be 3-D [tokens, num_head, head_size] in the "
                           f"modelled scenario, got {tuple(key.shape)} and "
                           f"{tuple(value.shape)}.")
    if key.shape[:2] != value.shape[:2]:
        raise RuntimeError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must agree "
                           "in their first two dims.")
    for name, tensor in (("value", value), ("key_cache", key_cache),
                         ("value_cache", value_cache)):
        if tensor.dtype != key.dtype:
            raise RuntimeError(f"{name} has dtype {tensor.dtype} but key has {key.dtype}; the "
                               "page requires identical dtypes.")
    nz = cache_mode == "PA_NZ"
    row = 32 // key.element_size()  # elements per 32-byte row of an NZ cache
    for name, cache, source in (("key_cache", key_cache, key),
                                ("value_cache", value_cache, value)):
        hidden = source.shape[1] * source.shape[2]
        if nz:
            if hidden % row or cache.dim() != 4 or cache.shape[1] != hidden // row \
                    or cache.shape[3] != row:
                raise RuntimeError(f"{name} has shape {tuple(cache.shape)}; with cache_mode="
                                   f"'PA_NZ' it must be [num_blocks, num_head * head_size // "
                                   f"{row} = {hidden / row:g}, block_size, {row}] (num_head * "
                                   f"head_size = {hidden} a multiple of {row}).")
        elif cache.dim() != 4 or cache.shape[2:] != source.shape[1:]:
            raise RuntimeError(f"{name} has shape {tuple(cache.shape)}; with cache_mode='Norm' "
                               "it must be [num_blocks, block_size, "
                               f"{source.shape[1]}, {source.shape[2]}].")
    block_dim = 2 if nz else 1
    if (key_cache.shape[0], key_cache.shape[block_dim]) != (
            value_cache.shape[0], value_cache.shape[block_dim]):
        raise RuntimeError(f"key_cache {tuple(key_cache.shape)} and value_cache "
                           f"{tuple(value_cache.shape)} must have equal num_blocks and "
                           "block_size.")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"slot_mapping has dtype {slot_mapping.dtype}; it must be int32 or "
                           "int64.")
    if slot_mapping.shape != (key.shape[0],):
        raise RuntimeError(f"slot_mapping has shape {tuple(slot_mapping.shape)}; it must be "
                           f"({key.shape[0]},), one slot per token of key.")
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[block_dim]
    slots = slot_mapping.long()
    if slots.numel():
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= num_blocks * block_size:
            raise RuntimeError(f"slot_mapping holds values in [{low}, {high}]; they must lie in "
                               f"[0, {num_blocks * block_size - 1}] (num_blocks * block_size - "
                               "1). Drop padding tokens before the call.")
        if slots.unique().numel() != slots.numel():
            raise RuntimeError("slot_mapping holds duplicate slots; the page requires unique "
                               "values.")
    if nz:
        blocks, offsets = slots // block_size, slots % block_size
        for cache, source in ((key_cache, key), (value_cache, value)):
            rows = source.reshape(source.shape[0], cache.shape[1], row)  # [tokens, H / L, L]
            cache[blocks, :, offsets] = rows
        return None
    key_cache.view(-1, *key_cache.shape[2:])[slots] = key
    value_cache.view(-1, *value_cache.shape[2:])[slots] = value
    return None


# --- npu_fused_infer_attention_score ------------------------------------------------------

_ANTIQUANT_ARGUMENTS = ("antiquant_scale", "antiquant_offset", "key_antiquant_scale",
                        "key_antiquant_offset", "value_antiquant_scale",
                        "value_antiquant_offset")

# Arguments the page documents that the reference does not model in every form (the
# antiquant ones only with int8 key/value in the BSH/BSND/BNSD forms).
_UNMODELLED_FIA_ARGUMENTS = (
    "pse_shift", "dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
    "quant_offset2", "antiquant_scale", "antiquant_offset", "query_padding_size",
    "kv_padding_size", "key_antiquant_scale", "key_antiquant_offset",
    "value_antiquant_scale", "value_antiquant_offset", "key_shared_prefix",
    "value_shared_prefix", "actual_shared_prefix_len", "key_rope_antiquant_scale",
)


def _per_batch_lengths(name: str, lengths, batch: int, limit: int | None) -> list[int]:
    """The page's rule for non-TND layouts: one value for every batch, or at least B values
    of which the first B are used; each in [0, limit]."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if not isinstance(lengths, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in lengths):
        raise TypeError(f"{name} must be a list of ints, got {lengths!r}.")
    if len(lengths) == 1:
        lengths = list(lengths) * batch
    elif len(lengths) < batch:
        raise RuntimeError(f"{name} has {len(lengths)} values for a batch of {batch}; the page "
                           "allows 1 value or at least B.")
    lengths = list(lengths[:batch])
    for b, length in enumerate(lengths):
        if length < 0 or (limit is not None and length > limit):
            bound = f"[0, {limit}]" if limit is not None else "non-negative"
            raise RuntimeError(f"{name}[{b}] = {length}; it must be {bound}.")
    return lengths


def _check_compressed_causal_mask(atten_mask, mode: int = 3) -> None:
    _require_tensor("atten_mask", atten_mask)
    side = _COMPRESSED_MASK_SIDE
    if atten_mask.dtype not in _MASK_DTYPES:
        raise RuntimeError(f"atten_mask has dtype {atten_mask.dtype}; the page allows bool, int8 "
                           "and uint8.")
    if atten_mask.shape not in ((side, side), (1, side, side), (1, 1, side, side)):
        raise RuntimeError(f"atten_mask has shape {tuple(atten_mask.shape)}; with "
                           f"sparse_mode={mode} "
                           f"it must be the compressed ({side}, {side}) mask (or with leading "
                           "1s).")
    expected = torch.triu(torch.ones(side, side, dtype=torch.bool), diagonal=1)
    if not torch.equal(atten_mask.reshape(side, side).bool(), expected):
        raise RuntimeError(f"atten_mask is not the compressed causal mask: with sparse_mode={mode} "
                           "it must hold 1 strictly above the diagonal (not computed) and 0 "
                           "elsewhere, i.e. torch.triu(torch.ones(2048, 2048), diagonal=1).")


def _check_table_covers(block_table, kv_lengths: list[int], block: int,
                        num_blocks: int) -> None:
    """Each batch's blocks (for its key/value length) are named in its row of the table, and
    name blocks the caches hold."""
    blocks_per_batch = [-(-length // block) for length in kv_lengths]
    if max(blocks_per_batch, default=0) > block_table.shape[1]:
        raise RuntimeError(f"block_table has {block_table.shape[1]} columns but a batch needs "
                           f"{max(blocks_per_batch)} blocks for actual_seq_lengths_kv "
                           f"{kv_lengths} and block_size {block}.")
    for b, count in enumerate(blocks_per_batch):
        ids = block_table[b, :count]
        if count and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
            raise RuntimeError(f"block_table[{b}] names blocks {ids.tolist()} outside [0, "
                               f"{num_blocks - 1}].")


def _blocks_by_token(cache: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A ``(num_blocks, KV_N, block_size, D)`` cache as ``(num_blocks, block_size, KV_N *
    D)``; any other shape as it is (the layout check names what is allowed)."""
    if cache.dim() == 4 and cache.shape[1] == kv_heads:
        return cache.transpose(1, 2).reshape(cache.shape[0], cache.shape[2], -1)
    return cache


def _paged_sequence(cache: torch.Tensor, table_row: torch.Tensor, length: int,
                    block_size: int, kv_heads: int) -> torch.Tensor:
    """``length`` tokens of one batch from a ``(num_blocks, block_size, H)`` cache, as
    ``[length, kv_heads, D]``."""
    num_blocks_needed = -(-length // block_size)
    blocks = cache[table_row[:num_blocks_needed].long()]
    return blocks.reshape(-1, kv_heads, cache.shape[-1] // kv_heads)[:length]


def npu_fused_infer_attention_score(query, key, value, *, pse_shift=None, atten_mask=None,
                                    actual_seq_lengths=None, actual_seq_lengths_kv=None,
                                    dequant_scale1=None, quant_scale1=None,
                                    dequant_scale2=None, quant_scale2=None,
                                    quant_offset2=None, antiquant_scale=None,
                                    antiquant_offset=None, key_antiquant_scale=None,
                                    key_antiquant_offset=None, value_antiquant_scale=None,
                                    value_antiquant_offset=None, block_table=None,
                                    query_padding_size=None, kv_padding_size=None,
                                    key_shared_prefix=None, value_shared_prefix=None,
                                    actual_shared_prefix_len=None, query_rope=None,
                                    key_rope=None, key_rope_antiquant_scale=None,
                                    num_heads=1, scale=1.0, pre_tokens=_INT_MAX,
                                    next_tokens=_INT_MAX, input_layout="BSH",
                                    num_key_value_heads=0, sparse_mode=0, inner_precise=0,
                                    block_size=0, antiquant_mode=0, key_antiquant_mode=0,
                                    value_antiquant_mode=0, softmax_lse_flag=False):
    """``torch_npu.npu_fused_infer_attention_score(query, key, value, *, ...) ->
    (attention_out, softmax_lse)``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md``;
    ``attention_out = softmax(scale * query @ key^T + atten_mask) @ value``. The keyword
    arguments are in the order of op-plugin's schema (the page lists ``block_table`` and
    ``softmax_lse_flag`` elsewhere; keyword-only, so calls are the same). Modelled:

    - page attention: ``block_table`` (int32, ``[B, >= max blocks per batch]``) and
      ``block_size`` (a multiple of 16 when Q_S = 1, of 32 for int8 caches; 128 to 512 in
      steps of 128 when Q_S > 1), ``key``/``value`` the caches as ``(num_blocks,
      block_size, H)`` with ``H = num_key_value_heads * D`` (at most 65535),
      ``actual_seq_lengths_kv`` required; or dense ``key``/``value`` in the query's layout;
    - ``input_layout`` ``"BSND"`` (query ``[B, Q_S, N, D]``), ``"BSH"`` (``[B, Q_S,
      N * D]``) or ``"BNSD"`` (dense only); ``query``, ``key``, ``value`` float16 or
      bfloat16 of one dtype (or int8 key/value with antiquant scales), D a
      multiple of 16 up to 512, N up to 256. The TND layouts (``"TND"``, ``"TND_NTD"``,
      ``"NTD_TND"``) are modelled in ``torch_npu._ops_attention_tnd`` (see there);
    - ``num_heads`` = N; ``num_key_value_heads`` dividing it (0: equal), ratio at most 64;
    - ``actual_seq_lengths``: per batch (non-cumulative for these layouts), one value or
      at least B, each at most Q_S; ignored when Q_S = 1 as the page says. Rows of a batch
      past its actual length are padding: the page leaves them open, the reference
      returns zeros there;
    - ``sparse_mode`` 0 with no ``atten_mask`` (no masking, ``pre_tokens`` /
      ``next_tokens`` ignored) or with the full mask (True / 1: not computed) in the page's
      shapes, its S dims possibly padded up, and then a band of ``pre_tokens`` keys before
      and ``next_tokens`` after the diagonal counted from the top-left corner (row i sees
      keys i - pre_tokens .. i + next_tokens) when they are not their defaults; 1 (the
      full mask required; pre/next ignored); 2 (leftUpCausal: row i sees keys j <= i) and
      3 (rightDownCausal: j <= i + k - q) with the compressed 2048 x 2048 mask (pre/next
      ignored); 4 (band with the compressed mask: keys from ``i + k - q - pre_tokens`` to
      ``i + k - q + next_tokens``, counted from the bottom-right corner, CANN's
      sparseMode introduction); a band must not be empty (``pre_tokens + next_tokens >=
      0``). With page attention a full mask's KV_S is at least the longest batch's blocks
      times ``block_size`` and its columns are the batch's logical key positions. When
      Q_S = 1 the page makes ``sparse_mode`` and the band ineffective: the query sees all its
      keys, less what a decode mask ``(B, KV_S)`` / ``(B, 1, KV_S)`` / ``(B, 1, 1, KV_S)``
      hides;
    - ``inner_precise`` 0-3 (precision and row-invalid switches: one float32 result here;
      rows left with no key to attend raise instead);
    - ``softmax_lse_flag``: the log-sum-exp of the scaled, masked scores, float32 ``(B, N,
      Q_S, 1)`` (0 on padding rows); when False a one-element zero tensor, as the page says.

    With ``query_rope`` and ``key_rope`` the op takes its MLA form, modelled by
    ``_mla_page_attention`` (see there).

    int8 ``key``/``value`` with the antiquant arguments are dequantised inside the op
    (``torch_npu._ops_attention_antiquant``). Every other quantization, prefix,
    padding-size and pse argument raises ``NotImplementedError``; so do int4 (int32) keys.
    """
    given = locals()
    if input_layout in ("TND", "TND_NTD", "NTD_TND"):
        from torch_npu._ops_attention_tnd import tnd_attention
        return tnd_attention(given)
    if query_rope is not None or key_rope is not None:
        return _mla_page_attention(given)
    for name in _UNMODELLED_FIA_ARGUMENTS:
        if given[name] is not None and name not in _ANTIQUANT_ARGUMENTS:
            raise NotImplementedError(
                f"{name} is not modelled by the reference npu_fused_infer_attention_score; "
                "it models float16/bfloat16 attention (int8 key/value through the antiquant "
                "arguments) without full quantization, pse, prefix or padding arguments.")
    for name, tensor in (("query", query), ("key", key), ("value", value)):
        _require_tensor(name, tensor)
        _require_contiguous(name, tensor)
        if name != "query" and tensor.dtype in (torch.int8, torch.int32):
            if tensor.dtype == torch.int32:
                raise NotImplementedError(f"torch_npu.npu_fused_infer_attention_score: {name} "
                                          "in int32 (int4 packed, the page's int4 antiquant) "
                                          "is not modelled by the reference torch_npu.")
            continue
        if tensor.dtype == torch.int8:
            raise NotImplementedError(f"{name} in int8 (quantized attention) is not modelled "
                                      "by the reference torch_npu.")
        if tensor.dtype not in _HALF_DTYPES:
            raise RuntimeError(f"{name} has dtype {tensor.dtype}; the page allows float16 and "
                               "bfloat16 (and int8 for key/value).")
    quantized = key.dtype == torch.int8
    if quantized != (value.dtype == torch.int8):
        raise RuntimeError(f"key ({key.dtype}) and value ({value.dtype}) must both be int8 or "
                           "both the query's dtype.")
    if not quantized and (key.dtype != query.dtype or value.dtype != query.dtype):
        raise RuntimeError(f"query ({query.dtype}), key ({key.dtype}) and value ({value.dtype}) "
                           "must share one dtype when key and value are not int8.")

    if input_layout not in ("BSND", "BSH", "BNSD"):
        raise NotImplementedError(f"input_layout={input_layout!r} is not modelled; the "
                                  "reference models 'BSND', 'BSH' and 'BNSD'.")
    heads = _require_int("num_heads", num_heads)
    kv_heads = _require_int("num_key_value_heads", num_key_value_heads) or heads
    if heads < 1 or heads > 256:
        raise RuntimeError(f"num_heads={heads}; it must be in [1, 256].")
    if heads % kv_heads or heads // kv_heads > 64:
        raise RuntimeError(f"num_heads={heads} and num_key_value_heads={kv_heads}: num_heads "
                           "must be a multiple of num_key_value_heads, at most 64 times it.")
    if input_layout in ("BSND", "BNSD"):
        head_axis = 2 if input_layout == "BSND" else 1
        if query.dim() != 4 or query.shape[head_axis] != heads:
            shape = "[B, Q_S, N, D]" if input_layout == "BSND" else "[B, N, Q_S, D]"
            raise RuntimeError(f"query has shape {tuple(query.shape)}; with input_layout="
                               f"{input_layout!r} it must be {shape} with N = num_heads="
                               f"{heads}.")
        head_dim = query.shape[3]
    else:
        if query.dim() != 3 or query.shape[2] % heads:
            raise RuntimeError(f"query has shape {tuple(query.shape)}; with input_layout='BSH' "
                               f"it must be [B, Q_S, H] with H a multiple of num_heads={heads}.")
        head_dim = query.shape[2] // heads
    batch = query.shape[0]
    q_s = query.shape[2] if input_layout == "BNSD" else query.shape[1]
    if quantized and q_s > 1 and head_dim % 32:
        raise RuntimeError(f"head dim D={head_dim} with int8 key/value and Q_S > 1; the page "
                           "needs D 32-aligned there.")
    if head_dim % 16 or head_dim > 512:
        raise RuntimeError(f"head dim D={head_dim}; with float16/bfloat16 inputs it must be a "
                           "multiple of 16 and at most 512.")

    if block_table is None:
        dense = _dense_key_value(key, value, input_layout, batch, kv_heads, head_dim)
        kv_s = dense[0].shape[1]
        kv_lengths = ([kv_s] * batch if actual_seq_lengths_kv is None else _per_batch_lengths(
            "actual_seq_lengths_kv", actual_seq_lengths_kv, batch, kv_s))
    else:
        if input_layout == "BNSD":
            # The page: a BNSD (or TND) query also takes (num_blocks, KV_N, block_size, D)
            # caches; BSH / BSND queries take (num_blocks, block_size, H) only.
            key, value = _blocks_by_token(key, kv_heads), _blocks_by_token(value, kv_heads)
        dense = None
        kv_lengths = _check_paged_key_value(key, value, block_table, block_size,
                                            actual_seq_lengths_kv, batch, q_s, kv_heads,
                                            head_dim, quantized)
        # A full mask with page attention spans the blocks of the longest batch (the page:
        # KV_S >= maxBlockNumPerSeq * blockSize); its columns are the logical positions.
        kv_s = -(-max(kv_lengths, default=0) // block_size) * block_size
    if actual_seq_lengths is None or q_s == 1:
        q_lengths = [q_s] * batch
    else:
        q_lengths = _per_batch_lengths("actual_seq_lengths", actual_seq_lengths, batch, q_s)

    mode = _require_int("sparse_mode", sparse_mode)
    if mode not in (0, 1, 2, 3, 4):
        raise RuntimeError(f"sparse_mode={mode}; the page allows 0 to 4.")
    # a [B, Q_S, KV_S] bool mask (True: not computed); a causal mode; a band (pre, next)
    full_mask = causal = band = None
    pre = _require_int("pre_tokens", pre_tokens)
    nxt = _require_int("next_tokens", next_tokens)
    if q_s == 1:  # the page: sparse_mode, pre_tokens and next_tokens have no effect at Q_S 1
        if atten_mask is not None:
            full_mask = _full_atten_mask(atten_mask, batch, 1, kv_s, decode=True)
    elif mode in (0, 1):
        if atten_mask is not None:
            full_mask = _full_atten_mask(atten_mask, batch, q_s, kv_s, decode=False)
            if mode == 0 and (pre, nxt) != (_INT_MAX, _INT_MAX):
                _check_band(pre, nxt, mode)
                band = ("leftUp", pre, nxt)   # defaultMask: counted from the top-left corner
        elif mode == 1:
            raise RuntimeError("sparse_mode=1 (allMask) needs the full atten_mask (Q_S x KV_S).")
    elif mode in (2, 3, 4):
        if atten_mask is None:
            raise RuntimeError(f"sparse_mode={mode} needs the compressed (2048, 2048) "
                               "atten_mask.")
        _check_compressed_causal_mask(atten_mask, mode)
        if mode == 4:
            _check_band(pre, nxt, mode)
            band = ("rightDown", pre, nxt)        # band: counted from the bottom-right corner
        else:
            causal = mode
    from torch_npu._ops_attention_antiquant import kv_dequantizers
    dequant = kv_dequantizers(given, input_layout, batch, kv_heads, head_dim, q_s,
                              kv_s,
                              dense is None, quantized)
    if _require_int("inner_precise", inner_precise) not in (0, 1, 2, 3):
        raise RuntimeError(f"inner_precise={inner_precise}; the page allows 0 to 3.")
    if q_s == 1 and inner_precise not in (0, 1):
        raise RuntimeError(f"inner_precise={inner_precise} with Q_S = 1; the page allows 0 or 1.")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}.")
    if not isinstance(softmax_lse_flag, bool):
        raise TypeError(f"softmax_lse_flag must be a bool, got "
                        f"{type(softmax_lse_flag).__name__}.")

    if input_layout == "BNSD":
        q_all = query.transpose(1, 2).float()              # [B, Q_S, N, D]
    else:
        q_all = query.reshape(batch, q_s, heads, head_dim).float()
    out = torch.zeros(batch, q_s, heads, head_dim, dtype=torch.float32)
    lse = torch.zeros(batch, heads, q_s, 1, dtype=torch.float32)
    group = heads // kv_heads
    for b in range(batch):
        q_len, kv_len = q_lengths[b], kv_lengths[b]
        if q_len == 0:
            continue
        if kv_len == 0:
            continue  # the page: empty keys give zero output
        if dense is not None:
            keys, values = dense[0][b, :kv_len], dense[1][b, :kv_len]
        else:
            block = block_size
            keys = _paged_sequence(key, block_table[b], kv_len, block, kv_heads)
            values = _paged_sequence(value, block_table[b], kv_len, block, kv_heads)
        if dequant is not None:   # int8 key/value: (x + offset) * scale
            keys, values = dequant[0](b, keys), dequant[1](b, values)
        keys, values = keys.float(), values.float()
        keys = keys.repeat_interleave(group, dim=1)        # [kv_len, N, D]
        values = values.repeat_interleave(group, dim=1)
        q = q_all[b, :q_len]                               # [q_len, N, D]
        scores = float(scale) * torch.einsum("qnd,knd->nqk", q, keys)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
        if causal is not None:
            rows = torch.arange(q_len).unsqueeze(1)
            cols = torch.arange(kv_len).unsqueeze(0)
            # leftUpCausal: row i sees keys j <= i; rightDownCausal: j <= i + kv - q.
            allowed = cols <= rows + (0 if causal == 2 else kv_len - q_len)
        if band is not None:
            rows = torch.arange(q_len).unsqueeze(1)
            cols = torch.arange(kv_len).unsqueeze(0)
            origin, before, after = band
            diagonal = rows + (kv_len - q_len if origin == "rightDown" else 0)
            allowed = allowed & (cols >= diagonal - before) & (cols <= diagonal + after)
        if full_mask is not None:
            allowed = allowed & ~full_mask[b, :q_len, :kv_len]
        empty_rows = ~allowed.any(dim=1)
        if bool(empty_rows.any()):
            if inner_precise in (0, 1):
                first = empty_rows.nonzero().flatten()[:8].tolist()
                raise RuntimeError(f"batch {b}: query rows {first} have no key to attend; the "
                                   f"page leaves their "
                                   "result open unless inner_precise is 2 or 3 (row-invalid "
                                   "correction).")
            if softmax_lse_flag:
                raise NotImplementedError("softmax_lse of a row with no key to attend is not "
                                          "modelled.")
        scores = scores.masked_fill(~allowed, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)          # [N, q_len]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        out[b, :q_len] = torch.einsum("nqk,knd->qnd", probs, values)  # invalid rows: zeros
        lse[b, :, :q_len, 0] = row_lse
    if input_layout == "BNSD":
        attention_out = out.transpose(1, 2).to(query.dtype).contiguous()
    else:
        attention_out = out.to(query.dtype).reshape(query.shape)
    softmax_lse = lse if softmax_lse_flag else torch.zeros(1, dtype=torch.float32)
    return attention_out, softmax_lse


def _check_band(pre: int, nxt: int, mode: int) -> None:
    """pre_tokens / next_tokens of a band (sparse_mode 4, or 0 with a full mask): the band
    they span must not be empty."""
    if pre + nxt < 0:
        raise RuntimeError(f"pre_tokens={pre} and next_tokens={nxt} with sparse_mode={mode}: "
                           "the band they span is empty; the page needs pre_tokens + "
                           "next_tokens >= 0 (a negative one at most the other's size).")


def _dense_key_value(key, value, layout: str, batch: int, kv_heads: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense ``key``/``value`` in ``layout`` (the query's) as ``[B, KV_S, kv_N, D]``."""
    if tuple(key.shape) != tuple(value.shape):
        raise RuntimeError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have "
                           "the same shape.")
    expected = {"BSH": "[B, KV_S, num_key_value_heads * D]",
                "BSND": "[B, KV_S, num_key_value_heads, D]",
                "BNSD": "[B, num_key_value_heads, KV_S, D]"}[layout]
    if layout == "BSH":
        ok = key.dim() == 3 and key.shape[2] == kv_heads * head_dim
    elif layout == "BSND":
        ok = key.dim() == 4 and key.shape[2] == kv_heads and key.shape[3] == head_dim
    else:
        ok = key.dim() == 4 and key.shape[1] == kv_heads and key.shape[3] == head_dim
    if not ok or key.shape[0] != batch:
        raise RuntimeError(f"key has shape {tuple(key.shape)}; without block_table, with "
                           f"input_layout={layout!r}, it must be {expected} with B={batch}, "
                           f"num_key_value_heads={kv_heads}, D={head_dim}.")

    def as_bsnd(tensor: torch.Tensor) -> torch.Tensor:
        if layout == "BSH":
            return tensor.reshape(batch, tensor.shape[1], kv_heads, head_dim)
        return tensor.transpose(1, 2) if layout == "BNSD" else tensor

    return as_bsnd(key), as_bsnd(value)


def _check_paged_key_value(key, value, block_table, block_size, actual_seq_lengths_kv,
                           batch: int, q_s: int, kv_heads: int, head_dim: int,
                           quantized: bool = False) -> list[int]:
    """Check page attention's caches and table; each batch's key/value length."""
    _check_block_table(block_table, batch)
    block = _require_int("block_size", block_size)
    if q_s == 1:
        align = 32 if quantized else 16
        if block <= 0 or block % align:
            raise RuntimeError(f"block_size={block}; with Q_S = 1 and "
                               f"{'int8' if quantized else 'float16/bfloat16'} caches it must "
                               f"be a positive multiple of {align}.")
    elif block not in (128, 256, 384, 512):
        raise RuntimeError(f"block_size={block}; page attention with Q_S > 1 needs 128 to 512 "
                           "in steps of 128.")
    hidden_kv = kv_heads * head_dim
    for name, cache in (("key", key), ("value", value)):
        if cache.dim() != 3 or cache.shape[1] != block or cache.shape[2] != hidden_kv:
            raise RuntimeError(f"{name} has shape {tuple(cache.shape)}; for page attention it "
                               f"must be (num_blocks, block_size={block}, "
                               f"num_key_value_heads * D = {hidden_kv}).")
    if hidden_kv > 65535:
        raise RuntimeError(f"num_key_value_heads * D = {hidden_kv} exceeds 65535, which the "
                           "(num_blocks, block_size, H) cache layout cannot address.")
    num_blocks = key.shape[0]
    if actual_seq_lengths_kv is None:
        raise RuntimeError("page attention needs actual_seq_lengths_kv.")
    kv_lengths = _per_batch_lengths("actual_seq_lengths_kv", actual_seq_lengths_kv, batch,
                                    None)
    needed = sum(-(-length // block) for length in kv_lengths)
    if needed > num_blocks:
        raise RuntimeError(f"the caches hold {num_blocks} blocks, fewer than the {needed} the "
                           "batches' lengths need.")
    _check_table_covers(block_table, kv_lengths, block, num_blocks)
    return kv_lengths


def _full_atten_mask(atten_mask, batch: int, q_s: int, kv_s: int | None,
                     decode: bool) -> torch.Tensor:
    """A user mask (True / nonzero: not computed) as ``[B, Q_S, KV_S']`` bool, from the
    shapes the page lists: ``(Q_S, KV_S)``, ``(B | 1, Q_S, KV_S)``, ``(B | 1, 1, Q_S,
    KV_S)`` when Q_S > 1, ``(B, KV_S)``, ``(B, 1, KV_S)``, ``(B, 1, 1, KV_S)`` when Q_S is 1;
    its S dims may be padded up (alignment), the extra part is not read."""
    _require_tensor("atten_mask", atten_mask)
    if atten_mask.dtype not in _MASK_DTYPES:
        raise RuntimeError(f"atten_mask has dtype {atten_mask.dtype}; the page allows bool, int8 "
                           "and uint8.")
    shape = tuple(atten_mask.shape)
    if decode:
        ok = (len(shape) in (2, 3, 4) and shape[0] == batch
              and all(d == 1 for d in shape[1:-1]))
        mask = atten_mask.reshape(batch, 1, shape[-1]) if ok else None
    else:
        lead = shape[:-2]
        ok = len(shape) in (2, 3, 4) and (
            len(lead) == 0 or (len(lead) == 1 and lead[0] in (1, batch))
            or (len(lead) == 2 and lead[0] in (1, batch) and lead[1] == 1))
        mask = atten_mask.reshape(-1, shape[-2], shape[-1]).expand(
            batch, shape[-2], shape[-1]) if ok else None
    if not ok or mask.shape[1] < q_s or mask.shape[2] < kv_s:
        listed = ("(B, KV_S), (B, 1, KV_S) or (B, 1, 1, KV_S)" if decode else
                  "(Q_S, KV_S), (B, Q_S, KV_S), (1, Q_S, KV_S), (B, 1, Q_S, KV_S) or "
                  "(1, 1, Q_S, KV_S)")
        raise RuntimeError(f"atten_mask has shape {shape}; with B={batch}, Q_S={q_s}, "
                           f"KV_S={kv_s} it must be {listed}.")
    return mask[:, :q_s, :kv_s].bool()


# --- npu_fused_infer_attention_score, MLA form ----------------------------------------------

_MLA_HEAD_DIM = 512
_MLA_ROPE_DIM = 64
_MLA_NUM_HEADS = (32, 64, 128)
_MLA_MAX_QUERY_TOKENS = 16
_MLA_BLOCK_SIZES = (16, 128)


def _check_mla_caches(given: dict, key, value, key_rope, batch: int) -> int:
    """The MLA form's paged caches (any layout): the block table, ``block_size`` and the ND
    latent / rope caches ``(num_blocks, block_size, 512 | 64)``; returns the block size."""
    _check_block_table(given["block_table"], batch)
    block = _require_int("block_size", given["block_size"])
    if block not in _MLA_BLOCK_SIZES:
        raise RuntimeError(f"block_size={block}; the MLA form takes {list(_MLA_BLOCK_SIZES)}.")
    for name, cache, width in (("key", key, _MLA_HEAD_DIM), ("value", value, _MLA_HEAD_DIM),
                               ("key_rope", key_rope, _MLA_ROPE_DIM)):
        if cache.dim() != 3 or cache.shape[1] != block or cache.shape[2] != width:
            raise RuntimeError(f"{name} has shape {tuple(cache.shape)}; in the MLA form it must "
                               f"be the ND cache (num_blocks, block_size={block}, {width}).")
    if not key.shape[0] == value.shape[0] == key_rope.shape[0]:
        raise RuntimeError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and key_rope "
                           f"{tuple(key_rope.shape)} must hold the same number of blocks.")
    return block


def _mla_page_attention(given: dict):
    """The MLA form of ``npu_fused_infer_attention_score``: ``query_rope`` and ``key_rope``
    both given. Follows the page's "query_rope和key_rope输入时即为MLA场景" constraints for
    query D 512 on Atlas A2/A3:

    - ``query`` ``[B, Q_S, N, 512]`` (``"BSND"``) or ``[B, Q_S, N * 512]`` (``"BSH"``) with
      N (``num_heads``) 32, 64 or 128 and Q_S 1 to 16; ``query_rope`` the same with D 64;
    - ``key`` and ``value`` the paged latent cache ``(num_blocks, block_size, 512)`` of one
      KV head (``num_key_value_heads=1``), ``key_rope`` ``(num_blocks, block_size, 64)``;
      page attention is mandatory, ``block_size`` 16 or 128 (ND caches; NZ is not
      modelled);
    - Q_S = 1: ``sparse_mode`` 0 without a mask; Q_S > 1: ``sparse_mode`` 3 with the
      compressed 2048 x 2048 causal mask (query row i of a batch with q query and k key
      tokens sees keys j <= i + k - q);
    - no softmax LSE, quantization, prefix, padding or pse arguments.

    ``attention_out = softmax(scale * (query @ key^T + query_rope @ key_rope^T) + mask) @
    value``, the shape of ``query``. The TND layouts are ``torch_npu._ops_attention_tnd``'s;
    query D 128 with rope belongs to them and raises here.
    """
    query, key, value = given["query"], given["key"], given["value"]
    query_rope, key_rope = given["query_rope"], given["key_rope"]
    if query_rope is None or key_rope is None:
        raise RuntimeError("query_rope and key_rope must be given together (the MLA form); "
                           f"got query_rope={'set' if query_rope is not None else None} and "
                           f"key_rope={'set' if key_rope is not None else None}.")
    for name in _UNMODELLED_FIA_ARGUMENTS:
        if given[name] is not None:
            raise NotImplementedError(
                f"{name} with query_rope/key_rope is not modelled by the reference "
                "npu_fused_infer_attention_score (the page rules out pse, prefix, padding "
                "and quantization in the MLA form).")
    for name in ("antiquant_mode", "key_antiquant_mode", "value_antiquant_mode"):
        if given[name] != 0:
            raise NotImplementedError(f"{name}={given[name]!r} is not modelled (only 0).")
    tensors = (("query", query), ("key", key), ("value", value), ("query_rope", query_rope),
               ("key_rope", key_rope))
    for name, tensor in tensors:
        _require_tensor(name, tensor)
        _require_contiguous(name, tensor)
        if tensor.dtype not in _HALF_DTYPES:
            raise RuntimeError(f"{name} has dtype {tensor.dtype}; the MLA form takes float16 "
                               "or bfloat16.")
    for name, tensor in tensors[1:]:
        if tensor.dtype != query.dtype:
            raise RuntimeError(f"{name} has dtype {tensor.dtype} but query has {query.dtype}; "
                               "the page requires query_rope like query and key_rope like key, "
                               "all of one dtype here.")

    layout = given["input_layout"]  # the TND layouts go to torch_npu._ops_attention_tnd
    if layout not in ("BSND", "BSH"):
        raise NotImplementedError(f"input_layout={layout!r} is not modelled; the reference "
                                  "models 'BSND' and 'BSH'.")
    heads = _require_int("num_heads", given["num_heads"])
    if heads not in _MLA_NUM_HEADS:
        raise RuntimeError(f"num_heads={heads}; with query_rope the page takes query heads "
                           f"{list(_MLA_NUM_HEADS)}.")
    kv_heads = _require_int("num_key_value_heads", given["num_key_value_heads"])
    if kv_heads != 1:
        raise RuntimeError(f"num_key_value_heads={kv_heads}; with key_rope the page needs one "
                           "latent KV head (num_key_value_heads=1).")
    if query.dim() != query_rope.dim():
        raise RuntimeError(f"query {tuple(query.shape)} and query_rope "
                           f"{tuple(query_rope.shape)} must have the same layout.")
    if layout == "BSND":
        if query.dim() != 4 or query.shape[2] != heads:
            raise RuntimeError(f"query has shape {tuple(query.shape)}; with input_layout='BSND' "
                               f"it must be [B, Q_S, num_heads={heads}, D].")
        head_dim, rope_dim = query.shape[3], query_rope.shape[3]
        q_lead, rope_lead = query.shape[:3], query_rope.shape[:3]
    else:
        if query.dim() != 3 or query.shape[2] % heads or query_rope.shape[2] % heads:
            raise RuntimeError(f"query {tuple(query.shape)} and query_rope "
                               f"{tuple(query_rope.shape)}: with input_layout='BSH' both must "
                               f"be [B, Q_S, H] with H a multiple of num_heads={heads}.")
        head_dim, rope_dim = query.shape[2] // heads, query_rope.shape[2] // heads
        q_lead, rope_lead = query.shape[:2], query_rope.shape[:2]
    if head_dim == 128:
        raise RuntimeError("query D 128 with rope takes input_layout 'TND' or 'NTD_TND' "
                           f"(the page), not {layout!r}.")
    if head_dim != _MLA_HEAD_DIM:
        raise RuntimeError(f"query D={head_dim}; with query_rope the page takes D 512 (or 128).")
    if rope_dim != _MLA_ROPE_DIM or rope_lead != q_lead:
        raise RuntimeError(f"query_rope has shape {tuple(query_rope.shape)}; it must match "
                           f"query {tuple(query.shape)} except for D, which is 64.")
    batch, q_s = query.shape[0], query.shape[1]
    if not 1 <= q_s <= _MLA_MAX_QUERY_TOKENS:
        raise RuntimeError(f"Q_S={q_s}; with query_rope the page takes 1 to "
                           f"{_MLA_MAX_QUERY_TOKENS} query tokens per batch.")

    block_table = given["block_table"]
    if block_table is None:
        raise RuntimeError("the MLA form (query D 512 with rope) needs page attention: pass "
                           "block_table and block_size.")
    block = _check_mla_caches(given, key, value, key_rope, batch)
    num_blocks = key.shape[0]
    if given["actual_seq_lengths_kv"] is None:
        raise RuntimeError("page attention needs actual_seq_lengths_kv.")
    kv_lengths = _per_batch_lengths("actual_seq_lengths_kv", given["actual_seq_lengths_kv"],
                                    batch, None)
    if given["actual_seq_lengths"] is None or q_s == 1:
        q_lengths = [q_s] * batch
    else:
        q_lengths = _per_batch_lengths("actual_seq_lengths", given["actual_seq_lengths"],
                                       batch, q_s)
    _check_table_covers(block_table, kv_lengths, block, num_blocks)

    mode = _require_int("sparse_mode", given["sparse_mode"])
    atten_mask = given["atten_mask"]
    if q_s == 1:
        if mode != 0 or atten_mask is not None:
            raise RuntimeError(f"sparse_mode={mode} with a mask={atten_mask is not None} at "
                               "Q_S = 1; the MLA form takes sparse_mode=0 and no mask there.")
    else:
        if mode != 3 or atten_mask is None:
            raise RuntimeError(f"sparse_mode={mode} at Q_S = {q_s}; the MLA form takes "
                               "sparse_mode=3 with the compressed (2048, 2048) causal mask "
                               "when Q_S > 1.")
        _check_compressed_causal_mask(atten_mask)
    inner = _require_int("inner_precise", given["inner_precise"])
    if inner not in ((0, 1) if q_s == 1 else (0, 1, 2, 3)):
        raise RuntimeError(f"inner_precise={inner} is outside what the page allows here.")
    scale = given["scale"]
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}.")
    if given["softmax_lse_flag"] is not False:
        raise RuntimeError("softmax_lse_flag=True is ruled out by the page in the MLA form.")

    q_all = query.reshape(batch, q_s, heads, _MLA_HEAD_DIM).float()
    q_rope_all = query_rope.reshape(batch, q_s, heads, _MLA_ROPE_DIM).float()
    out = torch.zeros(batch, q_s, heads, _MLA_HEAD_DIM, dtype=torch.float32)
    for b in range(batch):
        q_len, kv_len = q_lengths[b], kv_lengths[b]
        if q_len == 0 or kv_len == 0:
            continue  # the page: empty keys give zero output
        row = block_table[b]
        latent = _paged_sequence(key, row, kv_len, block, 1)[:, 0].float()     # [k, 512]
        rope = _paged_sequence(key_rope, row, kv_len, block, 1)[:, 0].float()  # [k, 64]
        values = _paged_sequence(value, row, kv_len, block, 1)[:, 0].float()   # [k, 512]
        scores = (torch.einsum("qnd,kd->nqk", q_all[b, :q_len], latent)
                  + torch.einsum("qnd,kd->nqk", q_rope_all[b, :q_len], rope)) * float(scale)
        if q_s > 1:
            rows = torch.arange(q_len).unsqueeze(1)
            cols = torch.arange(kv_len).unsqueeze(0)
            allowed = cols <= rows + (kv_len - q_len)
            if not bool(allowed.any(dim=1).all()):
                raise RuntimeError(f"batch {b}: actual_seq_lengths {q_len} exceeds "
                                   f"actual_seq_lengths_kv {kv_len}, so rightDownCausal "
                                   "leaves query rows with no key.")
            scores = scores.masked_fill(~allowed, -math.inf)
        probs = torch.softmax(scores, dim=-1)
        out[b, :q_len] = torch.einsum("nqk,kd->qnd", probs, values)
    return out.to(query.dtype).reshape(query.shape), torch.zeros(1, dtype=torch.float32)


# --- npu_fused_infer_attention_score.out and its graph workspace --------------------------

# The reference's workspace model: float32 scratch for every output row (B * Q_S * N rows of
# D values) plus each row's running maximum and sum, rounded up to 32 bytes. It depends on
# the shapes only, never on the actual lengths, so one workspace serves every update of a
# captured call.
_WORKSPACE_ALIGN = 32
_WORKSPACE_ROW_EXTRA = 2


def fused_attention_workspace_bytes(query, num_heads) -> int:
    """Bytes of the workspace the reference's out form needs for ``query`` and
    ``num_heads`` (``[B, Q_S, N, D]`` / ``[B, Q_S, N * D]``)."""
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}.")
    heads = _require_int("num_heads", num_heads)
    if heads < 1 or query.dim() not in (3, 4):
        raise RuntimeError(f"query of shape {tuple(query.shape)} with num_heads={heads}: "
                           "expected a BSND or BSH query and num_heads >= 1.")
    rows = query.shape[0] * query.shape[1] * heads
    head_dim = query.numel() // max(rows, 1)
    raw = 4 * rows * (head_dim + _WORKSPACE_ROW_EXTRA)
    return -(-raw // _WORKSPACE_ALIGN) * _WORKSPACE_ALIGN


# The op's schema, and the two schemas derived from it (op-plugin's
# _npu_fused_infer_attention_score_get_max_workspace and npu_fused_infer_attention_score.out):
# the same arguments, the out form adding ``Tensor? workspace=None`` and the outputs, which the
# Python binding takes as one keyword-only ``out``.
_FIA_SIGNATURE = inspect.signature(npu_fused_infer_attention_score)
_FIA_OUT_SIGNATURE = _FIA_SIGNATURE.replace(parameters=[
    *_FIA_SIGNATURE.parameters.values(),
    inspect.Parameter("workspace", inspect.Parameter.KEYWORD_ONLY, default=None),
    inspect.Parameter("out", inspect.Parameter.KEYWORD_ONLY)])
_FIA_TENSORS = ("query", "key", "value")


def _takes(signature: inspect.Signature):
    """Give a function taking ``(**arguments)`` the Python signature ``signature``: a call
    is bound to it first (a missing, unknown or doubled argument raises TypeError, as the
    binding's parser does) and the function gets every argument by name, defaults
    included."""
    def decorate(function):
        def bound(*args, **kwargs):
            arguments = signature.bind(*args, **kwargs)
            arguments.apply_defaults()
            return function(**arguments.arguments)

        bound.__name__ = bound.__qualname__ = function.__name__
        bound.__doc__ = function.__doc__
        bound.__module__ = function.__module__
        bound.__signature__ = signature
        return bound
    return decorate


@_takes(_FIA_SIGNATURE)
def npu_fused_infer_attention_score_get_max_workspace(**arguments):
    """``torch_npu._npu_fused_infer_attention_score_get_max_workspace(query, key, value, *,
    the op's keyword arguments) -> Tensor``: a workspace tensor for the op's ``.out`` form.

    torch_npu documents it by its use (the graph task update pages: the workspace of a
    captured ``.out`` call, valid for every later update of its lengths). The reference
    returns uninitialised uint8 memory on the query's device, of
    ``fused_attention_workspace_bytes`` bytes (independent of the actual lengths); the
    arguments are checked when the ``.out`` form runs.
    """
    for name in _FIA_TENSORS:
        if not isinstance(arguments[name], torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got "
                            f"{type(arguments[name]).__name__}.")
    query = arguments["query"]
    size = fused_attention_workspace_bytes(query, arguments["num_heads"])
    return torch.empty(size, dtype=torch.uint8, device=query.device)


@_takes(_FIA_OUT_SIGNATURE)
def npu_fused_infer_attention_score_out(**arguments):
    """``torch_npu.npu_fused_infer_attention_score.out(query, key, value, *, the op's keyword
    arguments, workspace=None, out=[attention_out, softmax_lse])``: the op writing into
    ``out``, the form captured in graph task groups.

    ``workspace`` (op-plugin's schema: ``Tensor? workspace=None``): None lets the op take
    its own; else a uint8 tensor of at least ``fused_attention_workspace_bytes`` bytes
    (what ``_npu_fused_infer_attention_score_get_max_workspace`` returns); ``out[0]`` of the
    attention output's shape and dtype, ``out[1]`` of the softmax log-sum-exp's shape
    (``(1,)`` when ``softmax_lse_flag`` is False, any floating dtype). Returns ``out``.
    """
    workspace, out = arguments.pop("workspace"), arguments.pop("out")
    query = arguments["query"]
    if workspace is not None:
        _require_tensor("workspace", workspace)
        needed = fused_attention_workspace_bytes(query, arguments["num_heads"])
        if workspace.dtype != torch.uint8 or workspace.numel() < needed:
            raise RuntimeError(f"workspace is {workspace.dtype} of {workspace.numel()} "
                               f"elements; the call needs uint8 of at least {needed} bytes "
                               "(use _npu_fused_infer_attention_score_get_max_workspace).")
    if not isinstance(out, (list, tuple)) or len(out) != 2:
        raise TypeError(f"out must be [attention_out, softmax_lse], got {out!r}.")
    attention_out, softmax_lse = npu_fused_infer_attention_score(**arguments)
    for index, (name, given, result) in enumerate((("attention_out", out[0], attention_out),
                                                   ("softmax_lse", out[1], softmax_lse))):
        _require_tensor(f"out[{index}]", given)
        if given.shape != result.shape:
            raise RuntimeError(f"out[{index}] ({name}) has shape {tuple(given.shape)}; the call "
                               f"produces {tuple(result.shape)}.")
        if index == 0 and given.dtype != result.dtype:
            raise RuntimeError(f"out[0] (attention_out) is {given.dtype}; the call produces "
                               f"{result.dtype}.")
        if index == 1 and not given.dtype.is_floating_point:
            raise RuntimeError(f"out[1] (softmax_lse) is {given.dtype}; expected a floating "
                               "dtype.")
        given.copy_(result)
    return out
