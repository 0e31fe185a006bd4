"""``npu_fused_infer_attention_score`` in its TND layouts (``input_layout`` ``"TND"``,
``"TND_NTD"``, ``"NTD_TND"``), on CPU tensors.

Follows Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md``
(its "TND、TND_NTD、NTD_TND场景" constraints and the MLA constraints for query D 512 / 128),
Atlas A2/A3 rows. In a TND layout every batch's tokens are packed along T; the batch is
the number of ``actual_seq_lengths`` entries, each the *cumulative* end offset of its batch
(non-decreasing). Left of the underscore is the input's layout, right the output's.

Modelled forms (``tnd_attention`` picks one from the arguments):

- **dense** (no ``block_table``, no rope): query and key D 192, value D 128 or 192 (128 in
  ``NTD_TND``), ``num_heads`` N in {2, 4, 8, 16, 32, 64, 128}, the same N for key and
  value, bfloat16 only; ``actual_seq_lengths_kv`` cumulative over key/value's T. Layouts
  ``TND`` and ``NTD_TND``. This is MLA's prefill run as dense attention (q/k of nope + rope,
  v of the value head size).
- **dense with rope** (``query_rope`` / ``key_rope``, query D 128): query, key, value D
  128, rope D 64, otherwise as dense; scores are ``query @ key^T + query_rope @
  key_rope^T``.
- **MLA page attention** (rope, query D 512): query ``[T, N, 512]`` with N 32/64/128,
  each batch 1 to 16 query tokens, one latent KV head read from ``(num_blocks,
  block_size, 512)`` caches as key and value beside a ``(num_blocks, block_size, 64)`` rope
  cache, ``block_size`` 16 or 128; ``actual_seq_lengths_kv`` per batch (not cumulative: the
  page's "每个batch的实际长度"). Layouts ``TND`` and ``TND_NTD``; no softmax LSE.
- **GQA page attention** (``block_table``, no rope): the form vLLM-Ascend's attention
  calls (chunked prefill and decode in one call): float16/bfloat16 query ``[T, N, D]``, D
  a multiple of 16 below 512, GQA, caches ``(num_blocks, block_size, KV_N * D)`` or
  ``(num_blocks, KV_N, block_size, D)`` (the page lists both for TND),
  ``actual_seq_lengths_kv`` per batch, ``block_size`` as in the other layouts. The page's
  TND list does not describe this form (it names page attention for D 512 only), but the
  page's page-attention rules name TND among the query layouts and vLLM-Ascend calls it;
  layout ``TND`` only.

All forms: ``sparse_mode`` 0 without ``atten_mask`` (every key of the batch) or 3 with the
compressed 2048 x 2048 causal mask (rightDownCausal: query row i of a batch of q query and
k key tokens sees keys j <= i + k - q); ``pre_tokens`` / ``next_tokens`` are ignored there
as in the other layouts; the softmax LSE is ``(T, N, 1)``. Query rows past the last
cumulative length are padding and come out as zeros (the page leaves them open).
"""

from __future__ import annotations

import math

import torch

from torch_npu._ops_attention import (
    _HALF_DTYPES,
    _UNMODELLED_FIA_ARGUMENTS,
    _check_block_table,
    _check_compressed_causal_mask,
    _check_mla_caches,
    _check_table_covers,
    _paged_sequence,
    _require_contiguous,
    _require_int,
    _require_tensor,
)

TND_LAYOUTS = {"TND": ("TND", "TND"), "TND_NTD": ("TND", "NTD"), "NTD_TND": ("NTD", "TND")}
_DENSE_HEADS = (2, 4, 8, 16, 32, 64, 128)
_MAX_TOKENS = 1 << 20
_MAX_DENSE_BATCH = 4096
_MLA_HEADS = (32, 64, 128)
_ROPE_DIM = 64


def _cumulative(name: str, lengths, total: int, total_name: str) -> tuple[list[int], list[int]]:
    """TND lengths: cumulative end offsets -> (per-batch lengths, start offsets)."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if not isinstance(lengths, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in lengths):
        raise TypeError(f"{name} must be a list of ints, got {lengths!r}.")
    if not lengths:
        raise RuntimeError(f"{name} is empty; with a TND layout it holds one cumulative "
                           "length per batch.")
    previous = 0
    per_batch, starts = [], []
    for b, end in enumerate(lengths):
        if end < previous:
            raise RuntimeError(f"{name}[{b}] = {end} is below {name}[{b - 1}] = {previous}; "
                               "with a TND layout the values are cumulative (non-decreasing, "
                               "non-negative).")
        starts.append(previous)
        per_batch.append(end - previous)
        previous = end
    if previous > total:
        raise RuntimeError(f"{name}[-1] = {previous} exceeds {total_name} = {total}; the "
                           "cumulative lengths must fit the tensor's T.")
    return per_batch, starts


def _per_batch(name: str, lengths, batch: int) -> list[int]:
    """Page attention in TND: one (non-cumulative) key/value length per batch."""
    if isinstance(lengths, torch.Tensor):
        lengths = lengths.tolist()
    if not isinstance(lengths, (list, tuple)) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in lengths):
        raise TypeError(f"{name} must be a list of ints, got {lengths!r}.")
    if len(lengths) != batch:
        raise RuntimeError(f"{name} has {len(lengths)} values; with a TND layout and page "
                           f"attention it holds one length per batch (B={batch}, the count "
                           "of actual_seq_lengths).")
    for b, length in enumerate(lengths):
        if length < 0:
            raise RuntimeError(f"{name}[{b}] = {length}; it must be non-negative.")
    return list(lengths)


def _to_tnd(tensor: torch.Tensor, in_layout: str) -> torch.Tensor:
    return tensor.transpose(0, 1) if in_layout == "NTD" else tensor


def _check_tnd_shape(name: str, tensor: torch.Tensor, heads: int | None, dim: int | None,
                     in_layout: str, tokens: int | None = None) -> None:
    shape = tuple(_to_tnd(tensor, in_layout).shape) if tensor.dim() == 3 else None
    ok = shape is not None and (heads is None or shape[1] == heads) and (
        dim is None or shape[2] == dim) and (tokens is None or shape[0] == tokens)
    if not ok:
        want = "[T, N, D]" if in_layout == "TND" else "[N, T, D]"
        parts = [f"N={heads}" if heads is not None else None,
                 f"D={dim}" if dim is not None else None,
                 f"T={tokens}" if tokens is not None else None]
        detail = ", ".join(p for p in parts if p)
        raise RuntimeError(f"{name} has shape {tuple(tensor.shape)}; with a {in_layout} input "
                           f"it must be {want}" + (f" with {detail}." if detail else "."))


def tnd_attention(given: dict):
    """``npu_fused_infer_attention_score`` with ``input_layout`` TND, TND_NTD or NTD_TND
    (see the module's docstring for the forms)."""
    layout = given["input_layout"]
    in_layout, out_layout = TND_LAYOUTS[layout]
    query, key, value = given["query"], given["key"], given["value"]
    query_rope, key_rope = given["query_rope"], given["key_rope"]
    block_table = given["block_table"]
    if (query_rope is None) != (key_rope is None):
        raise RuntimeError("query_rope and key_rope must be given together (the MLA form); "
                           f"got query_rope={'set' if query_rope is not None else None} and "
                           f"key_rope={'set' if key_rope is not None else None}.")
    rope = query_rope is not None
    gqa_paged = block_table is not None and not rope
    extras = [name for name in _UNMODELLED_FIA_ARGUMENTS if given[name] is not None] + [
        name for name in ("antiquant_mode", "key_antiquant_mode", "value_antiquant_mode")
        if given[name] != 0]
    if extras:
        name = extras[0]
        if gqa_paged:
            raise NotImplementedError(
                f"torch_npu.npu_fused_infer_attention_score: {name}={given[name]!r} with "
                f"input_layout={layout!r} and page attention is not modelled by the "
                "reference torch_npu (only float16/bfloat16 without quantization, pse, "
                "prefix or padding).")
        raise RuntimeError(f"{name} is given with input_layout={layout!r}; the page's TND "
                           "constraints rule out pse, left padding, prefix and "
                           "(anti)quantization there.")
    if gqa_paged and layout != "TND":
        raise NotImplementedError(f"torch_npu.npu_fused_infer_attention_score: input_layout="
                                  f"{layout!r} with page attention and no rope is not modelled "
                                  "by the reference torch_npu (only 'TND').")
    if rope and block_table is not None and layout == "NTD_TND":
        raise RuntimeError("input_layout='NTD_TND' with query_rope and page attention (query D "
                           "512); the page allows TND and TND_NTD there.")
    tensors = [("query", query), ("key", key), ("value", value)]
    if rope:
        tensors += [("query_rope", query_rope), ("key_rope", key_rope)]
    for name, tensor in tensors:
        _require_tensor(name, tensor)
        _require_contiguous(name, tensor)
        if tensor.dtype not in _HALF_DTYPES:
            if gqa_paged and tensor.dtype == torch.int8:
                raise NotImplementedError(
                    f"torch_npu.npu_fused_infer_attention_score: {name} in int8 with "
                    f"input_layout={layout!r} is not modelled by the reference torch_npu.")
            raise RuntimeError(f"{name} has dtype {tensor.dtype}; with input_layout="
                               f"{layout!r} the page allows float16 and bfloat16.")
        if tensor.dtype != query.dtype:
            raise RuntimeError(f"{name} has dtype {tensor.dtype} but query has {query.dtype}; "
                               "they must share one dtype.")
    heads = _require_int("num_heads", given["num_heads"])
    kv_heads_arg = _require_int("num_key_value_heads", given["num_key_value_heads"])
    if query.dim() != 3:
        raise RuntimeError(f"query has shape {tuple(query.shape)}; with input_layout="
                           f"{layout!r} it must be 3-D ({in_layout}).")
    q = _to_tnd(query, in_layout)
    _check_tnd_shape("query", query, heads, None, in_layout)
    tokens, head_dim = q.shape[0], q.shape[2]
    if tokens > _MAX_TOKENS:
        raise RuntimeError(f"query has T={tokens}; the page allows T up to 1M ({_MAX_TOKENS}).")
    for name in ("actual_seq_lengths", "actual_seq_lengths_kv"):
        if given[name] is None:
            raise RuntimeError(f"{name} is None; with input_layout={layout!r} the page requires "
                               "actual_seq_lengths and actual_seq_lengths_kv.")
    q_lens, q_starts = _cumulative("actual_seq_lengths", given["actual_seq_lengths"], tokens,
                                   "query's T")
    batch = len(q_lens)

    mode = _require_int("sparse_mode", given["sparse_mode"])
    atten_mask = given["atten_mask"]
    if mode == 0 and atten_mask is None:
        causal = False
    elif mode == 3 and atten_mask is not None:
        _check_compressed_causal_mask(atten_mask, 3)
        causal = True
    else:
        raise RuntimeError(f"sparse_mode={mode} with atten_mask "
                           f"{'given' if atten_mask is not None else 'None'}: with input_layout="
                           f"{layout!r} the page allows sparse_mode=0 without atten_mask or "
                           "sparse_mode=3 with the compressed (2048, 2048) causal mask.")
    inner = _require_int("inner_precise", given["inner_precise"])
    if inner not in (0, 1, 2, 3):
        raise RuntimeError(f"inner_precise={inner}; the page allows 0 to 3.")
    scale = given["scale"]
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}.")
    lse_flag = given["softmax_lse_flag"]
    if not isinstance(lse_flag, bool):
        raise TypeError(f"softmax_lse_flag must be a bool, got {type(lse_flag).__name__}.")

    if rope and head_dim == 512:
        form = _mla_paged(given, layout, q, heads, kv_heads_arg, q_lens, causal, batch)
    elif rope and head_dim == 128:
        form = _dense(given, layout, in_layout, q, heads, kv_heads_arg, q_lens, causal, batch,
                      rope=True)
    elif rope:
        raise RuntimeError(f"query D={head_dim}; with query_rope the page takes query D 512 "
                           "(page attention) or 128 (dense).")
    elif block_table is None:
        form = _dense(given, layout, in_layout, q, heads, kv_heads_arg, q_lens, causal, batch,
                      rope=False)
    else:
        form = _gqa_paged(given, layout, q, heads, kv_heads_arg, q_lens, batch)
    kv_of, q_rope_all, value_dim = form

    out = torch.zeros(tokens, heads, value_dim, dtype=torch.float32)
    lse = torch.zeros(tokens, heads, 1, dtype=torch.float32)
    q_all = q.float()
    for b in range(batch):
        q_len = q_lens[b]
        if q_len == 0:
            continue
        keys, values, key_ropes = kv_of(b)
        kv_len = keys.shape[0]
        if kv_len == 0:
            continue  # the page: empty keys give zero output
        rows = slice(q_starts[b], q_starts[b] + q_len)
        group = heads // keys.shape[1]
        k = keys.float().repeat_interleave(group, dim=1)
        v = values.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qnd,knd->nqk", q_all[rows], k)
        if key_ropes is not None:
            k_rope = key_ropes.float().repeat_interleave(group, dim=1)
            scores = scores + torch.einsum("qnd,knd->nqk", q_rope_all[rows].float(), k_rope)
        scores = scores * float(scale)
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool)
        if causal:
            allowed = (torch.arange(kv_len).unsqueeze(0)
                       <= torch.arange(q_len).unsqueeze(1) + (kv_len - q_len))
        empty = ~allowed.any(dim=1)
        if bool(empty.any()):
            if inner in (0, 1):
                raise RuntimeError(f"batch {b}: {int(empty.sum())} query rows have no key to "
                                   f"attend (actual length {q_len} > key length {kv_len} with "
                                   "sparse_mode=3); the page leaves them open unless "
                                   "inner_precise is 2 or 3.")
            if lse_flag:
                raise NotImplementedError("torch_npu.npu_fused_infer_attention_score: "
                                          "softmax_lse_flag=True with a row that has no key "
                                          "to attend is not modelled.")
        scores = scores.masked_fill(~allowed, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)                       # [N, q]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        out[rows] = torch.einsum("nqk,knd->qnd", probs, v)
        lse[rows, :, 0] = row_lse.transpose(0, 1)
    attention_out = out.to(query.dtype)
    if out_layout == "NTD":
        attention_out = attention_out.transpose(0, 1).contiguous()
    return attention_out, (lse if lse_flag else torch.zeros(1, dtype=torch.float32))


def _dense(given, layout, in_layout, q, heads, kv_heads_arg, q_lens, causal, batch, rope):
    """The dense TND forms (no page attention): D 192 (value 128/192) or D 128 with rope."""
    key, value = given["key"], given["value"]
    head_dim = q.shape[2]
    if given["block_table"] is not None:
        raise RuntimeError(f"block_table is given with input_layout={layout!r} and query D="
                           f"{head_dim}; the page rules out page attention there (it needs "
                           "query D 512 with query_rope/key_rope).")
    if layout == "TND_NTD":
        raise RuntimeError(f"input_layout='TND_NTD' with query D={head_dim}; the page allows "
                           "TND_NTD only for query D 512 (MLA page attention); use 'TND' or "
                           "'NTD_TND'.")
    if q.dtype != torch.bfloat16:
        raise RuntimeError(f"query has dtype {q.dtype}; with input_layout={layout!r} and "
                           f"query D={head_dim} the page allows bfloat16 only.")
    if heads not in _DENSE_HEADS:
        raise RuntimeError(f"num_heads={heads}; with input_layout={layout!r} and query D="
                           f"{head_dim} the page allows {list(_DENSE_HEADS)}.")
    if kv_heads_arg not in (0, heads):
        raise RuntimeError(f"num_key_value_heads={kv_heads_arg}; with input_layout={layout!r} "
                           f"and query D={head_dim} key and value have num_heads={heads} heads "
                           "(0 or equal).")
    if batch > _MAX_DENSE_BATCH:
        raise RuntimeError(f"actual_seq_lengths has {batch} values; the page allows at most "
                           f"{_MAX_DENSE_BATCH} here.")
    if rope:
        qk_dim, value_dims = 128, (128,)
    else:
        if head_dim == 512:
            raise RuntimeError("query D=512 with input_layout TND needs query_rope/key_rope and "
                               "page attention (the MLA form).")
        qk_dim, value_dims = 192, ((128, 192) if layout == "TND" else (128,))
    if head_dim != qk_dim:
        raise RuntimeError(f"query D={head_dim}; with input_layout={layout!r} "
                           f"{'and query_rope ' if rope else ''}the page requires query and key "
                           f"D {qk_dim}.")
    _check_tnd_shape("key", key, heads, qk_dim, in_layout)
    kv_tokens = _to_tnd(key, in_layout).shape[0]
    _check_tnd_shape("value", value, heads, None, in_layout, kv_tokens)
    value_dim = _to_tnd(value, in_layout).shape[2]
    if value_dim not in value_dims:
        raise RuntimeError(f"value D={value_dim}; with input_layout={layout!r} the page requires "
                           f"value D in {list(value_dims)}.")
    q_rope_all = None
    if rope:
        _check_tnd_shape("query_rope", given["query_rope"], heads, _ROPE_DIM, in_layout,
                         q.shape[0])
        _check_tnd_shape("key_rope", given["key_rope"], heads, _ROPE_DIM, in_layout, kv_tokens)
        q_rope_all = _to_tnd(given["query_rope"], in_layout)
    kv_lens, kv_starts = _cumulative("actual_seq_lengths_kv", given["actual_seq_lengths_kv"],
                                     kv_tokens, "key's T")
    if len(kv_lens) != batch:
        raise RuntimeError(f"actual_seq_lengths_kv has {len(kv_lens)} values but "
                           f"actual_seq_lengths has {batch}; with input_layout={layout!r} both "
                           "hold one cumulative length per batch.")
    if causal:
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            # The page says actualSeqLengths < actualSeqLengthsKv per batch; callers (a fresh
            # prompt: equal lengths) pass equal ones, which the real op takes.
            if q_len > kv_len:
                raise RuntimeError(f"batch {b}: query length {q_len} exceeds key length "
                                   f"{kv_len}; with sparse_mode=3 and input_layout={layout!r} "
                                   "each batch's query length must not exceed its key length.")
    k_all, v_all = _to_tnd(key, in_layout), _to_tnd(value, in_layout)
    k_rope_all = _to_tnd(given["key_rope"], in_layout) if rope else None

    def kv_of(b):
        rows = slice(kv_starts[b], kv_starts[b] + kv_lens[b])
        return k_all[rows], v_all[rows], (k_rope_all[rows] if rope else None)

    return kv_of, q_rope_all, value_dim


def _paged_lengths(given, layout, batch, block, num_blocks, block_table):
    kv_lens = _per_batch("actual_seq_lengths_kv", given["actual_seq_lengths_kv"], batch)
    needed = sum(-(-length // block) for length in kv_lens)
    if needed > num_blocks:
        raise RuntimeError(f"the caches hold {num_blocks} blocks, fewer than the {needed} the "
                           "batches' lengths need.")
    _check_table_covers(block_table, kv_lens, block, num_blocks)
    return kv_lens


def _mla_paged(given, layout, q, heads, kv_heads_arg, q_lens, causal, batch):
    """query D 512 with rope: MLA page attention in TND / TND_NTD."""
    key, value, key_rope = given["key"], given["value"], given["key_rope"]
    if layout == "NTD_TND":
        raise RuntimeError("input_layout='NTD_TND' with query D=512; the page allows TND and "
                           "TND_NTD there.")  # reached without block_table
    if heads not in _MLA_HEADS:
        raise RuntimeError(f"num_heads={heads}; with query_rope and query D 512 the page takes "
                           f"{list(_MLA_HEADS)}.")
    if kv_heads_arg != 1:
        raise RuntimeError(f"num_key_value_heads={kv_heads_arg}; with query D 512 and key_rope "
                           "the page needs one latent KV head (num_key_value_heads=1).")
    _check_tnd_shape("query_rope", given["query_rope"], heads, _ROPE_DIM, "TND", q.shape[0])
    for b, q_len in enumerate(q_lens):
        if not 1 <= q_len <= 16:
            raise RuntimeError(f"batch {b} has {q_len} query tokens; with query D 512 the page "
                               "takes 1 to 16 per batch.")
    if not causal and max(q_lens) > 1:
        raise RuntimeError("sparse_mode=0 with more than one query token in a batch; with "
                           "query D 512 the page takes sparse_mode=3 and the compressed mask "
                           "when a batch has several query tokens.")
    if given["softmax_lse_flag"]:
        raise RuntimeError("softmax_lse_flag=True; the page rules out the softmax LSE with "
                           "query D 512 (MLA).")
    block_table = given["block_table"]
    if block_table is None:
        raise RuntimeError("block_table is None; with query D 512 the page requires page "
                           "attention (block_table and block_size).")
    block = _check_mla_caches(given, key, value, key_rope, batch)
    kv_lens = _paged_lengths(given, layout, batch, block, key.shape[0], block_table)
    if causal:
        for b, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens, strict=True)):
            if q_len > kv_len:
                raise RuntimeError(f"batch {b}: query length {q_len} exceeds key length "
                                   f"{kv_len} (actual_seq_lengths_kv[{b}]); rightDownCausal "
                                   "would leave query rows with no key.")

    def kv_of(b):
        row = block_table[b]
        return (_paged_sequence(key, row, kv_lens[b], block, 1),
                _paged_sequence(value, row, kv_lens[b], block, 1),
                _paged_sequence(key_rope, row, kv_lens[b], block, 1))

    return kv_of, given["query_rope"], 512


def _gqa_paged(given, layout, q, heads, kv_heads_arg, q_lens, batch):
    """TND query with page attention and no rope (the form vLLM-Ascend calls)."""
    key, value, block_table = given["key"], given["value"], given["block_table"]
    head_dim = q.shape[2]
    if head_dim == 512:
        raise RuntimeError("query D=512 with input_layout TND needs query_rope/key_rope (the "
                           "MLA form).")
    if head_dim % 16 or head_dim > 512:
        raise RuntimeError(f"head dim D={head_dim}; with float16/bfloat16 inputs it must be a "
                           "multiple of 16 and at most 512.")
    if heads < 1 or heads > 256:
        raise RuntimeError(f"num_heads={heads}; it must be in [1, 256].")
    kv_heads = kv_heads_arg or heads
    if heads % kv_heads or heads // kv_heads > 64:
        raise RuntimeError(f"num_heads={heads} and num_key_value_heads={kv_heads}: num_heads "
                           "must be a multiple of num_key_value_heads, at most 64 times it.")
    _check_block_table(block_table, batch)
    block = _require_int("block_size", given["block_size"])
    if max(q_lens, default=0) <= 1:
        if block <= 0 or block % 16:
            raise RuntimeError(f"block_size={block}; with one query token per batch and "
                               "float16/bfloat16 caches it must be a positive multiple of 16.")
    elif block not in (128, 256, 384, 512):
        raise RuntimeError(f"block_size={block}; page attention with several query tokens in a "
                           "batch needs 128 to 512 in steps of 128.")
    if tuple(key.shape) != tuple(value.shape):
        raise RuntimeError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have "
                           "the same shape.")
    hidden = (key.dim() == 3 and key.shape[1:] == (block, kv_heads * head_dim))
    split = (key.dim() == 4 and key.shape[1:] == (kv_heads, block, head_dim))
    if not (hidden or split):
        raise RuntimeError(f"key has shape {tuple(key.shape)}; for page attention with "
                           f"input_layout='TND' it must be (num_blocks, block_size={block}, "
                           f"num_key_value_heads * D = {kv_heads * head_dim}) or (num_blocks, "
                           f"num_key_value_heads={kv_heads}, block_size={block}, D={head_dim}).")
    if hidden and kv_heads * head_dim > 65535:
        raise RuntimeError(f"num_key_value_heads * D = {kv_heads * head_dim} exceeds 65535, "
                           "which the (num_blocks, block_size, H) cache layout cannot address.")
    if split:  # (num_blocks, KV_N, block_size, D) -> (num_blocks, block_size, KV_N * D)
        key = key.transpose(1, 2).reshape(key.shape[0], block, -1)
        value = value.transpose(1, 2).reshape(value.shape[0], block, -1)
    kv_lens = _paged_lengths(given, layout, batch, block, key.shape[0], block_table)

    def kv_of(b):
        row = block_table[b]
        return (_paged_sequence(key, row, kv_lens[b], block, kv_heads),
                _paged_sequence(value, row, kv_lens[b], block, kv_heads), None)

    return kv_of, None, head_dim
