"""Quantized key/value (antiquant) for ``npu_fused_infer_attention_score``: int8 ``key`` and
``value`` dequantised inside the op, ``(x + offset) * scale`` (Ascend's antiquant
convention, as ``npu_weight_quant_batchmatmul``), before attention in float32.

Follows Ascend/op-plugin ``docs/context/torch_npu-npu_fused_infer_attention_score.md``
(the antiquant_scale / antiquant_offset constraints, "kv伪量化参数分离" and its tables for
Q_S > 1 and Q_S = 1; Atlas A2/A3). Modelled:

- **one pair** ``antiquant_scale`` / ``antiquant_offset`` for key and value (index 0
  key, 1 value), offset optional (symmetric without it):
  - Q_S = 1: ``antiquant_mode`` 0, per-channel ``(2, N, 1, D)`` (BNSD), ``(2, N, D)``
    (BSND), ``(2, H)`` (BSH) with N = ``num_key_value_heads``, or per-tensor ``(2,)``, the
    query's dtype; ``antiquant_mode`` 1, per-token ``(2, B, KV_S)`` float32 (dense
    key/value only);
  - Q_S > 1: ``antiquant_mode`` has no effect; the shape picks per-tensor ``(2,)`` or
    per-channel; float16 query only; no page attention.
- **separate** ``key_antiquant_scale`` / ``value_antiquant_scale`` (+ offsets; they win
  over the pair when both are given, as the page says):
  - Q_S > 1 (at most 16): ``key_antiquant_mode`` = ``value_antiquant_mode`` 0, per-channel
    ``(N, D)`` or ``(H,)`` bfloat16, or 1, per-token ``(B, KV_S)`` float32; bfloat16 query;
    no page attention;
  - Q_S = 1: mode 0, per-channel ``(1, N, 1, D)``, ``(1, N, D)``, ``(1, H)`` or per-tensor
    ``(1,)`` in the query's dtype; mode 1, per-token ``(1, B, KV_S)`` float32 (dense
    key/value only); key mode 0 with value mode 1 (float16 query). Modes 2 to 5 (per-head
    and page-managed scales) raise the unmodelled error.
"""

from __future__ import annotations

import torch

from torch_npu._ops import _require_tensor
from torch_npu._unmodelled import unmodelled_argument

_OP = "npu_fused_infer_attention_score"


def _describe(shapes) -> str:
    return " or ".join(str(tuple(s)) for s in shapes)


class _Dequant:
    """One tensor's scale and offset: ``kind`` 'channel' (``[KV_N, D]``), 'tensor' (scalar)
    or 'token' (``[B, KV_S]``)."""

    def __init__(self, kind: str, scale: torch.Tensor, offset: torch.Tensor | None,
                 kv_heads: int, head_dim: int):
        self.kind = kind
        if kind == "channel":
            self.scale = scale.float().reshape(kv_heads, head_dim)
            self.offset = None if offset is None else offset.float().reshape(kv_heads, head_dim)
        elif kind == "tensor":
            self.scale = scale.float().reshape(())
            self.offset = None if offset is None else offset.float().reshape(())
        else:
            self.scale = scale.float().reshape(scale.shape[-2], scale.shape[-1])
            self.offset = None if offset is None else offset.float().reshape(self.scale.shape)

    def __call__(self, b: int, x: torch.Tensor) -> torch.Tensor:
        """``x``: one batch's int8 rows ``[kv_len, KV_N, D]`` -> float32."""
        scale, offset = self.scale, self.offset
        if self.kind == "token":
            length = x.shape[0]
            scale = scale[b, :length].reshape(length, 1, 1)
            offset = None if offset is None else offset[b, :length].reshape(length, 1, 1)
        values = x.float()
        if offset is not None:
            values = values + offset
        return values * scale


def _check_pair(scale_name, scale, offset_name, offset):
    _require_tensor(scale_name, scale)
    if offset is not None:
        _require_tensor(offset_name, offset)
        if offset.shape != scale.shape or offset.dtype != scale.dtype:
            raise RuntimeError(f"{offset_name} is {offset.dtype} {tuple(offset.shape)}; it must "
                               f"have {scale_name}'s shape {tuple(scale.shape)} and dtype "
                               f"{scale.dtype}.")


def _require_dtype(name, tensor, dtype, why):
    if tensor.dtype != dtype:
        raise RuntimeError(f"{name} has dtype {tensor.dtype}; {why} it must be {dtype}.")


def kv_dequantizers(given: dict, layout: str, batch: int, kv_heads: int, head_dim: int,
                    q_s: int, kv_s: int | None, paged: bool, quantized: bool):
    """Check the antiquant arguments; return ``(key_dequant, value_dequant)`` (callables
    ``(b, rows) -> float32``) for int8 key/value, or None for float16/bfloat16 ones."""
    names = ("antiquant_scale", "antiquant_offset", "key_antiquant_scale",
             "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset")
    present = [name for name in names if given[name] is not None]
    modes = {name: given[name] for name in ("antiquant_mode", "key_antiquant_mode",
                                            "value_antiquant_mode")}
    for name, mode in modes.items():
        if isinstance(mode, bool) or not isinstance(mode, int):
            raise TypeError(f"{name} must be an int, got {type(mode).__name__}.")
    if q_s == 1 and modes["antiquant_mode"] not in (0, 1):
        raise RuntimeError(f"antiquant_mode={modes['antiquant_mode']}; with Q_S = 1 the page "
                           "allows 0 (per-channel) or 1 (per-token).")
    for name in ("key_antiquant_mode", "value_antiquant_mode"):
        allowed = (0, 1, 2, 3, 4, 5) if q_s == 1 else (0, 1)
        if modes[name] not in allowed:
            raise RuntimeError(f"{name}={modes[name]}; with Q_S {'= 1' if q_s == 1 else '> 1'} "
                               f"the page allows {list(allowed)}.")
    if not quantized:
        if present:
            raise RuntimeError(f"{present[0]} is given but key and value are "
                               f"{given['key'].dtype}; the page's antiquant arguments take int8 "
                               "key and value.")
        return None
    separate = any(given[name] is not None for name in names[2:])
    if not separate and given["antiquant_scale"] is None:
        raise RuntimeError("key and value are int8 but neither antiquant_scale nor "
                           "key_antiquant_scale/value_antiquant_scale is given; int8 key/value "
                           "are dequantised with them.")
    query = given["query"]
    if separate:
        return _separate(given, layout, batch, kv_heads, head_dim, q_s, kv_s, paged, query,
                         modes)
    return _combined(given, layout, batch, kv_heads, head_dim, q_s, kv_s, paged, query,
                     modes["antiquant_mode"])


def _combined(given, layout, batch, kv_heads, head_dim, q_s, kv_s, paged, query, mode):
    scale, offset = given["antiquant_scale"], given["antiquant_offset"]
    _check_pair("antiquant_scale", scale, "antiquant_offset", offset)
    channel = {"BNSD": (2, kv_heads, 1, head_dim), "BSND": (2, kv_heads, head_dim),
               "BSH": (2, kv_heads * head_dim)}[layout]
    if q_s > 1:
        if paged:
            raise RuntimeError("antiquant_scale with page attention and Q_S > 1; the page rules "
                               "out antiquant with page attention there.")
        _require_dtype("query", query, torch.float16, "with antiquant_scale and Q_S > 1 (int8 "
                       "dequantised to float16 only)")
        mode = 0  # the page: antiquant_mode has no effect when Q_S >= 2; the shape decides
    if mode == 0:
        if tuple(scale.shape) == (2,):
            kind = "tensor"
        elif tuple(scale.shape) == channel:
            kind = "channel"
        else:
            raise RuntimeError(f"antiquant_scale has shape {tuple(scale.shape)}; with "
                               f"input_layout={layout!r} and antiquant_mode=0 it must be "
                               f"per-channel {channel} or per-tensor (2,).")
        _require_dtype("antiquant_scale", scale, query.dtype, "per-channel / per-tensor, "
                       "like the query,")
    else:
        if paged:
            raise unmodelled_argument(_OP, "antiquant_mode", 1)  # per-token of a paged cache
        want = (2, batch, kv_s)
        if tuple(scale.shape) != want:
            raise RuntimeError(f"antiquant_scale has shape {tuple(scale.shape)}; with "
                               f"antiquant_mode=1 (per-token) it must be {want} (2, B, KV_S).")
        _require_dtype("antiquant_scale", scale, torch.float32, "per-token")
        kind = "token"
    dequants = []
    for index in (0, 1):
        dequants.append(_Dequant(kind, scale[index], None if offset is None else offset[index],
                                 kv_heads, head_dim))
    return tuple(dequants)


def _separate(given, layout, batch, kv_heads, head_dim, q_s, kv_s, paged, query, modes):
    k_scale, v_scale = given["key_antiquant_scale"], given["value_antiquant_scale"]
    k_offset, v_offset = given["key_antiquant_offset"], given["value_antiquant_offset"]
    if (k_scale is None) != (v_scale is None):
        raise RuntimeError("key_antiquant_scale and value_antiquant_scale must be given "
                           "together (the page: both or neither).")
    if (k_offset is None) != (v_offset is None):
        raise RuntimeError("key_antiquant_offset and value_antiquant_offset must be given "
                           "together (the page: both or neither).")
    if k_scale is None:
        raise RuntimeError("key_antiquant_offset is given without key_antiquant_scale / "
                           "value_antiquant_scale.")
    k_mode, v_mode = modes["key_antiquant_mode"], modes["value_antiquant_mode"]
    if k_mode != v_mode and not (q_s == 1 and (k_mode, v_mode) == (0, 1)):
        raise RuntimeError(f"key_antiquant_mode={k_mode} and value_antiquant_mode={v_mode}; "
                           "the page needs them equal (or key 0 with value 1 when Q_S = 1).")
    for name, mode in (("key_antiquant_mode", k_mode), ("value_antiquant_mode", v_mode)):
        if mode > 1:
            raise unmodelled_argument(_OP, name, mode)
    hidden = kv_heads * head_dim
    if q_s > 1:
        if q_s > 16:
            raise RuntimeError(f"Q_S={q_s} with key_antiquant_scale; the page allows query S up "
                               "to 16 there.")
        if paged:
            raise RuntimeError("key_antiquant_scale with page attention and Q_S > 1; the page "
                               "rules out page attention there.")
        _require_dtype("query", query, torch.bfloat16, "with key_antiquant_scale and Q_S > 1")
        channel_shapes = [(kv_heads, head_dim), (hidden,)]
        channel_dtype, tensor_shapes = torch.bfloat16, []
        token_shape = (batch, kv_s)
    else:
        if (k_mode, v_mode) == (0, 1):
            _require_dtype("query", query, torch.float16, "with key_antiquant_mode=0 and "
                           "value_antiquant_mode=1 (int8 key/value)")
        channel_shapes = [(1, kv_heads, 1, head_dim), (1, kv_heads, head_dim), (1, hidden)]
        channel_dtype, tensor_shapes = query.dtype, [(1,)]
        token_shape = (1, batch, kv_s)
    if k_scale.shape != v_scale.shape and k_mode == v_mode:
        raise RuntimeError(f"key_antiquant_scale {tuple(k_scale.shape)} and "
                           f"value_antiquant_scale {tuple(v_scale.shape)} must have one shape.")
    dequants = []
    for which, scale, offset, mode in (("key", k_scale, k_offset, k_mode),
                                       ("value", v_scale, v_offset, v_mode)):
        scale_name, offset_name = f"{which}_antiquant_scale", f"{which}_antiquant_offset"
        _check_pair(scale_name, scale, offset_name, offset)
        shape = tuple(scale.shape)
        if mode == 0:
            if shape in channel_shapes:
                kind = "channel"
            elif shape in tensor_shapes:
                kind = "tensor"
            else:
                raise RuntimeError(f"{scale_name} has shape {shape}; with {which}_antiquant_mode="
                                   f"0 the page takes {_describe(channel_shapes + tensor_shapes)}.")
            _require_dtype(scale_name, scale, channel_dtype, "per-channel / per-tensor")
        else:
            if paged:
                raise unmodelled_argument(_OP, f"{which}_antiquant_mode", 1)
            if shape != token_shape:
                raise RuntimeError(f"{scale_name} has shape {shape}; with {which}_antiquant_mode="
                                   f"1 (per-token) it must be {token_shape}.")
            _require_dtype(scale_name, scale, torch.float32, "per-token")
            kind = "token"
        dequants.append(_Dequant(kind, scale, offset, kv_heads, head_dim))
    return tuple(dequants)
