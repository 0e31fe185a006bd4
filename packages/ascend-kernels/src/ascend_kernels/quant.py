"""int8 quantization ops: ``dynamic_per_token_quant``, ``add_rms_norm_quant`` and
``scaled_int8_mm``.

Quantization is symmetric int8, rounding to nearest with ties to even (``torch.round``)
and saturating to [-128, 127]; values are multiplied by a reciprocal scale computed once
(per row or per tensor), never divided element by element:

- dynamic per token: ``scale = amax(|row|) / 127`` (float32), ``q = round(row * (127 /
  amax))``; a row of zeros has scale 0 and quantizes to zeros.
- static: ``q = round(y * (1 / scale)) + offset`` with one float32 ``scale`` and an
  optional integer ``offset`` (zero point) for the whole tensor.

Backends (all have the reference and Triton):

- dynamic_per_token_quant: torch_npu ``npu_dynamic_quant`` (float16/bfloat16 inputs).
- add_rms_norm_quant: torch_npu ``npu_add_rms_norm_quant`` (static) and
  ``npu_add_rms_norm_dynamic_quant`` (per token); float16/bfloat16 inputs.
- scaled_int8_mm: torch_npu ``npu_quant_matmul`` (float16/bfloat16 output).
"""

from __future__ import annotations

import functools

import torch

from ascend_kernels.dispatch import (
    NPU,
    REFERENCE,
    TRITON,
    require_dtype,
    require_float,
    require_same_device,
    resolve_backend,
    rows_view,
)
from ascend_kernels.norm import _check_norm_inputs, _check_residual, _triton_row_problem

_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _quantize_reference(y: torch.Tensor, inv_scale: torch.Tensor,
                        offset: torch.Tensor | None = None) -> torch.Tensor:
    q = torch.round(y * inv_scale)
    if offset is not None:
        q = q + offset.float()
    return q.clamp(-128, 127).to(torch.int8)


def _inverse_row_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.where(amax == 0, torch.zeros_like(amax), 127.0 / amax)


# --- dynamic_per_token_quant ----------------------------------------------------------------


def dynamic_per_token_quant_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x32 = x.float()
    if x.shape[-1] == 0:
        amax = torch.zeros((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    else:
        amax = x32.abs().amax(dim=-1, keepdim=True)
    return _quantize_reference(x32, _inverse_row_scale(amax)), (amax / 127.0).squeeze(-1)


def dynamic_per_token_quant(x: torch.Tensor, *, backend: str | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of each row of ``x`` (``[..., hidden]``).

    Returns ``(q, scales)``: ``q`` int8 shaped like ``x``; ``scales`` float32 shaped
    ``x.shape[:-1]``, with ``x ~= q * scales[..., None]``.
    """
    require_float("dynamic_per_token_quant", "x", x)
    if x.dim() < 1:
        raise ValueError("dynamic_per_token_quant: x must have at least 1 dim, got 0-dim")
    from ascend_kernels.npu_ops.quant import half_precision_problem

    chosen = resolve_backend("dynamic_per_token_quant", x, (REFERENCE, TRITON, NPU), backend,
                             {TRITON: _triton_row_problem(x),
                              NPU: half_precision_problem("npu_dynamic_quant", x)})
    if chosen == REFERENCE or x.numel() == 0:
        return dynamic_per_token_quant_reference(x)
    rows = rows_view(x)
    if chosen == NPU:
        from ascend_kernels.npu_ops import quant as npu_quant

        q, scales = npu_quant.dynamic_per_token_quant(rows.contiguous())
    else:
        from ascend_kernels.triton_kernels import quant as triton_quant

        q, scales = triton_quant.dynamic_per_token_quant(rows)
    return q.view(x.shape), scales.view(x.shape[:-1])


# --- add_rms_norm_quant ---------------------------------------------------------------------


def _as_scale_tensor(scale: torch.Tensor | float, device: torch.device) -> torch.Tensor:
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(
                f"add_rms_norm_quant: a static scale is one value for the whole tensor; got "
                f"shape {tuple(scale.shape)} (leave scale=None for per-token scales)"
            )
        if not scale.dtype.is_floating_point:
            raise TypeError(f"add_rms_norm_quant: scale has dtype {scale.dtype}; use float32")
        return scale.reshape(1).to(device=device, dtype=torch.float32)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(
            f"add_rms_norm_quant: scale must be a float or a one-element tensor, got "
            f"{type(scale).__name__}"
        )
    return torch.tensor([float(scale)], dtype=torch.float32, device=device)


def _as_offset_tensor(offset: torch.Tensor | int, device: torch.device) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):
        if offset.numel() != 1 or offset.dtype.is_floating_point or offset.dtype == torch.bool:
            raise ValueError(
                f"add_rms_norm_quant: offset must be one integer zero point, got a "
                f"{offset.dtype} tensor of shape {tuple(offset.shape)}"
            )
        return offset.reshape(1).to(device=device, dtype=torch.int32)
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(
            f"add_rms_norm_quant: offset must be an int zero point, got {type(offset).__name__}"
        )
    if not -128 <= offset <= 127:
        raise ValueError(f"add_rms_norm_quant: offset {offset} is outside int8's [-128, 127]")
    return torch.tensor([offset], dtype=torch.int32, device=device)


def add_rms_norm_quant_reference(x: torch.Tensor, residual: torch.Tensor,
                                 weight: torch.Tensor, eps: float,
                                 scale: torch.Tensor | None = None,
                                 offset: torch.Tensor | None = None
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    added = x.float() + residual.float()
    variance = added.pow(2).mean(dim=-1, keepdim=True)
    y = added * torch.rsqrt(variance + eps) * weight.float()
    if scale is None:
        q, scales = dynamic_per_token_quant_reference(y)
    else:
        scales = scale.reshape(1).float()
        q = _quantize_reference(y, 1.0 / scales, offset)
    return q, scales, added.to(x.dtype)


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, *, scale: torch.Tensor | float | None = None,
                       offset: torch.Tensor | int | None = None,
                       backend: str | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rms_norm(x + residual) * weight`` quantized to int8, fused.

    ``scale=None`` quantizes per token (dynamic); a ``scale`` (float or one-element
    tensor, with an optional integer ``offset``) quantizes statically.

    Returns ``(q, scales, new_residual)``: ``q`` int8 shaped like ``x``; ``scales``
    float32, shaped ``x.shape[:-1]`` per token, or ``[1]`` (the static scale);
    ``new_residual = x + residual`` in ``x``'s dtype. The normalised value is quantized
    in float32, never rounded to ``x``'s dtype first. On the npu backend with bfloat16
    inputs the reciprocal of the static scale and the offset are rounded to bfloat16, as
    torch_npu requires.
    """
    op = "add_rms_norm_quant"
    _check_norm_inputs(op, x, weight)
    _check_residual(op, x, residual)
    if offset is not None and scale is None:
        raise ValueError(f"{op}: an offset needs a static scale; per-token quantization "
                         "is symmetric")
    scale_t = None if scale is None else _as_scale_tensor(scale, x.device)
    offset_t = None if offset is None else _as_offset_tensor(offset, x.device)
    from ascend_kernels.npu_ops.quant import half_precision_problem

    npu_name = "npu_add_rms_norm_dynamic_quant" if scale is None else "npu_add_rms_norm_quant"
    chosen = resolve_backend(op, x, (REFERENCE, TRITON, NPU), backend,
                             {TRITON: _triton_row_problem(x),
                              NPU: half_precision_problem(npu_name, x)})
    if chosen == REFERENCE or x.numel() == 0:
        return add_rms_norm_quant_reference(x, residual, weight, eps, scale_t, offset_t)
    rows, res_rows = rows_view(x), rows_view(residual)
    if chosen == NPU:
        from ascend_kernels.npu_ops import quant as npu_quant

        if scale_t is None:
            q, scales, added = npu_quant.add_rms_norm_dynamic_quant(
                rows.contiguous(), res_rows.contiguous(), weight, eps)
        else:
            q, added = npu_quant.add_rms_norm_static_quant(
                rows.contiguous(), res_rows.contiguous(), weight, eps, scale_t, offset_t)
            scales = scale_t
    else:
        from ascend_kernels.triton_kernels import quant as triton_quant

        q, scales, added = triton_quant.add_rms_norm_quant(
            rows, res_rows, weight.contiguous(), eps, scale_t, offset_t)
        if scales is None:
            scales = scale_t
    scales = scales if scale_t is not None else scales.view(x.shape[:-1])
    return q.view(x.shape), scales, added.view(x.shape)


# --- scaled_int8_mm -------------------------------------------------------------------------


@functools.cache
def _cpu_int_mm_is_exact() -> bool:
    """Whether ``torch._int_mm`` sums exactly on this CPU.

    oneDNN's int8 GEMM on x86 CPUs without VNNI (AVX2-only, or AVX-512 without VNNI)
    multiplies with ``vpmaddubsw``, which adds pairs of u8 x s8 products in saturating
    int16: results are wrong by up to tens of thousands. Probed once per process with
    values that saturate such a kernel, in a decode-like and a prefill-like shape.
    """
    int_mm = getattr(torch, "_int_mm", None)
    if int_mm is None:
        return False
    g = torch.Generator().manual_seed(0)
    for m in (1, 32):
        a = torch.randint(-128, 128, (m, 256), dtype=torch.int8, generator=g)
        b = torch.randint(-128, 128, (256, 32), dtype=torch.int8, generator=g)
        a[:, :2], b[:2, :] = 127, 127  # 255 * 127 * 2 after oneDNN's +128 shift of a
        try:
            if not torch.equal(int_mm(a, b), a.to(torch.int32) @ b.to(torch.int32)):
                return False
        except RuntimeError:
            return False
    return True


def _int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact ``a @ b`` of int8 matrices, rounded once to float32.

    On the CPU ``torch._int_mm`` (int8 x int8 -> int32, oneDNN) is 4-6x faster than an
    int32 matmul, which torch runs without BLAS; it is used where it is exact on this CPU
    (:func:`_cpu_int_mm_is_exact`) and takes the inputs. Otherwise, and on other devices,
    a float64 matmul, which holds every int32 sum exactly.
    """
    if a.device.type == "cpu" and _cpu_int_mm_is_exact():
        try:
            return torch._int_mm(a, b).float()
        except RuntimeError:  # a layout _int_mm does not take
            pass
    return (a.double() @ b.double()).float()


def scaled_int8_mm_reference(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                             scale_b: torch.Tensor, out_dtype: torch.dtype,
                             bias: torch.Tensor | None = None) -> torch.Tensor:
    acc = _int_matmul(a, b)
    out = acc * scale_a.float().reshape(-1, 1) * scale_b.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def _check_scales(op: str, name: str, scale: torch.Tensor, length: int, axis: str) -> None:
    require_dtype(op, name, scale, torch.float32)
    if scale.numel() not in (1, length) or scale.dim() > 2 or (
            scale.dim() == 2 and 1 not in scale.shape):
        raise ValueError(
            f"{op}: {name} has shape {tuple(scale.shape)}; use one value or one per "
            f"{axis} ({length}) as [{length}], [{length}, 1] / [1, {length}] or [1]"
        )


def scaled_int8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16,
                   bias: torch.Tensor | None = None, *, backend: str | None = None
                   ) -> torch.Tensor:
    """``(a @ b) * scale_a[:, None] * scale_b[None, :] + bias`` in ``out_dtype``.

    ``a`` int8 ``[M, K]`` (per-token ``scale_a``: float32, ``M`` values or one), ``b``
    int8 ``[K, N]`` (per-channel ``scale_b``: float32, ``N`` values or one), ``bias``
    ``[N]`` (float), the product accumulated exactly in int32 and scaled in float32.
    """
    op = "scaled_int8_mm"
    require_dtype(op, "a", a, torch.int8)
    require_dtype(op, "b", b, torch.int8)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"{op}: a must be [M, K] and b [K, N]; got a {tuple(a.shape)} and "
            f"b {tuple(b.shape)}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise TypeError(f"{op}: out_dtype {out_dtype} is not float32, bfloat16 or float16")
    m, n = a.shape[0], b.shape[1]
    _check_scales(op, "scale_a", scale_a, m, "row of a")
    _check_scales(op, "scale_b", scale_b, n, "column of b")
    if bias is not None:
        require_float(op, "bias", bias)
        if bias.shape != (n,):
            raise ValueError(f"{op}: bias has shape {tuple(bias.shape)}; it must be [{n}]")
    require_same_device(op, a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    from ascend_kernels.npu_ops.quant import scaled_int8_mm_problem

    chosen = resolve_backend(op, a, (REFERENCE, TRITON, NPU), backend,
                             {NPU: scaled_int8_mm_problem(a, b, out_dtype)})
    if chosen == REFERENCE or m == 0 or n == 0 or a.shape[1] == 0:
        return scaled_int8_mm_reference(a, b, scale_a, scale_b, out_dtype, bias)
    if chosen == NPU:
        from ascend_kernels.npu_ops import quant as npu_quant

        return npu_quant.scaled_int8_mm(a.contiguous(), b, scale_a, scale_b, out_dtype, bias)
    from ascend_kernels.triton_kernels import quant as triton_quant

    return triton_quant.scaled_int8_mm(a, b, scale_a.reshape(-1).contiguous(),
                                       scale_b.reshape(-1).contiguous(), out_dtype,
                                       None if bias is None else bias.contiguous())
