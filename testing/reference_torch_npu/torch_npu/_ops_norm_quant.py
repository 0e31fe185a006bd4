"""Fused torch_npu norm, quantization and rotary ops, computed with plain torch on CPU tensors.

The same rules as ``torch_npu._ops``: each function follows its page under Ascend/op-plugin
``docs/context/`` (argument names, shapes, dtype tables), models the Atlas A2/A3 rows of
those tables (the modelled machine is an Ascend 910B), raises ``RuntimeError`` on what the
page rules out and ``NotImplementedError`` on arguments it documents but the reference
does not model (the errors of ``torch_npu._ops``). Arithmetic is done in float32 (integer
matmuls exactly) and cast once; int8 results round half to even (``torch.round``) and
saturate to [-128, 127].
"""

from __future__ import annotations

import torch

from torch_npu._ops import _require_dims, _require_float_dtype, _require_tensor
from torch_npu._unmodelled import refuse_unmodelled

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_INT8_MIN, _INT8_MAX = -128, 127


def _require_half_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _HALF_DTYPES:
        raise RuntimeError(f"{name} has dtype {tensor.dtype}; supported dtypes are float16 and "
                           "bfloat16.")


def _require_not_empty(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        raise RuntimeError(f"{name} is empty (shape {tuple(tensor.shape)}); empty tensors are "
                           "not supported.")


def _require_epsilon(epsilon) -> float:
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise TypeError(f"epsilon must be a float, got {type(epsilon).__name__}.")
    return float(epsilon)


def _require_same(name: str, tensor: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    if tensor.shape != like.shape:
        raise RuntimeError(f"{name} has shape {tuple(tensor.shape)} but {like_name} has "
                           f"{tuple(like.shape)}; they must be equal.")
    if tensor.dtype != like.dtype:
        raise RuntimeError(f"{name} has dtype {tensor.dtype} but {like_name} has {like.dtype}; "
                           "they must be equal.")


def _require_trailing(name: str, tensor: torch.Tensor, x_name: str, x: torch.Tensor) -> int:
    """``tensor``'s shape must be the trailing dims of ``x``; returns how many dims."""
    dims = tensor.dim()
    if dims == 0 or dims > x.dim() or tuple(tensor.shape) != tuple(x.shape[x.dim() - dims:]):
        raise RuntimeError(f"{name}'s shape {tuple(tensor.shape)} must equal the trailing dims "
                           f"of {x_name}'s shape {tuple(x.shape)}.")
    return dims


def _rms_normalise(x: torch.Tensor, gamma: torch.Tensor, epsilon: float, norm_dims: int):
    """(``x / rms(x) * gamma`` in float32, ``rstd`` in float32 keeping the reduced dims)."""
    reduce_dims = tuple(range(x.dim() - norm_dims, x.dim()))
    rstd = torch.rsqrt(x.pow(2).mean(dim=reduce_dims, keepdim=True) + epsilon)
    return x * rstd * gamma.float(), rstd


def _saturate_int8(values: torch.Tensor) -> torch.Tensor:
    return torch.round(values).clamp(_INT8_MIN, _INT8_MAX).to(torch.int8)


def _dynamic_quant_rows(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale = row_max(|v|) / 127``, ``round(v / scale)``; a row of zeros (scale 0, which
    the pages leave open) quantizes to zeros."""
    scale = values.abs().amax(dim=-1) / 127.0
    divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
    return _saturate_int8(values / divisor.unsqueeze(-1)), scale


# --- npu_add_rms_norm ---------------------------------------------------------------------


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06) -> (Tensor, Tensor, Tensor)``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_add_rms_norm.md``:

    - ``x1``, ``x2``: float32, float16 or bfloat16, 1 to 8 dims, not empty
      (non-contiguous allowed); ``x2`` of ``x1``'s shape and dtype.
    - ``gamma``: ``x1``'s dtype, shaped like the trailing dims of ``x1`` that are normalised.

    Returns ``(y, rstd, x)``: ``x = x1 + x2`` and ``y = x / sqrt(mean(x**2) + epsilon) *
    gamma`` in ``x1``'s dtype; ``rstd`` float32, ``x1``'s shape with the normalised dims 1.
    """
    for name, value in (("x1", x1), ("x2", x2), ("gamma", gamma)):
        _require_tensor(name, value)
        _require_float_dtype(name, value)
        _require_dims(name, value, 1)
        _require_not_empty(name, value)
    _require_same("x2", x2, "x1", x1)
    if gamma.dtype != x1.dtype:
        raise RuntimeError(f"gamma has dtype {gamma.dtype} but x1 has {x1.dtype}; gamma must "
                           "have x1's dtype.")
    norm_dims = _require_trailing("gamma", gamma, "x1", x1)
    eps = _require_epsilon(epsilon)

    added = x1.float() + x2.float()
    y, rstd = _rms_normalise(added, gamma, eps, norm_dims)
    return y.to(x1.dtype), rstd, added.to(x1.dtype)


# --- npu_add_rms_norm_quant ---------------------------------------------------------------

# Atlas A2/A3 dtype table of the page: x dtype -> (scales, zero_points) dtypes.
_ADD_RMS_NORM_QUANT_DTYPES = {
    torch.float16: (torch.float32, torch.int32),
    torch.bfloat16: (torch.bfloat16, torch.bfloat16),
}


def npu_add_rms_norm_quant(x1, x2, gamma, scales1, zero_points1, beta=None, scales2=None,
                           zero_points2=None, *, axis=-1, epsilon=1e-06, div_mode=True,
                           dst_type=None):
    """``torch_npu.npu_add_rms_norm_quant(x1, x2, gamma, scales1, zero_points1, beta=None,
    scales2=None, zero_points2=None, *, axis=-1, epsilon=1e-06, div_mode=True,
    dst_type=None) -> (y1, y2, x)`` (op-plugin's schema; ``dst_type`` other than None,
    another output type, is not modelled).

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_add_rms_norm_quant.md``:

    - ``x1``, ``x2``: float16 or bfloat16, 1 to 8 dims, equal shapes and dtypes, not empty.
    - ``gamma`` (and ``beta``): ``x1``'s dtype, the normalised trailing dims of ``x1``.
    - ``scales1``/``scales2``: gamma's shape; float32 for float16 inputs, bfloat16 for
      bfloat16 inputs (the A2/A3 table); not 0 when ``div_mode``.
    - ``zero_points1``/``zero_points2``: optional, gamma's shape; int32 for float16 inputs,
      bfloat16 for bfloat16 inputs.
    - ``axis``: only -1 is supported; ``epsilon``: float; ``div_mode``: bool.

    ``x = x1 + x2``, ``y = x / rms(x) * gamma + beta``; ``y1 = round(y / scales1 +
    zero_points1)`` (``y * scales1`` when not ``div_mode``) saturated to int8, ``y2`` the
    same with the second scales. The page does not say what ``y2`` holds without
    ``scales2``; the reference returns zeros. Returns ``(y1, y2, x)``, ``x`` in x1's dtype.
    """
    refuse_unmodelled("npu_add_rms_norm_quant", dst_type=dst_type)
    for name, value in (("x1", x1), ("x2", x2), ("gamma", gamma)):
        _require_tensor(name, value)
        _require_half_dtype(name, value)
        _require_dims(name, value, 1)
        _require_not_empty(name, value)
    _require_same("x2", x2, "x1", x1)
    if gamma.dtype != x1.dtype:
        raise RuntimeError(f"gamma has dtype {gamma.dtype} but x1 has {x1.dtype}; they must "
                           "be equal.")
    norm_dims = _require_trailing("gamma", gamma, "x1", x1)
    if isinstance(axis, bool) or axis != -1:
        raise RuntimeError(f"axis={axis!r}: only the default -1 is supported.")
    if not isinstance(div_mode, bool):
        raise TypeError(f"div_mode must be a bool, got {type(div_mode).__name__}.")
    eps = _require_epsilon(epsilon)
    scale_dtype, zero_dtype = _ADD_RMS_NORM_QUANT_DTYPES[x1.dtype]

    def check_param(name: str, value, dtype: torch.dtype) -> None:
        _require_tensor(name, value)
        if value.dtype != dtype:
            raise RuntimeError(f"{name} has dtype {value.dtype}; with {x1.dtype} inputs it "
                               f"must be {dtype}.")
        if value.shape != gamma.shape:
            raise RuntimeError(f"{name} has shape {tuple(value.shape)}; it must equal gamma's "
                               f"{tuple(gamma.shape)}.")

    check_param("scales1", scales1, scale_dtype)
    if zero_points1 is not None:
        check_param("zero_points1", zero_points1, zero_dtype)
    if beta is not None:
        check_param("beta", beta, x1.dtype)
    if scales2 is not None:
        check_param("scales2", scales2, scale_dtype)
    if zero_points2 is not None:
        if scales2 is None:
            raise RuntimeError("zero_points2 needs scales2.")
        check_param("zero_points2", zero_points2, zero_dtype)
    for name, scales in (("scales1", scales1), ("scales2", scales2)):
        if scales is not None and div_mode and bool((scales == 0).any()):
            raise RuntimeError(f"{name} holds 0, which div_mode=True divides by.")

    added = x1.float() + x2.float()
    y, _ = _rms_normalise(added, gamma, eps, norm_dims)
    if beta is not None:
        y = y + beta.float()

    def quantize(scales, zero_points) -> torch.Tensor:
        scaled = y / scales.float() if div_mode else y * scales.float()
        if zero_points is not None:
            scaled = scaled + zero_points.float()
        return _saturate_int8(scaled)

    y1 = quantize(scales1, zero_points1)
    y2 = (quantize(scales2, zero_points2) if scales2 is not None
          else torch.zeros_like(y1))
    return y1, y2, added.to(x1.dtype)


# --- npu_add_rms_norm_dynamic_quant -------------------------------------------------------


def npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None,
                                   beta=None, epsilon=1e-6, output_mask=(), y_dtype=None):
    """``torch_npu.npu_add_rms_norm_dynamic_quant(x1, x2, gamma, *, smooth_scale1=None,
    smooth_scale2=None, beta=None, epsilon=1e-6, output_mask=[], y_dtype=None)
    -> (y1, y2, x_out, scale1, scale2)``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_add_rms_norm_dynamic_quant.md``:

    - ``x1``, ``x2``: float16 or bfloat16, 2 to 8 dims, equal shapes, not empty.
    - ``gamma``, ``smooth_scale1``, ``smooth_scale2``, ``beta``: 1-D of ``x1``'s last dim,
      ``x1``'s dtype.
    - ``output_mask``: empty or two bools; when given, a smooth scale needs its output
      and the two cannot both be False.
    - ``y_dtype``: None or ``torch.int8`` (``torch.quint4x2`` is not modelled).

    ``x = x1 + x2``, ``y = x / rms(x) * gamma + beta``; path i quantizes ``y *
    smooth_scale_i`` per row: ``scale_i = row_max(|.|) / 127`` (float32, ``x1``'s shape
    without the last dim), ``y_i = round(. / scale_i)``. Path 1 runs unless
    ``output_mask[0]`` is False; path 2 when ``output_mask[1]`` is True or, with an empty
    mask, when both smooth scales are given. A path that does not run returns 0-dim
    tensors (one element, int8 and float32), as the real binding does. An empty mask with
    only ``smooth_scale2`` is left open by the page and raises.
    """
    for name, value in (("x1", x1), ("x2", x2), ("gamma", gamma)):
        _require_tensor(name, value)
        _require_half_dtype(name, value)
        _require_not_empty(name, value)
    _require_dims("x1", x1, 2)
    _require_same("x2", x2, "x1", x1)
    hidden = x1.shape[-1]
    for name, value in (("gamma", gamma), ("smooth_scale1", smooth_scale1),
                        ("smooth_scale2", smooth_scale2), ("beta", beta)):
        if value is None:
            continue
        _require_tensor(name, value)
        if value.dtype != x1.dtype:
            raise RuntimeError(f"{name} has dtype {value.dtype}; it must be x1's {x1.dtype}.")
        if value.shape != (hidden,):
            raise RuntimeError(f"{name} has shape {tuple(value.shape)}; it must be 1-D of "
                               f"x1's last dim ({hidden},).")
    if y_dtype is not None and y_dtype != torch.int8:
        if y_dtype == getattr(torch, "quint4x2", None):
            raise NotImplementedError("y_dtype=torch.quint4x2 (int4 output) is not modelled "
                                      "by the reference torch_npu.")
        raise RuntimeError(f"y_dtype must be None, torch.int8 or torch.quint4x2, got {y_dtype}.")
    mask = list(output_mask)
    if mask:
        if len(mask) != 2 or not all(isinstance(m, bool) for m in mask):
            raise RuntimeError(f"output_mask must be empty or two bools, got {output_mask!r}.")
        if not any(mask):
            raise RuntimeError("output_mask[0] and output_mask[1] cannot both be False.")
        if smooth_scale1 is not None and not mask[0]:
            raise RuntimeError("smooth_scale1 is given, so output_mask[0] must be True.")
        if smooth_scale2 is not None and not mask[1]:
            raise RuntimeError("smooth_scale2 is given, so output_mask[1] must be True.")
        first, second = mask
    else:
        if smooth_scale2 is not None and smooth_scale1 is None:
            raise NotImplementedError("smooth_scale2 without smooth_scale1 and an empty "
                                      "output_mask is left open by the page; pass output_mask.")
        first, second = True, smooth_scale1 is not None and smooth_scale2 is not None
    eps = _require_epsilon(epsilon)

    added = x1.float() + x2.float()
    y, _ = _rms_normalise(added, gamma, eps, 1)
    if beta is not None:
        y = y + beta.float()

    def path(run: bool, smooth):
        if not run:
            # The real binding still returns a tensor there: 0-dim (sizes {}), one element.
            return (torch.zeros((), dtype=torch.int8), torch.zeros((), dtype=torch.float32))
        return _dynamic_quant_rows(y if smooth is None else y * smooth.float())

    y1, scale1 = path(first, smooth_scale1)
    y2, scale2 = path(second, smooth_scale2)
    return y1, y2, added.to(x1.dtype), scale1, scale2


# --- npu_dynamic_quant --------------------------------------------------------------------


def npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=None):
    """``torch_npu.npu_dynamic_quant(input, *, smooth_scales=None, group_index=None,
    dst_type=None) -> (Tensor, Tensor)``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_dynamic_quant.md`` (the schema's
    first argument is ``input``, the page's ``x``):

    - ``input``: float16 or bfloat16, more than 1 dim (non-contiguous allowed).
    - ``smooth_scales``: optional, 1-D of ``input``'s last dim, ``input``'s dtype.
    - ``group_index`` (the MoE case): int32, 1-D, non-decreasing, its last entry the number
      of rows (``input.numel() / input.shape[-1]``); ``smooth_scales`` is then 2-D, one row
      per group: rows ``[group_index[g-1], group_index[g])`` (from 0 for ``g = 0``) are
      multiplied by ``smooth_scales[g]`` (an empty group applies to no row, as the real op's
      test golden skips it).
    - ``dst_type``: None or ``torch.int8`` (int8 output), or ``torch.quint4x2``: int4 values
      packed eight per int32 along the last dim (which must be a multiple of 8), the same
      packing as ``npu_quantize``'s.

    Per-token symmetric quantization: ``scale = row_max(|input * smooth|) / DST_MAX`` (127 for
    int8, 7 for int4; float32, ``input``'s shape without the last dim) and
    ``y = round(input * smooth / scale)``.
    """
    x = input
    _require_tensor("input", x)
    _require_half_dtype("input", x)
    if not 2 <= x.dim() <= 8:
        raise RuntimeError(f"input must have more than 1 dim (2 to 8), got {x.dim()}.")
    int4 = dst_type == torch.quint4x2
    if dst_type is not None and dst_type != torch.int8 and not int4:
        raise RuntimeError(f"dst_type must be None, torch.int8 or torch.quint4x2, got "
                           f"{dst_type}.")
    if int4 and x.shape[-1] % 8:
        raise RuntimeError(f"dst_type=torch.quint4x2 packs 8 values per int32: input's last "
                           f"dim must be a multiple of 8, got {x.shape[-1]}.")
    values = x.float()
    if group_index is not None:
        values = _smooth_groups(values, smooth_scales, group_index, x.dtype)
    elif smooth_scales is not None:
        _require_tensor("smooth_scales", smooth_scales)
        if smooth_scales.dtype != x.dtype or smooth_scales.shape != (x.shape[-1],):
            raise RuntimeError(f"smooth_scales must be 1-D ({x.shape[-1]},) of input's dtype "
                               f"{x.dtype}; got {smooth_scales.dtype} "
                               f"{tuple(smooth_scales.shape)}.")
        values = values * smooth_scales.float()
    if int4:
        from torch_npu._ops_quant import pack_int4_words

        scale = values.abs().amax(dim=-1) / 7.0
        divisor = torch.where(scale == 0, torch.ones_like(scale), scale)
        return pack_int4_words(torch.round(values / divisor.unsqueeze(-1)).clamp(-8, 7)), scale
    if values.shape[-1] == 0:
        return (torch.empty(x.shape, dtype=torch.int8),
                torch.zeros(x.shape[:-1], dtype=torch.float32))
    return _dynamic_quant_rows(values)


def _smooth_groups(values: torch.Tensor, smooth_scales, group_index,
                   dtype: torch.dtype) -> torch.Tensor:
    """``values`` (float32) with each group of rows multiplied by its smooth vector."""
    hidden = values.shape[-1]
    _require_tensor("group_index", group_index)
    if smooth_scales is None:
        raise RuntimeError("group_index needs smooth_scales: one smooth row per group.")
    _require_tensor("smooth_scales", smooth_scales)
    if group_index.dtype != torch.int32 or group_index.dim() != 1:
        raise RuntimeError(f"group_index must be a 1-D int32 tensor, got {group_index.dtype} "
                           f"of shape {tuple(group_index.shape)}.")
    if (smooth_scales.dtype != dtype or smooth_scales.dim() != 2
            or tuple(smooth_scales.shape) != (group_index.numel(), hidden)):
        raise RuntimeError(f"with group_index, smooth_scales must be 2-D "
                           f"({group_index.numel()}, {hidden}) of input's dtype {dtype}; got "
                           f"{smooth_scales.dtype} {tuple(smooth_scales.shape)}.")
    ends = group_index.tolist()
    rows = values.numel() // hidden if hidden else 0
    if (any(end < start for start, end in zip([0, *ends], ends, strict=False))
            or (ends and ends[-1] != rows)):
        raise RuntimeError(f"group_index must be non-decreasing from 0 and end at the number "
                           f"of rows ({rows}), got {ends}.")
    flat = values.reshape(rows, hidden).clone()
    start = 0
    for group, end in enumerate(ends):
        flat[start:end] *= smooth_scales[group].float()
        start = end
    return flat.reshape(values.shape)


# --- npu_quant_matmul ---------------------------------------------------------------------

_MATMUL_MAX_LAST_DIM = 65535


def npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None,
                     output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
                     scale_dtype=None, group_sizes=None, y_scale=None):
    """``torch_npu.npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None,
    bias=None, output_dtype=None, x1_dtype=None, x2_dtype=None, pertoken_scale_dtype=None,
    scale_dtype=None, group_sizes=None, y_scale=None) -> Tensor``.

    ``x1_dtype``, ``x2_dtype``, ``pertoken_scale_dtype`` and ``scale_dtype`` reinterpret
    tensors as types torch has no dtype for (int4, float4, float8 scales), ``y_scale``
    belongs to those forms: all are accepted and, other than None, not modelled.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_quant_matmul.md``, the A2/A3
    rows of its dtype table with float16/bfloat16 output:

    - ``x1`` ``(m, k)``, ``x2`` ``(k, n)``: int8 (batched 3-6 dim inputs and int32-packed
      int4 are not modelled); ``k`` and ``n`` (the last dims) at most 65535.
    - ``scale``: 1-D ``(1,)`` or ``(n,)``; float32 or bfloat16 for bfloat16 output, float32
      for float16 output, or int64 words of ``npu_trans_quant_param`` for float16 output
      without ``pertoken_scale`` (the scale they hold, its top 19 bits, is used; one
      carrying an offset is for int8 output, not modelled).
    - ``pertoken_scale``: optional float32 ``(m,)``.
    - ``bias``: optional ``(n,)``; int32, bfloat16 or float32 (float16 output without
      ``pertoken_scale`` takes int32 only).
    - ``offset``: only for int8 output, which is not modelled; ``group_sizes``: not modelled.

    ``out = (x1 @ x2 + bias) * scale * pertoken_scale`` for an int32 bias, else
    ``x1 @ x2 * scale * pertoken_scale + bias``; the product is exact (int32).
    """
    refuse_unmodelled("npu_quant_matmul", x1_dtype=x1_dtype, x2_dtype=x2_dtype,
                      pertoken_scale_dtype=pertoken_scale_dtype, scale_dtype=scale_dtype,
                      y_scale=y_scale)
    for name, value in (("x1", x1), ("x2", x2), ("scale", scale)):
        _require_tensor(name, value)
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        if torch.int32 in (x1.dtype, x2.dtype):
            raise NotImplementedError("int32 (packed int4) x1/x2 are not modelled by the "
                                      "reference torch_npu.")
        raise RuntimeError(f"x1 and x2 must be int8, got {x1.dtype} and {x2.dtype}.")
    if x1.dim() != 2 or x2.dim() != 2:
        if 2 <= x1.dim() <= 6 and 2 <= x2.dim() <= 6:
            raise NotImplementedError("batched (3-6 dim) x1/x2 are not modelled by the "
                                      "reference torch_npu.")
        raise RuntimeError(f"x1 and x2 must have 2 to 6 dims, got {x1.dim()} and {x2.dim()}.")
    m, k = x1.shape
    if x2.shape[0] != k:
        raise RuntimeError(f"x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} do not multiply: "
                           "x2 must be (k, n).")
    n = x2.shape[1]
    if k > _MATMUL_MAX_LAST_DIM or n > _MATMUL_MAX_LAST_DIM:
        raise RuntimeError(f"the last dims of x1 and x2 ({k}, {n}) must not exceed "
                           f"{_MATMUL_MAX_LAST_DIM}.")
    for name, value in (("x1", x1), ("x2", x2), ("scale", scale)):
        _require_not_empty(name, value)
    if group_sizes is not None:
        raise NotImplementedError("group_sizes is not modelled by the reference torch_npu.")
    if output_dtype not in (torch.float16, torch.bfloat16):
        if output_dtype in (None, torch.int8, torch.int32):
            raise NotImplementedError(f"output_dtype={output_dtype} (int8/int32 output) is "
                                      "not modelled by the reference torch_npu.")
        raise RuntimeError(f"output_dtype must be int8, float16, bfloat16 or int32, got "
                           f"{output_dtype}.")
    if offset is not None:
        raise RuntimeError("offset applies to int8 output only; with float16/bfloat16 output "
                           "it must be None.")
    if scale.dtype == torch.int64:
        # npu_trans_quant_param's words: the page's row for float16 output, no pertoken_scale.
        if output_dtype != torch.float16 or pertoken_scale is not None:
            raise RuntimeError("an int64 scale (from npu_trans_quant_param) goes with float16 "
                               "(or int8) output and no pertoken_scale.")
        from torch_npu._ops_quant import decode_trans_quant_param

        scale, word_offset = decode_trans_quant_param(scale)
        if word_offset.any():
            raise NotImplementedError("an int64 scale carrying an offset (int8 output) is not "
                                      "modelled by the reference torch_npu.")
    allowed_scale = (torch.float32, torch.bfloat16) if output_dtype == torch.bfloat16 else (
        torch.float32,)
    if scale.dtype not in allowed_scale:
        raise RuntimeError(f"scale has dtype {scale.dtype}; with output_dtype={output_dtype} "
                           f"it must be one of {allowed_scale}.")
    if scale.dim() != 1 or scale.shape[0] not in (1, n):
        raise RuntimeError(f"scale must be 1-D (1,) or (n,)=({n},), got {tuple(scale.shape)}.")
    if pertoken_scale is not None:
        _require_tensor("pertoken_scale", pertoken_scale)
        if pertoken_scale.dtype != torch.float32 or pertoken_scale.shape != (m,):
            raise RuntimeError(f"pertoken_scale must be float32 (m,)=({m},), got "
                               f"{pertoken_scale.dtype} {tuple(pertoken_scale.shape)}.")
    if bias is not None:
        _require_tensor("bias", bias)
        if output_dtype == torch.float16 and pertoken_scale is None:
            allowed_bias = (torch.int32,)
        else:
            allowed_bias = (torch.int32, torch.bfloat16, torch.float32)
        if bias.dtype not in allowed_bias:
            raise RuntimeError(f"bias has dtype {bias.dtype}; here it must be one of "
                               f"{allowed_bias}.")
        if bias.shape != (n,):
            raise RuntimeError(f"bias must be (n,)=({n},) for 2-D inputs, got "
                               f"{tuple(bias.shape)}.")

    acc = (x1.to(torch.int32) @ x2.to(torch.int32)).double()
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias.double()
    out = acc.float() * scale.float()
    if pertoken_scale is not None:
        out = out * pertoken_scale.reshape(m, 1)
    if bias is not None and bias.dtype != torch.int32:
        out = out + bias.float()
    return out.to(output_dtype)


# --- npu_rotary_mul -----------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _rotate_interleaved(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


_ROTARY_MUL_MAX_D = 896
_ROTARY_MUL_MAX_HEADS = 1000


def npu_rotary_mul(input, r1, r2, rotary_mode="half", rotate=None):
    """``torch_npu.npu_rotary_mul(input, r1, r2, rotary_mode='half', rotate=None) -> Tensor``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_rotary_mul.md`` (A2/A3,
    ``jit_compile=False``):

    - ``input``: float16, bfloat16 or float32, 3 or 4 dims; last dim D even and below 896;
      for 3-D (TND) input, N below 1000.
    - ``r1`` (cos), ``r2`` (sin): float, ``input``'s number of dims, last dim D, every other
      dim 1 or ``input``'s; in "interleave" mode only one dim besides D may exceed 1
      (``11SD``/``1S1D``/``S11D``/``T1D``).
    - ``rotary_mode``: "half" or "interleave"; ``rotate`` (a matrix) is not modelled.

    ``output = input * r1 + rotate(input) * r2`` in ``input``'s dtype, where "half" rotates
    ``cat(-x2, x1)`` of the two halves and "interleave" ``(-x_odd, x_even)`` pairwise.
    """
    for name, value in (("input", input), ("r1", r1), ("r2", r2)):
        _require_tensor(name, value)
        _require_float_dtype(name, value)
        if value.dim() not in (3, 4):
            raise RuntimeError(f"{name} must have 3 or 4 dims, got {value.dim()}.")
        _require_not_empty(name, value)
    if rotate is not None:
        raise NotImplementedError("rotate (a rotation matrix) is not modelled by the "
                                  "reference torch_npu.")
    if rotary_mode not in ("half", "interleave"):
        raise RuntimeError(f"rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}.")
    d = input.shape[-1]
    if d % 2 or d >= _ROTARY_MUL_MAX_D:
        raise RuntimeError(f"input's last dim D={d} must be even and below {_ROTARY_MUL_MAX_D}.")
    if input.dim() == 3 and input.shape[1] >= _ROTARY_MUL_MAX_HEADS:
        raise RuntimeError(f"N={input.shape[1]} of a TND input must be below "
                           f"{_ROTARY_MUL_MAX_HEADS}.")
    for name, value in (("r1", r1), ("r2", r2)):
        if value.dim() != input.dim() or value.shape[-1] != d or any(
                size not in (1, full) for size, full in zip(value.shape[:-1],
                                                            input.shape[:-1], strict=True)):
            raise RuntimeError(f"{name} has shape {tuple(value.shape)}; it must broadcast to "
                               f"input's {tuple(input.shape)} with the same last dim.")
        if rotary_mode == "interleave" and sum(size > 1 for size in value.shape[:-1]) > 1:
            raise RuntimeError(f"{name} has shape {tuple(value.shape)}; in interleave mode only "
                               "one dim besides D may exceed 1 (11SD, 1S1D, S11D or T1D).")
    x = input.float()
    rotated = _rotate_half(x) if rotary_mode == "half" else _rotate_interleaved(x)
    return (x * r1.float() + rotated * r2.float()).to(input.dtype)


# --- npu_apply_rotary_pos_emb -------------------------------------------------------------

_APPLY_HEAD_SIZES = (64, 128)


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSH", rotary_mode="half"):
    """``torch_npu.npu_apply_rotary_pos_emb(query, key, cos, sin, layout='BSH',
    rotary_mode='half') -> (Tensor, Tensor)``, op-plugin's schema: every argument may be
    positional, and the default layout is 'BSH', which the binding reads as 'BSND' (callers
    pass 4-D ``(b, s, n, d)`` tensors with the default).

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_apply_rotary_pos_emb.md`` for
    Atlas A2/A3:

    - ``layout``: "BSND" or "BSH" (4-D ``query`` ``(b, s, qn, d)``, ``key`` ``(b, s, kn, d)``,
      ``cos``/``sin`` ``(b, s, 1, d)``) or "TND" (3-D, ``(t, n, d)`` and ``(t, 1, d)``).
    - ``rotary_mode``: "half" only on A2/A3.
    - D of all four is 64 or 128; the four share one dtype (float16, bfloat16, float32);
      none is empty.

    Rotates ``query`` and ``key`` in place, ``x * cos + cat(-x2, x1) * sin``, and returns
    them.
    """
    for name, value in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        _require_tensor(name, value)
        _require_float_dtype(name, value)
        _require_not_empty(name, value)
    if layout not in ("BSH", "BSND", "TND"):
        raise RuntimeError(f"layout={layout!r}: Atlas A2/A3 support 'BSND' (also named "
                           "'BSH', the default) and 'TND'.")
    if rotary_mode != "half":
        raise RuntimeError(f"rotary_mode={rotary_mode!r}: Atlas A2/A3 support 'half' only.")
    dims = 3 if layout == "TND" else 4
    lead = dims - 2  # (b, s) or (t,)
    for name, value in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if value.dim() != dims:
            raise RuntimeError(f"{name} must have {dims} dims for layout {layout!r}, got "
                               f"{value.dim()}.")
        if value.shape[-1] not in _APPLY_HEAD_SIZES:
            raise RuntimeError(f"{name}'s last dim D={value.shape[-1]} must be 64 or 128.")
        if value.dtype != query.dtype:
            raise RuntimeError(f"{name} has dtype {value.dtype} but query has {query.dtype}; "
                               "the four inputs must share one dtype.")
        if value.shape[:lead] != query.shape[:lead]:
            raise RuntimeError(f"{name}'s leading dims {tuple(value.shape[:lead])} must equal "
                               f"query's {tuple(query.shape[:lead])}.")
    if key.shape[-1] != query.shape[-1] or cos.shape != sin.shape:
        raise RuntimeError("query and key must share D, and cos and sin one shape.")
    if cos.shape[-1] != query.shape[-1]:
        raise NotImplementedError("cos/sin with a D other than query's are not modelled by "
                                  "the reference torch_npu.")
    if cos.shape[-2] != 1:
        raise RuntimeError(f"cos/sin must have N=1, got shape {tuple(cos.shape)}.")
    c, s = cos.float(), sin.float()
    for x in (query, key):
        x32 = x.float()
        x.copy_((x32 * c + _rotate_half(x32) * s).to(x.dtype))
    return query, key


# mrope_section values the real op's tiling takes (aclnnRopeWithSinCosCache as the
# snapshot's binding calls it; later CANN releases add more): [16, 24, 24], Qwen2-VL's.
_MROPE_SECTIONS = ((16, 24, 24),)


def npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
              rotary_mode="half"):
    """``torch_npu.npu_mrope(positions, query, key, cos_sin_cache, head_size, *,
    mrope_section=None, rotary_mode='half') -> (query_out, key_out)``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_mrope.md``, the binding (op-plugin's
    schema: new outputs shaped like ``query`` / ``key``; ``rotary_mode`` 'half' is neox
    style, any other value gptj style) and the op's checks (aclnnRopeWithSinCosCache):

    - ``positions`` int64 (the op's check; the page also names int32), ``[T]`` (plain rope:
      ``mrope_section`` None or ``[0, 0, 0]``) or ``[3, T]`` (temporal, height, width);
      every value below ``cos_sin_cache.shape[0]``;
    - ``query`` ``[T, Hq * head_size]``, ``key`` ``[T, Hk * head_size]``, ``cos_sin_cache``
      ``[max_position, rotary_dim]`` (``[cos | sin]`` halves), all float16, bfloat16 or
      float32 alike; ``head_size`` and ``rotary_dim`` 64-byte aligned (multiples of 32 in
      half precision, 16 in float32), ``rotary_dim <= head_size`` (the tail passes through);
    - ``mrope_section`` ``[16, 24, 24]`` (the sections the op's tiling takes), adding up to
      ``rotary_dim / 2``: pair ``i`` of each head takes the cos/sin of row 0, 1 or 2 of
      ``positions`` by the section it falls in (sections one after another).

    Computed in float32, each output cast once to its input's dtype.
    """
    for name, value in (("positions", positions), ("query", query), ("key", key),
                        ("cos_sin_cache", cos_sin_cache)):
        _require_tensor(name, value)
        _require_not_empty(name, value)
    if isinstance(head_size, bool) or not isinstance(head_size, int):
        raise TypeError(f"head_size must be an int, got {type(head_size).__name__}.")
    if positions.dtype != torch.int64:
        raise RuntimeError(f"positions must be int64, got {positions.dtype}.")
    for name, value in (("query", query), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        _require_float_dtype(name, value)
        if value.dtype != query.dtype:
            raise RuntimeError(f"{name} has dtype {value.dtype} but query has {query.dtype}; "
                               "query, key and cos_sin_cache must share one.")
    if query.dim() != 2 or key.dim() != 2 or query.shape[0] != key.shape[0]:
        raise RuntimeError(f"query {tuple(query.shape)} and key {tuple(key.shape)} must be "
                           "2-D [num_tokens, heads * head_size] with the same num_tokens.")
    if cos_sin_cache.dim() != 2:
        raise RuntimeError(f"cos_sin_cache must be 2-D [max_position, rotary_dim], got "
                           f"{tuple(cos_sin_cache.shape)}.")
    rotary_dim = cos_sin_cache.shape[1]
    align = 16 if query.dtype == torch.float32 else 32
    if head_size % align or rotary_dim % align:
        raise RuntimeError(f"head_size {head_size} and rotary_dim {rotary_dim} must be "
                           f"multiples of {align} for {query.dtype} (64-byte aligned).")
    if rotary_dim > head_size:
        raise RuntimeError(f"headSize can't be smaller than rotaryDim: head_size {head_size}, "
                           f"rotary_dim {rotary_dim}.")
    for name, value in (("query", query), ("key", key)):
        if value.shape[1] % head_size:
            raise RuntimeError(f"{name}'s last dim {value.shape[1]} is not a multiple of "
                               f"head_size {head_size}.")
    section = tuple(mrope_section) if mrope_section is not None else (0, 0, 0)
    num_tokens = query.shape[0]
    if section[0] <= 0:  # plain rope
        if positions.shape != (num_tokens,):
            raise RuntimeError(f"positions must be [num_tokens={num_tokens}] without "
                               f"mrope_section, got {tuple(positions.shape)}.")
        rows = positions.reshape(1, -1).expand(rotary_dim // 2, -1)
    else:
        if section not in _MROPE_SECTIONS:
            raise RuntimeError(f"mrope_section {list(section)} is not supported; supported: "
                               f"{[list(s) for s in _MROPE_SECTIONS]}.")
        if sum(section) * 2 != rotary_dim:
            raise RuntimeError(f"mrope_section {list(section)} must add up to rotary_dim / 2 "
                               f"= {rotary_dim // 2}.")
        if positions.shape != (3, num_tokens):
            raise RuntimeError(f"positions must be [3, num_tokens={num_tokens}] with "
                               f"mrope_section, got {tuple(positions.shape)}.")
        pair_section = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
        rows = positions[pair_section]  # [rotary_dim / 2, T]
    if int(positions.min()) < 0 or int(positions.max()) >= cos_sin_cache.shape[0]:
        raise RuntimeError(f"positions must lie in [0, {cos_sin_cache.shape[0]}).")
    half = rotary_dim // 2
    pairs = torch.arange(half)
    cos = cos_sin_cache[rows.t(), pairs].float()[:, None, :]
    sin = cos_sin_cache[rows.t(), pairs + half].float()[:, None, :]
    neox = rotary_mode == "half"

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(num_tokens, -1, head_size).float()
        rot, kept = heads[..., :rotary_dim], heads[..., rotary_dim:]
        if neox:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, kept), dim=-1).reshape(x.shape).to(x.dtype)

    return rotate(query), rotate(key)
