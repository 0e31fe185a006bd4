"""Activation ops: ``silu_and_mul``.

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| silu_and_mul | yes | yes | ``npu_swiglu`` |
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_kernels.dispatch import (
    NPU,
    REFERENCE,
    TRITON,
    require_float,
    resolve_backend,
    rows_view,
)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def silu_and_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of shape ``[..., 2d]``, in ``x``'s dtype."""
    require_float("silu_and_mul", "x", x)
    if x.dim() < 1:
        raise ValueError("silu_and_mul: x must have at least 1 dim, got a 0-dim tensor")
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension must be even, got {x.shape[-1]}")
    chosen = resolve_backend("silu_and_mul", x, (REFERENCE, TRITON, NPU), backend)
    if chosen == REFERENCE or x.numel() == 0:
        return silu_and_mul_reference(x)
    if chosen == NPU:
        from ascend_kernels.npu_ops import activation as npu_activation

        return npu_activation.silu_and_mul(x)
    from ascend_kernels.triton_kernels import activation as triton_activation

    out = triton_activation.silu_and_mul(rows_view(x))
    return out.view(*x.shape[:-1], x.shape[-1] // 2)
