"""Norm ops: ``rms_norm``, ``add_rms_norm`` and ``l2norm``.

Shapes: ``x`` is ``[..., hidden]``; ``weight`` is ``[hidden]``. The references compute in
float32 and cast once to the output dtype.

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| rms_norm | yes | yes | ``npu_rms_norm`` |
| add_rms_norm | yes | yes | ``npu_add_rms_norm`` |
| l2norm | yes | yes | none (torch_npu has no fused l2norm) |
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import (
    NPU,
    REFERENCE,
    TRITON,
    require_float,
    require_same_device,
    resolve_backend,
    rows_view,
)


def _check_norm_inputs(op: str, x: torch.Tensor, weight: torch.Tensor) -> None:
    require_float(op, "x", x)
    require_float(op, "weight", weight)
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least 1 dim, got a 0-dim tensor")
    if weight.dim() != 1 or x.shape[-1] != weight.shape[-1]:
        got = weight.shape[-1] if weight.dim() == 1 else f"shape {tuple(weight.shape)}"
        raise ValueError(
            f"{op}: hidden size of x ({x.shape[-1]}) does not match weight ({got}); "
            "weight must be [hidden]"
        )
    require_same_device(op, x=x, weight=weight)


def _triton_row_problem(x: torch.Tensor) -> str | None:
    from ascend_kernels.triton_kernels import row_block_problem  # no triton import

    return row_block_problem(x.shape[-1])


# --- rms_norm -------------------------------------------------------------------------------


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             backend: str | None = None) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, scaled by ``weight``; ``x``'s dtype."""
    _check_norm_inputs("rms_norm", x, weight)
    chosen = resolve_backend("rms_norm", x, (REFERENCE, TRITON, NPU), backend,
                             {TRITON: _triton_row_problem(x)})
    if chosen == REFERENCE or x.numel() == 0:
        return rms_norm_reference(x, weight, eps)
    if chosen == NPU:
        from ascend_kernels.npu_ops import norm as npu_norm

        return npu_norm.rms_norm(x, weight, eps)
    from ascend_kernels.triton_kernels import norm as triton_norm

    out, _ = triton_norm.rms_norm(rows_view(x), weight.contiguous(), eps)
    return out.view(x.shape)


# --- add_rms_norm ---------------------------------------------------------------------------


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    added = x.float() + residual.float()
    variance = added.pow(2).mean(dim=-1, keepdim=True)
    out = (added * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)
    return out, added.to(x.dtype)


def _check_residual(op: str, x: torch.Tensor, residual: torch.Tensor) -> None:
    if not isinstance(residual, torch.Tensor):
        raise TypeError(f"{op}: residual must be a torch.Tensor, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(
            f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; "
            "they must be equal"
        )
    if residual.dtype != x.dtype:
        raise TypeError(
            f"{op}: residual has dtype {residual.dtype} but x has {x.dtype}; they must match"
        )
    require_same_device(op, x=x, residual=residual)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float = 1e-6, *, backend: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(x + residual)``, returning ``(out, x + residual)``.

    The sum is taken in float32 and normalised unrounded; the returned new residual is
    the sum in ``x``'s dtype (vLLM's ``RMSNorm.forward_native`` with a residual).
    """
    _check_norm_inputs("add_rms_norm", x, weight)
    _check_residual("add_rms_norm", x, residual)
    chosen = resolve_backend("add_rms_norm", x, (REFERENCE, TRITON, NPU), backend,
                             {TRITON: _triton_row_problem(x)})
    if chosen == REFERENCE or x.numel() == 0:
        return add_rms_norm_reference(x, residual, weight, eps)
    if chosen == NPU:
        from ascend_kernels.npu_ops import norm as npu_norm

        return npu_norm.add_rms_norm(x, residual, weight, eps)
    from ascend_kernels.triton_kernels import norm as triton_norm

    out, added = triton_norm.rms_norm(rows_view(x), weight.contiguous(), eps,
                                      residual=rows_view(residual))
    return out.view(x.shape), added.view(x.shape)


# --- l2norm ---------------------------------------------------------------------------------


def l2norm_reference(x: torch.Tensor, eps: float = 1e-6,
                     out_dtype: torch.dtype | None = None) -> torch.Tensor:
    x32 = x.float()
    out = x32 * torch.rsqrt(x32.pow(2).sum(dim=-1, keepdim=True) + eps)
    return out.to(out_dtype or x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6, *, out_dtype: torch.dtype | None = None,
           backend: str | None = None) -> torch.Tensor:
    """``x * rsqrt(sum(x**2) + eps)`` over the last dimension (the l2norm of vLLM's
    linear-attention layers, e.g. Qwen3-Next's gated delta net), in ``out_dtype``
    (default ``x``'s dtype)."""
    require_float("l2norm", "x", x)
    if x.dim() < 1:
        raise ValueError("l2norm: x must have at least 1 dim, got a 0-dim tensor")
    if out_dtype is not None and out_dtype not in (torch.float32, torch.bfloat16,
                                                   torch.float16):
        raise TypeError(f"l2norm: out_dtype {out_dtype} is not a float dtype")
    chosen = resolve_backend("l2norm", x, (REFERENCE, TRITON), backend,
                             {TRITON: _triton_row_problem(x)})
    if chosen == REFERENCE or x.numel() == 0:
        return l2norm_reference(x, eps, out_dtype)
    from ascend_kernels.triton_kernels import norm as triton_norm

    out = triton_norm.l2norm(rows_view(x), eps, out_dtype or x.dtype)
    return out.view(x.shape)
