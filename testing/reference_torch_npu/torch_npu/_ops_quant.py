"""torch_npu's quantization and quantized-matmul ops for weight-quantized and MoE layers,
computed with plain torch on CPU tensors.

The rules of ``torch_npu._ops`` hold: each function follows its page under Ascend/op-plugin
``docs/context/`` (argument names, shapes, dtype tables) for the Atlas A2/A3 rows (the
modelled machine is an Ascend 910B), raises ``RuntimeError`` on what the page rules out
and ``NotImplementedError`` on what it documents but the reference does not model (the
errors of ``torch_npu._ops``). Arithmetic is float32 (integer products exact), cast once
to the output dtype; quantized values round half to even (``torch.round``) and saturate.

int4 packing (``npu_convert_weight_to_int4pack``, ``npu_quantize`` to ``quint4x2``): eight
int4 values per int32 along the last dim, value ``8w + j`` in bits ``4j..4j+3`` of word
``w`` as a two's-complement nibble. The pages only say "packed, interleaved"; this is the
layout CANN's aclnnConvertWeightToINT4Pack writes (two values per byte, the first in the
low nibble; its INT4 and INT32 outputs share one storage), read as little-endian words.
"""

from __future__ import annotations

import torch

from torch_npu._ops import _require_tensor
from torch_npu._unmodelled import refuse_unmodelled

_INT4_MIN, _INT4_MAX = -8, 7
_INT8_MIN, _INT8_MAX = -128, 127
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1
# The page's int32 output; torch_npu's binding names it by torch.qint32 (or torch.int32).
_INT32_OUTPUTS = (torch.qint32, torch.int32)
_HALF = (torch.float16, torch.bfloat16)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_MAX_INNER = 65535


def _require_dtype(name: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...],
                   why: str = "") -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise RuntimeError(f"{name} has dtype {tensor.dtype}; {why or 'supported'}: {names}.")


def _require_not_empty(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        raise RuntimeError(f"{name} is empty (shape {tuple(tensor.shape)}); empty tensors are "
                           "not supported.")


def _require_int(name: str, value, allowed=None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if allowed is not None and value not in allowed:
        raise RuntimeError(f"{name}={value} is not supported; use one of {sorted(allowed)}.")
    return value


def pack_int4_words(values: torch.Tensor) -> torch.Tensor:
    """int4 values (any integer dtype, last dim a multiple of 8) -> int32 words, 8 each."""
    nibbles = (values.to(torch.int64) & 0xF).reshape(*values.shape[:-1], -1, 8)
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (nibbles << shifts).sum(-1)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_int4_words(words: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4_words`: int32 ``[..., w]`` -> int8 ``[..., 8w]``."""
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nibbles = (words.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return signed.reshape(*words.shape[:-1], -1).to(torch.int8)


# --- npu_quantize -------------------------------------------------------------------------


def _quantize_axis(axis: int, dims: int, div_mode: bool) -> int:
    """The dim the scales run along. The page fixes it for ``div_mode=False`` (-2: the
    second-to-last dim, anything above -2: the last dim); for ``div_mode=True`` it is the
    dim ``axis`` names."""
    axis = _require_int("axis", axis)
    if not div_mode:
        if axis < -2 or axis >= dims:
            raise RuntimeError(f"axis={axis}: with div_mode=False it must lie in [-2, "
                               f"{dims - 1}] for a {dims}-dim input.")
        if axis == -2 and dims < 2:
            raise RuntimeError("axis=-2 needs an input of at least 2 dims.")
        return dims - 2 if axis == -2 else dims - 1
    if not -dims <= axis < dims:
        raise RuntimeError(f"axis={axis} is out of range for a {dims}-dim input.")
    return axis % dims


def _broadcast_scales(name: str, scales: torch.Tensor, input: torch.Tensor, dim: int,
                      multi_dim_ok: bool) -> torch.Tensor:
    """``scales`` shaped to broadcast against ``input`` along ``dim``."""
    size = input.shape[dim]
    if scales.dim() == 1:
        if scales.shape[0] not in (1, size):
            raise RuntimeError(f"{name} has shape {tuple(scales.shape)}; a 1-D {name} must "
                               f"have 1 or input.shape[{dim}]={size} values.")
        shape = [1] * input.dim()
        shape[dim] = scales.shape[0]
        return scales.reshape(shape)
    if not multi_dim_ok:
        raise NotImplementedError(f"a {scales.dim()}-dim {name} with div_mode=True is not "
                                  "described by the page and not modelled; pass a 1-D one.")
    if scales.dim() != input.dim() or any(
            s != 1 for i, s in enumerate(scales.shape) if i != dim) or scales.shape[dim] not in (
            1, size):
        raise RuntimeError(f"{name} has shape {tuple(scales.shape)}; a multi-dim {name} must "
                           f"have input's {input.dim()} dims, all 1 except dim {dim} (1 or "
                           f"{size}).")
    return scales


def npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True):
    """``torch_npu.npu_quantize(input, scales, zero_points, dtype, axis=1, div_mode=True)
    -> Tensor``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_quantize.md`` (A2/A3):

    - ``input``: float32, float16 or bfloat16 (non-contiguous allowed), not empty.
    - ``div_mode=True``: ``result = input / scales + zero_points``; ``scales`` float32 or
      bfloat16, ``zero_points`` None or int8, uint8, int32 or bfloat16; both 1-D with 1 or
      ``input.shape[axis]`` values (the page gives no shape rule for this mode; other
      shapes raise ``NotImplementedError``).
    - ``div_mode=False``: ``result = input * scales + zero_points``; ``scales`` float32,
      float16 or bfloat16, 1-D (1 or the axis' size) or multi-dim (input's dims, 1 except
      along the axis); ``zero_points`` None or of ``scales``' shape and dtype; ``axis`` in
      [-2, input.dim()): -2 quantizes along the second-to-last dim, anything else along
      the last.
    - ``dtype``: ``torch.qint8`` (int8 out, saturated to [-128, 127]) in both modes;
      ``torch.quint4x2`` with ``div_mode=False`` (values saturated to [-8, 7] and packed
      eight per int32, so the last dim must be a multiple of 8); ``torch.qint32`` (or
      ``torch.int32``) with ``div_mode=True``: int32 out, rounded half to even (as the
      int8 outputs) and saturated to the int32 range. ``torch.quint8`` output is not
      modelled.
    """
    _require_tensor("input", input)
    _require_tensor("scales", scales)
    _require_dtype("input", input, _FLOATS)
    _require_not_empty("input", input)
    _require_not_empty("scales", scales)
    if not isinstance(div_mode, bool):
        raise TypeError(f"div_mode must be a bool, got {type(div_mode).__name__}.")
    if dtype == torch.quint8:
        raise NotImplementedError(f"dtype={dtype} output is not modelled by the reference "
                                  "torch_npu; use torch.qint8, torch.qint32 or "
                                  "torch.quint4x2.")
    if dtype not in (torch.qint8, torch.quint4x2, *_INT32_OUTPUTS):
        raise RuntimeError(f"dtype must be torch.qint8, torch.quint8, torch.int32 (or "
                           f"torch.qint32) or torch.quint4x2, got {dtype!r}.")
    if dtype == torch.quint4x2 and div_mode:
        raise RuntimeError("dtype=torch.quint4x2 needs div_mode=False.")
    if dtype in _INT32_OUTPUTS and not div_mode:
        raise RuntimeError(f"dtype={dtype} needs div_mode=True; with div_mode=False the page "
                           "allows torch.qint8 and torch.quint4x2.")
    dim = _quantize_axis(axis, input.dim(), div_mode)
    if div_mode:
        _require_dtype("scales", scales, (torch.float32, torch.bfloat16),
                       "with div_mode=True it must be one of")
        if zero_points is not None:
            _require_tensor("zero_points", zero_points)
            _require_dtype("zero_points", zero_points,
                           (torch.int8, torch.uint8, torch.int32, torch.bfloat16),
                           "with div_mode=True it must be one of")
    else:
        _require_dtype("scales", scales, _FLOATS, "with div_mode=False it must be one of")
        if zero_points is not None:
            _require_tensor("zero_points", zero_points)
            if zero_points.shape != scales.shape or zero_points.dtype != scales.dtype:
                raise RuntimeError(f"zero_points ({zero_points.dtype} "
                                   f"{tuple(zero_points.shape)}) must have scales' shape and "
                                   f"dtype ({scales.dtype} {tuple(scales.shape)}) with "
                                   "div_mode=False.")
    scale_b = _broadcast_scales("scales", scales, input, dim, not div_mode).float()
    values = input.float() / scale_b if div_mode else input.float() * scale_b
    if zero_points is not None:
        values = values + _broadcast_scales("zero_points", zero_points, input, dim,
                                            not div_mode).float()
    rounded = torch.round(values)
    if dtype in _INT32_OUTPUTS:
        # Clamped in float64: float32 cannot hold 2**31 - 1, and an out-of-range cast to
        # int32 is undefined.
        return rounded.double().clamp(_INT32_MIN, _INT32_MAX).to(torch.int32)
    if dtype == torch.qint8:
        return rounded.clamp(_INT8_MIN, _INT8_MAX).to(torch.int8)
    if input.shape[-1] % 8:
        raise RuntimeError(f"dtype=torch.quint4x2 packs 8 values per int32: input's last dim "
                           f"{input.shape[-1]} must be a multiple of 8.")
    return pack_int4_words(rounded.clamp(_INT4_MIN, _INT4_MAX))


# --- npu_trans_quant_param ----------------------------------------------------------------

_QUANT_FLAG = 1 << 46  # set in every word the op writes
_OFFSET_SHIFT = 37  # the int9 offset's bits 37..45


def _fp19_bits(bits: torch.Tensor, round_mode: int) -> torch.Tensor:
    """float32 bit patterns (int64 holding 32 bits) -> the top 19 bits the hardware keeps,
    in place: truncated (``round_mode`` 0) or rounded to nearest even (1; zero and
    subnormal inputs become a signed zero, infinities and NaNs are truncated)."""
    if round_mode == 0:
        return bits & 0xFFFFE000
    sign, exponent = (bits >> 31) & 1, (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    kept, round_bit, sticky = mantissa >> 13, (mantissa >> 12) & 1, mantissa & 0xFFF
    normal = (exponent != 0) & (exponent != 0xFF)
    up = normal & (round_bit == 1) & ((sticky != 0) | ((kept & 1) == 1))
    kept = kept + up.to(kept.dtype)
    carry = kept >= (1 << 10)
    kept = torch.where(carry, torch.zeros_like(kept), kept)
    exponent = exponent + carry.to(exponent.dtype)
    fp19 = torch.where(exponent == 0, sign << 18, (sign << 18) | (exponent << 10) | kept)
    return fp19 << 13


def npu_trans_quant_param(scale, offset=None, round_mode=0):
    """``torch_npu.npu_trans_quant_param(scale, offset=None, round_mode=0) -> Tensor``
    (schema ``int? round_mode=0``: None means 0).

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_trans_quant_param.md`` and the
    bit layout of CANN's TransQuantParamV2 (its README): each int64 word holds the float32
    ``scale``'s top 19 bits in bits 0..31 (the low 13 bits cleared: truncated for
    ``round_mode`` 0, rounded to nearest even for 1), bit 46 set, and, with ``offset``,
    ``clamp(round_half_even(offset), -256, 255)`` as a 9-bit two's-complement value in
    bits 37..45 (the real op's test golden for the scale part).

    - ``scale``: float32, 1-D or 2-D, not empty.
    - ``offset``: optional float32, 1-D or 2-D. 1-D ``scale`` and ``offset`` broadcast
      (each of length 1 or of one length ``t``); the result is 1-D of the longer. A 2-D
      ``scale`` takes an ``offset`` of its shape ``(1, n)``.
    """
    round_mode = 0 if round_mode is None else _require_int("round_mode", round_mode, {0, 1})
    _require_tensor("scale", scale)
    if scale.dtype != torch.float32 or scale.dim() not in (1, 2) or scale.numel() == 0:
        raise RuntimeError(f"scale must be a non-empty 1-D or 2-D float32 tensor, got "
                           f"{scale.dtype} {tuple(scale.shape)}.")
    bits = _fp19_bits(scale.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF,
                      round_mode) | _QUANT_FLAG
    if offset is None:
        return bits
    _require_tensor("offset", offset)
    if offset.dtype != torch.float32 or offset.dim() not in (1, 2) or offset.numel() == 0:
        raise RuntimeError(f"offset must be a non-empty 1-D or 2-D float32 tensor, got "
                           f"{offset.dtype} {tuple(offset.shape)}.")
    if scale.dim() == 2:
        if tuple(offset.shape) != tuple(scale.shape) or scale.shape[0] != 1:
            raise RuntimeError(f"with a 2-D scale, scale and offset must both be (1, n); got "
                               f"{tuple(scale.shape)} and {tuple(offset.shape)}.")
    elif offset.dim() != 1 or 1 not in (scale.shape[0], offset.shape[0]) and \
            scale.shape[0] != offset.shape[0]:
        raise RuntimeError(f"1-D scale and offset must have one length or length 1; got "
                           f"{tuple(scale.shape)} and {tuple(offset.shape)}.")
    int9 = torch.round(offset).clamp(-256, 255).to(torch.int64) & 0x1FF
    return bits | (int9 << _OFFSET_SHIFT)


def decode_trans_quant_param(words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (float32 scale, int offset) an int64 word of ``npu_trans_quant_param`` holds:
    the scale as the 19 bits the hardware kept."""
    scale = (words & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    offset = (words >> _OFFSET_SHIFT) & 0x1FF
    return scale, torch.where(offset >= 256, offset - 512, offset)


# --- npu_convert_weight_to_int4pack -------------------------------------------------------


def npu_convert_weight_to_int4pack(weight, inner_k_tiles=0):
    """``torch_npu.npu_convert_weight_to_int4pack(weight, inner_k_tiles=0) -> Tensor``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_convert_weight_to_int4pack.md``:
    ``weight`` int32, 2-D (``(k, n)`` or ``(n, k)``), contiguous, not empty, the last dim
    a multiple of 8, every value in [-8, 7]; ``inner_k_tiles`` is reserved (only 0).
    Returns int32 ``(dim0, dim1 / 8)``, eight int4 values per word in the module's order.
    """
    _require_tensor("weight", weight)
    _require_dtype("weight", weight, (torch.int32,))
    if weight.dim() != 2:
        raise RuntimeError(f"weight must be 2-D ((k, n) or (n, k)), got {weight.dim()} dims.")
    _require_not_empty("weight", weight)
    if not weight.is_contiguous():
        raise RuntimeError("weight is not contiguous; non-contiguous tensors are not supported.")
    if weight.shape[-1] % 8:
        raise RuntimeError(f"weight's last dim {weight.shape[-1]} must be a multiple of 8.")
    _require_int("inner_k_tiles", inner_k_tiles, {0})
    low, high = int(weight.min()), int(weight.max())
    if low < _INT4_MIN or high > _INT4_MAX:
        raise RuntimeError(f"weight holds values in [{low}, {high}]; int4 values must lie in "
                           f"[{_INT4_MIN}, {_INT4_MAX}].")
    return pack_int4_words(weight)


# --- npu_weight_quant_batchmatmul ---------------------------------------------------------


def _unpacked_weight(weight: torch.Tensor, k: int) -> torch.Tensor:
    """The ``(k, n)`` int values of an int8 weight or an int32 int4-packed one: packed
    ``(k, n / 8)`` contiguous, or ``(k / 8, n)`` as the transpose of a contiguous
    ``(n, k / 8)``."""
    if weight.dtype == torch.int8:
        return weight
    if weight.shape[0] == k and weight.is_contiguous():
        return unpack_int4_words(weight)
    if weight.shape[0] * 8 == k and weight.t().is_contiguous():
        return unpack_int4_words(weight.t()).t()
    raise RuntimeError(f"an int32 (packed int4) weight of shape {tuple(weight.shape)} does not "
                       f"fit K={k}: pass (K, N/8) contiguous, or (K/8, N) transposed from a "
                       "contiguous (N, K/8).")


def npu_weight_quant_batchmatmul(x, weight, antiquant_scale, antiquant_offset=None,
                                 quant_scale=None, quant_offset=None, bias=None,
                                 antiquant_group_size=0, inner_precise=0, weight_dtype=None):
    """``torch_npu.npu_weight_quant_batchmatmul(x, weight, antiquant_scale,
    antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
    antiquant_group_size=0, inner_precise=0, weight_dtype=None) -> Tensor`` (op-plugin's
    schema; ``weight_dtype``, which reinterprets ``weight`` as a type torch has no dtype
    for, is not modelled other than None).

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_weight_quant_batchmatmul.md``,
    the A2/A3 rules, ND format:

    - ``x``: float16 or bfloat16 ``(M, K)`` (transposed views allowed).
    - ``weight``: int8 ``(K, N)``, or int32 holding int4 (from
      ``npu_convert_weight_to_int4pack``): ``(K, N/8)``, or ``(K/8, N)`` transposed from a
      contiguous ``(N, K/8)``. K and N in [1, 65535]; nothing empty.
    - ``antiquant_scale``: ``x``'s dtype; per tensor ``(1,)``/``(1, 1)``, per channel
      ``(N,)``/``(1, N)``, per group ``(ceil(K / antiquant_group_size), N)``. int64
      scales (``npu_trans_quant_param``) are not modelled.
    - ``antiquant_offset``: None or ``antiquant_scale``'s shape and dtype (int32 offsets
      go with int64 scales: not modelled).
    - ``bias``: None or ``(N,)``/``(1, N)``, contiguous; float32 for bfloat16 ``x``,
      float16 for float16 ``x``.
    - ``antiquant_group_size``: 0, or per group a multiple of 32 in [32, K - 1].
    - ``quant_scale``/``quant_offset`` (int8 output) are not modelled; ``inner_precise``
      0 or 1 (a speed/precision hint; both compute the same here).

    ``y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias`` in ``x``'s dtype.
    """
    refuse_unmodelled("npu_weight_quant_batchmatmul", weight_dtype=weight_dtype)
    for name, value in (("x", x), ("weight", weight), ("antiquant_scale", antiquant_scale)):
        _require_tensor(name, value)
        _require_not_empty(name, value)
    _require_dtype("x", x, _HALF)
    if x.dim() != 2 or weight.dim() != 2:
        raise RuntimeError(f"x and weight must be 2-D ((M, K), (K, N)), got {x.dim()} and "
                           f"{weight.dim()} dims.")
    _require_dtype("weight", weight, (torch.int8, torch.int32))
    if quant_scale is not None or quant_offset is not None:
        raise NotImplementedError("quant_scale/quant_offset (int8 output) are not modelled "
                                  "by the reference torch_npu.")
    _require_int("inner_precise", inner_precise, {0, 1})
    group_size = _require_int("antiquant_group_size", antiquant_group_size)
    m, k = x.shape
    w = _unpacked_weight(weight, k)
    if w.shape[0] != k:
        raise RuntimeError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not "
                           "multiply: weight must be (K, N).")
    n = w.shape[1]
    if not (1 <= k <= _MAX_INNER and 1 <= n <= _MAX_INNER):
        raise RuntimeError(f"K={k} and N={n} must lie in [1, {_MAX_INNER}].")
    if antiquant_scale.dtype == torch.int64:
        raise NotImplementedError("int64 antiquant_scale (npu_trans_quant_param) is not "
                                  "modelled by the reference torch_npu.")
    if antiquant_scale.dtype != x.dtype:
        raise RuntimeError(f"antiquant_scale has dtype {antiquant_scale.dtype}; it must be x's "
                           f"{x.dtype}.")
    shape = tuple(antiquant_scale.shape)
    if group_size:
        if group_size % 32 or not 32 <= group_size <= k - 1:
            raise RuntimeError(f"antiquant_group_size={group_size} must be a multiple of 32 in "
                               f"[32, K-1={k - 1}].")
        groups = -(-k // group_size)
        if shape != (groups, n):
            raise RuntimeError(f"per-group antiquant_scale must be (ceil(K/group)={groups}, "
                               f"N={n}), got {shape}.")
    elif shape not in ((1,), (1, 1), (n,), (1, n)):
        raise RuntimeError(f"antiquant_scale has shape {shape}; use (1,)/(1, 1) per tensor or "
                           f"({n},)/(1, {n}) per channel (or set antiquant_group_size).")
    if antiquant_offset is not None:
        _require_tensor("antiquant_offset", antiquant_offset)
        if antiquant_offset.dtype == torch.int32:
            raise NotImplementedError("int32 antiquant_offset (with int64 antiquant_scale) "
                                      "is not modelled by the reference torch_npu.")
        if antiquant_offset.dtype != antiquant_scale.dtype or tuple(
                antiquant_offset.shape) != shape:
            raise RuntimeError(f"antiquant_offset ({antiquant_offset.dtype} "
                               f"{tuple(antiquant_offset.shape)}) must have antiquant_scale's "
                               f"dtype and shape ({antiquant_scale.dtype} {shape}).")
    if bias is not None:
        _require_tensor("bias", bias)
        want = torch.float32 if x.dtype == torch.bfloat16 else torch.float16
        if bias.dtype != want:
            raise RuntimeError(f"bias has dtype {bias.dtype}; with {x.dtype} x it must be "
                               f"{want}.")
        if tuple(bias.shape) not in ((n,), (1, n)):
            raise RuntimeError(f"bias must be ({n},) or (1, {n}), got {tuple(bias.shape)}.")
        if not bias.is_contiguous():
            raise RuntimeError("bias is not contiguous; non-contiguous bias is not supported.")

    values = w.float()
    if group_size:
        rows = torch.arange(k) // group_size
        scale = antiquant_scale.float()[rows]
        offset = None if antiquant_offset is None else antiquant_offset.float()[rows]
    else:
        scale = antiquant_scale.float().reshape(1, -1)
        offset = None if antiquant_offset is None else antiquant_offset.float().reshape(1, -1)
    if offset is not None:
        values = values + offset
    out = x.float() @ (values * scale)
    if bias is not None:
        out = out + bias.float().reshape(1, n)
    return out.to(x.dtype)


# --- npu_grouped_matmul -------------------------------------------------------------------

_GMM_MAX_GROUPS = 1024
_GMM_MAX_LIST = 128


def _as_list(name: str, value) -> list:
    if value is None:
        return []
    if isinstance(value, torch.Tensor) or not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(value).__name__}.")
    for item in value:
        _require_tensor(f"{name}[i]", item)
    return list(value)


def _group_bounds(group_list: torch.Tensor, list_type: int, rows: int,
                  groups: int) -> list[tuple[int, int]]:
    if group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise RuntimeError(f"group_list must be a 1-D int64 tensor, got {group_list.dtype} "
                           f"{tuple(group_list.shape)}.")
    if group_list.shape[0] != groups:
        raise RuntimeError(f"group_list has {group_list.shape[0]} entries; it must have one per "
                           f"weight group ({groups}).")
    values = [int(v) for v in group_list.tolist()]
    if any(v < 0 for v in values):
        raise RuntimeError(f"group_list holds negative values {values}.")
    if list_type == 0:
        if any(b < a for a, b in zip(values, values[1:], strict=False)):
            raise RuntimeError(f"group_list_type=0 takes a non-decreasing cumsum, got {values}.")
        ends = values
    else:
        if len(values) == 1:
            raise RuntimeError("group_list_type=1 needs more than one group.")
        ends, total = [], 0
        for v in values:
            total += v
            ends.append(total)
    if ends[-1] != rows:
        raise RuntimeError(f"group_list covers {ends[-1]} rows but x has {rows}.")
    starts = [0] + ends[:-1]
    return list(zip(starts, ends, strict=True))


def _grouped_matmul_multi_x(xs, ws, biases, scale, per_token_scale, group_list, split_item,
                            group_type, group_list_type, act_type, output_dtype) -> list:
    """``npu_grouped_matmul`` with one x tensor per group, the page's A2/A3 rows for a
    Tensor (or no) ``group_list``: float16 / bfloat16 (``bias`` float16 / float32 per group,
    ``y_i = x_i @ weight_i + bias_i``) or int8 with per-group scales
    (``_multi_x_int8_products``):

    - ``group_type=-1``, multi-multi-multi: ``split_item`` 0 or 1, ``group_list`` None;
      the x tensors share a rank of 2 to 6 dims, each weight is 2-D ``(K_i, N_i)``; one
      output per group, of x's rank.
    - ``group_type=0``, multi-multi-single: ``split_item`` 2 or 3; 2-D x and weight
      tensors, every weight of one N; the groups' results stacked along M in one tensor;
      a ``group_list`` given must describe the x tensors' rows (its cumsum's steps for
      ``group_list_type`` 0, its values for 1).

    Either way x must not be transposed, and the weights are all transposed or none.
    float32 takes the single-tensor forms only (the page's dtype table)."""
    if len(xs) != len(ws):
        raise RuntimeError(f"x holds {len(xs)} tensors and weight {len(ws)}; the multi-tensor "
                           f"forms take one of each per group.")
    if len(ws) > _GMM_MAX_LIST:
        raise RuntimeError(f"weight holds {len(ws)} tensors; the list is at most "
                           f"{_GMM_MAX_LIST} long.")
    dtype = xs[0].dtype
    if dtype == torch.int32:
        raise NotImplementedError("torch_npu.npu_grouped_matmul: x in int32 (int4-packed) with "
                                  "group_type=-1 or several x tensors is not modelled.")
    quantized = dtype == torch.int8
    scales, tokens = _as_list("scale", scale), _as_list("per_token_scale", per_token_scale)
    if not quantized:
        if dtype not in _HALF:
            raise RuntimeError(f"x has dtype {dtype}; the multi-tensor forms take float16, "
                               "bfloat16 or int8 (float32 only with single x, weight and y).")
        if scales or tokens:
            raise RuntimeError("scale and per_token_scale belong to int8 inputs.")
    if act_type:
        raise NotImplementedError(f"act_type={act_type} (a fused activation) is not "
                                  "modelled.")
    if group_type not in (-1, 0):
        raise RuntimeError(f"group_type={group_type!r}: several x tensors take -1 "
                           "(multi-multi-multi) or 0 (multi-multi-single).")
    if not quantized and output_dtype not in (None, dtype):
        raise RuntimeError(f"output_dtype must be None or x's {dtype}, got {output_dtype}.")
    for i, (xt, w) in enumerate(zip(xs, ws, strict=True)):
        if xt.dtype != dtype or w.dtype != dtype:
            raise RuntimeError(f"group {i}: x {xt.dtype} and weight {w.dtype}; every tensor "
                               f"must be {dtype}.")
        if w.dim() != 2:
            raise RuntimeError(f"weight[{i}] must be 2-D (K, N), got {w.dim()} dims.")
        if not xt.is_contiguous():
            raise RuntimeError(f"x[{i}] is not contiguous; x does not support transposition.")
        if xt.shape[-1] != w.shape[0]:
            raise RuntimeError(f"group {i}: x's last dim {xt.shape[-1]} is not weight's K "
                               f"{w.shape[0]}.")
        if xt.shape[-1] > _MAX_INNER or w.shape[1] > _MAX_INNER:
            raise RuntimeError(f"group {i}: the last dims of x and weight must stay below "
                               f"65536.")
    if len({w.is_contiguous() for w in ws}) > 1:
        raise RuntimeError("the weights must all be transposed or none of them.")
    if quantized:
        bias_dtype = torch.int32
        product = _multi_x_int8_products(xs, ws, biases, scales, tokens, output_dtype)
    else:
        bias_dtype = torch.float16 if dtype == torch.float16 else torch.float32
    if biases and (len(biases) != len(ws) or any(
            b.dtype != bias_dtype or tuple(b.shape) != (w.shape[1],)
            for b, w in zip(biases, ws, strict=False))):
        raise RuntimeError(f"bias must hold one (N_i,) {bias_dtype} tensor per weight.")

    if not quantized:
        def product(i: int) -> torch.Tensor:
            out = xs[i].float() @ ws[i].float()
            return (out + biases[i].float() if biases else out).to(dtype)

    if group_type == -1:
        if split_item not in (0, 1):
            raise RuntimeError(f"group_type=-1 (multi-multi-multi) takes split_item 0 or 1, "
                               f"got {split_item}.")
        if group_list is not None:
            raise RuntimeError("group_type=-1 takes no group_list.")
        if len({xt.dim() for xt in xs}) > 1 or not 2 <= xs[0].dim() <= 6:
            raise RuntimeError(f"the x tensors must share one rank of 2 to 6 dims, got "
                               f"{[xt.dim() for xt in xs]}.")
        return [product(i) for i in range(len(xs))]
    if split_item not in (2, 3):
        raise RuntimeError(f"several x tensors with group_type=0 (multi-multi-single) take "
                           f"split_item 2 or 3, got {split_item}.")
    if any(xt.dim() != 2 for xt in xs) or len({w.shape[1] for w in ws}) > 1:
        raise RuntimeError("multi-multi-single takes 2-D x tensors and weights of one N.")
    if group_list is not None:
        if not isinstance(group_list, torch.Tensor):
            raise NotImplementedError("only a Tensor group_list is modelled.")
        if group_list_type == 2:
            raise NotImplementedError("group_list_type=2 ([E, 2] pairs) is not modelled.")
        rows = sum(xt.shape[0] for xt in xs)
        bounds = _group_bounds(group_list, group_list_type, rows, len(ws))
        if [end - start for start, end in bounds] != [xt.shape[0] for xt in xs]:
            raise RuntimeError(f"group_list {group_list.tolist()} does not describe the x "
                               f"tensors' rows {[xt.shape[0] for xt in xs]}.")
    return [torch.cat([product(i) for i in range(len(xs))])]


def _multi_x_int8_products(xs, ws, biases, scales, tokens, output_dtype):
    """The quantized multi-x forms (the page's per-channel / per-token rows for a Tensor or
    no ``group_list``, ``group_type`` -1 and 0): int8 x and weights, ``scale`` one ``(N_i,)``
    tensor per group, bfloat16 for bfloat16 output or float32 for float16 output;
    ``per_token_scale`` None or one float32 ``(M_i,)`` tensor per x (2-D x); ``bias`` None
    or int32 per group: ``y_i = (x_i @ w_i + bias_i) * scale_i * per_token_scale_i``.
    Returns ``product(i)``."""
    if not scales:
        raise NotImplementedError("torch_npu.npu_grouped_matmul: scale=None with several int8 "
                                  "x tensors (int32 / int8 results) is not modelled.")
    if output_dtype not in (torch.bfloat16, torch.float16):
        if output_dtype in (None, torch.int8, torch.int32):
            raise NotImplementedError(f"torch_npu.npu_grouped_matmul: output_dtype="
                                      f"{output_dtype} with int8 inputs is not modelled; use "
                                      "bfloat16 or float16.")
        raise RuntimeError(f"output_dtype {output_dtype} is not supported with int8 inputs.")
    scale_dtype = torch.bfloat16 if output_dtype == torch.bfloat16 else torch.float32
    if len(scales) != len(ws):
        raise RuntimeError(f"scale holds {len(scales)} tensors; it takes one per weight "
                           f"({len(ws)}).")
    for i, (t, w) in enumerate(zip(scales, ws, strict=True)):
        if t.dtype == torch.int64:
            raise NotImplementedError("torch_npu.npu_grouped_matmul: scale in int64 (int8 "
                                      "output) is not modelled.")
        if t.dtype != scale_dtype or tuple(t.shape) != (w.shape[1],):
            raise RuntimeError(f"scale[{i}] is {t.dtype} {tuple(t.shape)}; with output_dtype="
                               f"{output_dtype} it must be {scale_dtype} ({w.shape[1]},).")
    if tokens:
        if len(tokens) != len(xs):
            raise RuntimeError(f"per_token_scale holds {len(tokens)} tensors; it takes one per "
                               f"x tensor ({len(xs)}).")
        for i, (t, xt) in enumerate(zip(tokens, xs, strict=True)):
            if xt.dim() != 2 or t.dtype != torch.float32 or tuple(t.shape) != (xt.shape[0],):
                raise RuntimeError(f"per_token_scale[{i}] is {t.dtype} {tuple(t.shape)}; it "
                                   f"must be float32 (M_i,) for a 2-D x[{i}] of shape "
                                   f"{tuple(xt.shape)}.")

    def product(i: int) -> torch.Tensor:
        acc = (xs[i].to(torch.int32) @ ws[i].to(torch.int32)).double()
        if biases:
            acc = acc + biases[i].double()
        rows = acc.float() * scales[i].float()
        if tokens:
            rows = rows * tokens[i].reshape(-1, 1)
        return rows.to(output_dtype)

    return product


def _grouped_matmul_int_list(xs, ws, biases, scale, per_token_scale, group_list,
                             split_item, group_type, group_list_type, act_type,
                             output_dtype) -> list:
    """``npu_grouped_matmul`` with a ``List[int]`` ``group_list`` (op-plugin's
    ``npu_grouped_matmul.List`` overload), the page's A2/A3 rows for it, not quantized
    (float16 / bfloat16; the page's int8 row has int64 scales and int8 output, and its
    antiquant rows are not modelled either):

    - ``group_list``: the cumulative row counts (non-negative, non-decreasing; the page says
      "递增" and forbids a length of 1); ``group_type``, ``group_list_type`` and
      ``act_type`` only their defaults (the page: None), ``per_token_scale`` None;
    - multi-multi-multi (several x, ``split_item`` 0/1): 2-D x tensors whose rows the
      list's steps describe (x of more dims takes no ``group_list``); one output per group;
    - single-multi-single (one x, ``split_item`` 2/3): the list ends at x's M; the groups'
      rows of x times their weights, stacked in one tensor;
    - single-multi-multi (one x, ``split_item`` 0/1): the same, one output per group;
    - multi-multi-single (several x, ``split_item`` 2/3): an optional list describing the
      x tensors' rows; one stacked output.
    """
    if any(isinstance(v, bool) or not isinstance(v, int) for v in group_list):
        raise TypeError(f"group_list must be a list of ints, got {group_list!r}.")
    if len(group_list) == 1:
        raise RuntimeError(f"group_list={group_list}: a List[int] group_list must not have "
                           "length 1 (the page).")
    if any(v < 0 for v in group_list) or any(
            b < a for a, b in zip(group_list, group_list[1:], strict=False)):
        raise RuntimeError(f"group_list={group_list}: a List[int] group_list must be "
                           "non-negative and non-decreasing (cumulative row counts).")
    for name, value, allowed in (("group_type", group_type, (None,)),
                                 ("group_list_type", group_list_type, (None, 0)),
                                 ("act_type", act_type, (None, 0))):
        if value not in allowed:
            raise RuntimeError(f"{name}={value!r} with a List[int] group_list; the page allows "
                               "only None (the default) there.")
    if _as_list("per_token_scale", per_token_scale):
        raise RuntimeError("per_token_scale with a List[int] group_list; the page allows only "
                           "None there.")
    if _as_list("scale", scale):
        if any(t.dtype != torch.int64 for t in _as_list("scale", scale)):
            raise RuntimeError("scale with a List[int] group_list must be int64 (the page's "
                               "per-channel int8-output row).")
        raise NotImplementedError("torch_npu.npu_grouped_matmul: scale (int64, int8 output) "
                                  "with a List[int] group_list is not modelled by the "
                                  "reference torch_npu.")
    dtype = xs[0].dtype
    if dtype in (torch.int8, torch.int32) or any(w.dtype == torch.int8 for w in ws):
        raise NotImplementedError("torch_npu.npu_grouped_matmul: int8 inputs or weights with a "
                                  "List[int] group_list are not modelled by the reference "
                                  "torch_npu.")
    _require_int("split_item", split_item, {0, 1, 2, 3})
    steps = [b - a for a, b in zip([0, *group_list], group_list, strict=False)]
    if len(xs) > 1:
        if split_item in (0, 1) and group_list:
            if any(xt.dim() != 2 for xt in xs):
                raise RuntimeError("with x tensors of more than 2 dims the page requires "
                                   "group_list to be empty.")
            if steps != [xt.shape[0] for xt in xs]:
                raise RuntimeError(f"group_list {group_list} does not describe the x tensors' "
                                   f"rows {[xt.shape[0] for xt in xs]}.")
        tensor_list = (torch.tensor(group_list, dtype=torch.int64)
                       if group_list and split_item in (2, 3) else None)
        return _grouped_matmul_multi_x(xs, ws, biases, None, None, tensor_list, split_item,
                                       -1 if split_item in (0, 1) else 0, 0, 0, output_dtype)
    xt = xs[0]
    if not group_list:
        raise RuntimeError("one x tensor with a List[int] group_list needs a non-empty "
                           "group_list (the page).")
    if xt.dim() != 2:
        raise RuntimeError(f"x[0] must be 2-D (M, K) here, got {xt.dim()} dims.")
    if len(steps) != len(ws):
        raise RuntimeError(f"group_list has {len(steps)} groups but weight holds {len(ws)} "
                           "tensors.")
    if group_list[-1] != xt.shape[0]:
        raise RuntimeError(f"group_list ends at {group_list[-1]}; with one x tensor it must end "
                           f"at x's M = {xt.shape[0]}.")
    pieces = list(torch.split(xt, steps))
    if split_item in (2, 3):
        return _grouped_matmul_multi_x(pieces, ws, biases, None, None, None, split_item, 0, 0,
                                       0, output_dtype)
    return _grouped_matmul_multi_x([p.contiguous() for p in pieces], ws, biases, None, None,
                                   None, split_item, -1, 0, 0, output_dtype)


def _grouped_matmul_along_k(xt, ws, group_list, list_type, bias, scale, per_token_scale,
                            output_dtype) -> torch.Tensor:
    """``npu_grouped_matmul`` with ``group_type=2``, the page's A2/A3 row for grouping along
    K: ``x`` one 2-D ``(M, K)`` tensor that must be transposed (a ``.t()`` view of a
    contiguous ``(K, M)``), ``weight`` one 2-D ``(K, N)`` tensor, not transposed;
    ``group_list`` splits K (a cumsum ending at K, or sizes summing to K); the result is
    one 3-D ``(g, M, N)`` tensor, ``y[i] = x[:, k_i] @ weight[k_i, :]`` over group i's
    rows of K (zeros for an empty group). Quantized inputs take group_type -1 and 0 only on
    A2/A3; ``bias`` is not described for this form and not modelled."""
    if xt.dtype not in _HALF and xt.dtype != torch.float32:
        raise RuntimeError(f"x has dtype {xt.dtype}; on A2/A3 quantized grouped matmuls "
                           "take group_type -1 and 0 only, group_type=2 is not quantized.")
    if len(ws) != 1:
        raise RuntimeError(f"group_type=2 takes one weight tensor, got {len(ws)}.")
    w = ws[0]
    if xt.dim() != 2 or w.dim() != 2:
        raise RuntimeError(f"group_type=2 takes 2-D x (M, K) and weight (K, N), got "
                           f"{tuple(xt.shape)} and {tuple(w.shape)}.")
    if xt.dtype == torch.float32:
        raise NotImplementedError("float32 grouped matmuls are not modelled.")
    if w.dtype != xt.dtype:
        raise RuntimeError(f"x has dtype {xt.dtype} but weight {w.dtype}; they must match.")
    for name, value in (("scale", scale), ("per_token_scale", per_token_scale)):
        if _as_list(name, value):
            raise RuntimeError(f"{name} belongs to quantized inputs, which group_type=2 "
                               "does not take on A2/A3.")
    if _as_list("bias", bias):
        raise NotImplementedError("bias with group_type=2 is not modelled (the page does "
                                  "not describe it for A2/A3).")
    m, k = xt.shape
    if w.shape[0] != k:
        raise RuntimeError(f"x {tuple(xt.shape)} and weight {tuple(w.shape)} do not "
                           "multiply: weight must be (K, N).")
    n = w.shape[1]
    if not xt.t().is_contiguous() or (xt.is_contiguous() and m > 1 and k > 1):
        raise RuntimeError("group_type=2 needs x transposed: pass the .t() view of a "
                           "contiguous (K, M) tensor.")
    if not w.is_contiguous():
        raise RuntimeError("group_type=2 takes weight not transposed (contiguous (K, N)).")
    if output_dtype not in (None, xt.dtype):
        raise RuntimeError(f"output_dtype must be None or x's {xt.dtype}, got "
                           f"{output_dtype}.")
    if group_list.dim() == 1 and group_list.shape[0] > _GMM_MAX_GROUPS:
        raise RuntimeError(f"{group_list.shape[0]} groups exceed the limit of "
                           f"{_GMM_MAX_GROUPS}.")
    groups = group_list.shape[0] if group_list.dim() == 1 else 0
    bounds = _group_bounds(group_list, list_type, k, groups)
    out = torch.zeros(len(bounds), m, n, dtype=torch.float32)
    for i, (start, end) in enumerate(bounds):
        if end > start:
            out[i] = xt[:, start:end].float() @ w[start:end].float()
    return out.to(xt.dtype)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, tuning_config=None, output_dtype=None,
                       x_dtype=None, weight_dtype=None, scale_dtype=None,
                       per_token_scale_dtype=None):
    """``torch_npu.npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None,
    antiquant_scale=None, antiquant_offset=None, per_token_scale=None, group_list=None,
    activation_input=None, activation_quant_scale=None, activation_quant_offset=None,
    split_item=0, group_type=None, group_list_type=0, act_type=0, tuning_config=None,
    output_dtype=None, x_dtype=None, weight_dtype=None, scale_dtype=None,
    per_token_scale_dtype=None) -> List[Tensor]``, op-plugin's schema: ``split_item``,
    ``group_list_type`` and ``act_type`` are ``int?``, so None means their default. The
    ``*_dtype`` arguments reinterpret tensors as types torch has no dtype for (hifloat8,
    float4, int4, float8 scales): other than None they are not modelled.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_grouped_matmul.md`` for A2/A3
    with a Tensor ``group_list``, grouping along M (``group_type=0``), one output tensor
    (``split_item`` 2 or 3). Modelled forms:

    - single-single-single: ``x = [X (M, K)]``, ``weight = [W (E, K, N)]``;
    - single-multi-single: ``x = [X (M, K)]``, ``weight`` E tensors ``(K, N_)`` of one N
      (at most 128).

    ``group_list``: int64 1-D with one entry per group, a non-decreasing cumsum ending at M
    (``group_list_type=0``) or the group sizes summing to M (``group_list_type=1``).
    Rows ``start_i:end_i`` of ``X`` are multiplied by group i's weight. Modelled dtype rows:

    - not quantized: ``x``/``weight`` float16 or bfloat16, ``bias`` float16 / float32 per
      group, ``output_dtype`` None or ``x``'s dtype: ``y = x @ w + bias``.
    - int8 per channel / per token: ``x``/``weight`` int8; ``scale`` per group ``(N,)``
      (``[(E, N)]`` for a single 3-D weight) bfloat16 for bfloat16 output or float32 for
      float16 output; ``per_token_scale`` None or ``[(M,) float32]``; ``bias`` None or
      int32 per group: ``y = (x @ w + bias) * scale * per_token_scale``.

    ``group_type=2`` groups along K instead (the single-single-single form, not quantized):
    see ``_grouped_matmul_along_k``. Several x tensors (``group_type`` -1 multi-multi-multi,
    ``group_type`` 0 multi-multi-single), not quantized: see ``_grouped_matmul_multi_x``.

    A ``List[int]`` ``group_list`` (op-plugin's ``npu_grouped_matmul.List`` overload, which
    torch_npu's Python binding merges with this one): see ``_grouped_matmul_int_list``.

    Not modelled (``NotImplementedError``):
    ``group_list_type=2``, ``split_item`` 0/1 with one x tensor, antiquant (fake-quant)
    weights, int4 inputs, int64 scales / int8 output, ``act_type`` other than 0,
    ``tuning_config``. ``offset`` and the ``activation_*`` arguments must be None.
    """
    refuse_unmodelled("npu_grouped_matmul", x_dtype=x_dtype, weight_dtype=weight_dtype,
                      scale_dtype=scale_dtype, per_token_scale_dtype=per_token_scale_dtype)
    split_item = 0 if split_item is None else split_item
    group_list_type = 0 if group_list_type is None else group_list_type
    act_type = 0 if act_type is None else act_type
    xs, ws = _as_list("x", x), _as_list("weight", weight)
    if not xs or not ws:
        raise RuntimeError("x and weight must be non-empty lists of tensors.")
    for name, value in (("offset", offset), ("activation_input", activation_input),
                        ("activation_quant_scale", activation_quant_scale),
                        ("activation_quant_offset", activation_quant_offset)):
        if value is not None:
            raise RuntimeError(f"{name} only takes None on this product.")
    if antiquant_scale is not None or antiquant_offset is not None:
        raise NotImplementedError("antiquant (fake-quantized weight) grouped matmuls are not "
                                  "modelled by the reference torch_npu.")
    if isinstance(group_list, (list, tuple)):
        if tuning_config is not None:
            raise TypeError("npu_grouped_matmul with a List[int] group_list (the .List "
                            "overload) takes no tuning_config.")
        return _grouped_matmul_int_list(xs, ws, _as_list("bias", bias), scale, per_token_scale,
                                        list(group_list), split_item, group_type,
                                        group_list_type, act_type, output_dtype)
    if tuning_config is not None:
        raise NotImplementedError("tuning_config is not modelled by the reference torch_npu.")
    if group_type == -1 or len(xs) > 1:
        return _grouped_matmul_multi_x(xs, ws, _as_list("bias", bias), scale, per_token_scale,
                                       group_list, split_item, group_type, group_list_type,
                                       act_type, output_dtype)
    if not isinstance(group_list, torch.Tensor):
        raise NotImplementedError("only a Tensor group_list is modelled (a List[int] "
                                  "group_list or none at all is not).")
    _require_int("split_item", split_item, {0, 1, 2, 3})
    if split_item in (0, 1):
        raise NotImplementedError("split_item 0/1 (one output per group) is not modelled.")
    if group_type not in (0, 2):
        if group_type == -1:
            raise NotImplementedError("group_type=-1 (no grouping) is not modelled.")
        raise RuntimeError(f"group_type={group_type!r}: A2/A3 support -1, 0 and 2.")
    _require_int("group_list_type", group_list_type, {0, 1, 2})
    if group_list_type == 2:
        raise NotImplementedError("group_list_type=2 ([E, 2] pairs) is not modelled.")
    _require_int("act_type", act_type, {0, 1, 2, 4, 5})
    if act_type:
        raise NotImplementedError(f"act_type={act_type} (a fused activation) is not "
                                  "modelled.")
    if len(xs) != 1:
        raise NotImplementedError("several x tensors (multi-multi forms) are not modelled.")
    if group_type == 2:
        return [_grouped_matmul_along_k(xs[0], ws, group_list, group_list_type, bias, scale,
                                        per_token_scale, output_dtype)]
    if len(ws) > _GMM_MAX_LIST:
        raise RuntimeError(f"weight holds {len(ws)} tensors; the list is at most "
                           f"{_GMM_MAX_LIST} long.")
    xt = xs[0]
    if xt.dim() != 2:
        raise RuntimeError(f"x[0] must be 2-D (M, K) here, got {xt.dim()} dims.")
    if not xt.is_contiguous():
        raise RuntimeError("x[0] is not contiguous; x does not support transposition.")
    single = len(ws) == 1 and ws[0].dim() == 3
    if single:
        per_group = list(ws[0].unbind(0))
    else:
        if any(w.dim() != 2 for w in ws):
            raise RuntimeError("a multi-tensor weight takes 2-D (K, N) tensors; a single "
                               "weight tensor is (E, K, N).")
        if group_list_type == 1 and group_list.shape[0] > _GMM_MAX_LIST:
            raise RuntimeError(f"group_list_type=1 with a multi-tensor weight takes at most "
                               f"{_GMM_MAX_LIST} groups.")
        per_group = ws
    groups = len(per_group)
    if groups > _GMM_MAX_GROUPS:
        raise RuntimeError(f"{groups} groups exceed the limit of {_GMM_MAX_GROUPS}.")
    m, k = xt.shape
    n = per_group[0].shape[1]
    for i, w in enumerate(per_group):
        if w.dtype != per_group[0].dtype:
            raise RuntimeError("the weight tensors must share one dtype.")
        if tuple(w.shape) != (k, n):
            raise RuntimeError(f"weight group {i} has shape {tuple(w.shape)}; every group must "
                               f"be (K={k}, N={n}).")
    if k >= _MAX_INNER + 1 or n >= _MAX_INNER + 1:
        raise RuntimeError(f"the last dims of x and weight ({k}, {n}) must stay below 65536.")
    bounds = _group_bounds(group_list, group_list_type, m, groups)
    if xt.dtype != per_group[0].dtype:
        raise RuntimeError(f"x has dtype {xt.dtype} but weight {per_group[0].dtype}; the "
                           "modelled rows take equal dtypes.")

    def per_group_tensors(name: str, values: list, dtype_ok, length: int) -> list:
        if not values:
            return []
        if single:
            if len(values) != 1 or tuple(values[0].shape) != (groups, length):
                raise RuntimeError(f"{name} with a single (E, K, N) weight must be one "
                                   f"({groups}, {length}) tensor.")
            tensors = list(values[0].unbind(0))
        else:
            if len(values) != groups or any(tuple(t.shape) != (length,) for t in values):
                raise RuntimeError(f"{name} must hold one ({length},) tensor per weight.")
            tensors = values
        for t in tensors:
            dtype_ok(name, t)
        return tensors

    scales, biases = _as_list("scale", scale), _as_list("bias", bias)
    tokens = _as_list("per_token_scale", per_token_scale)
    if xt.dtype in _HALF or xt.dtype == torch.float32:
        if xt.dtype == torch.float32:
            raise NotImplementedError("float32 grouped matmuls are not modelled.")
        if scales or tokens:
            raise RuntimeError("scale and per_token_scale belong to int8 inputs.")
        if output_dtype not in (None, xt.dtype):
            raise RuntimeError(f"output_dtype must be None or x's {xt.dtype}, got "
                               f"{output_dtype}.")
        bias_dtype = torch.float16 if xt.dtype == torch.float16 else torch.float32

        def bias_ok(name, t):
            _require_dtype(name, t, (bias_dtype,), f"with {xt.dtype} x it must be")

        bias_per_group = per_group_tensors("bias", biases, bias_ok, n)
        out_dtype = xt.dtype
        out = torch.zeros(m, n, dtype=torch.float32)
        for i, (start, end) in enumerate(bounds):
            if end > start:
                acc = xt[start:end].float() @ per_group[i].float()
                if bias_per_group:
                    acc = acc + bias_per_group[i].float()
                out[start:end] = acc
        return [out.to(out_dtype)]

    if xt.dtype == torch.int32:
        raise NotImplementedError("int4 (int32-packed) grouped matmuls are not modelled.")
    if xt.dtype != torch.int8:
        raise RuntimeError(f"x has dtype {xt.dtype}; supported: float16, bfloat16, float32, "
                           "int8 and int4.")
    if not scales:
        raise NotImplementedError("int8 output without scale (int32/int8 results) is not "
                                  "modelled.")
    if output_dtype not in (torch.bfloat16, torch.float16):
        if output_dtype in (None, torch.int8, torch.int32):
            raise NotImplementedError(f"output_dtype={output_dtype} with int8 inputs is not "
                                      "modelled; use bfloat16 or float16.")
        raise RuntimeError(f"output_dtype {output_dtype} is not supported with int8 inputs.")
    scale_dtype = torch.bfloat16 if output_dtype == torch.bfloat16 else torch.float32

    def scale_ok(name, t):
        if t.dtype == torch.int64:
            raise NotImplementedError("int64 scales are not modelled.")
        _require_dtype(name, t, (scale_dtype,), f"with output_dtype={output_dtype} it must be")

    def int32_ok(name, t):
        _require_dtype(name, t, (torch.int32,), "with int8 inputs it must be")

    scale_per_group = per_group_tensors("scale", scales, scale_ok, n)
    bias_per_group = per_group_tensors("bias", biases, int32_ok, n)
    token_scale = None
    if tokens:
        if len(tokens) != 1 or tokens[0].dtype != torch.float32 or tuple(
                tokens[0].shape) != (m,):
            raise RuntimeError(f"per_token_scale must be one float32 ({m},) tensor, got "
                               f"{[(t.dtype, tuple(t.shape)) for t in tokens]}.")
        token_scale = tokens[0].reshape(m, 1)
    out = torch.zeros(m, n, dtype=torch.float32)
    for i, (start, end) in enumerate(bounds):
        if end == start:
            continue
        acc = (xt[start:end].to(torch.int32) @ per_group[i].to(torch.int32)).double()
        if bias_per_group:
            acc = acc + bias_per_group[i].double()
        rows = acc.float() * scale_per_group[i].float()
        if token_scale is not None:
            rows = rows * token_scale[start:end]
        out[start:end] = rows
    return [out.to(output_dtype)]
