"""Norm and activation ops.

Shapes: ``x`` is ``[..., hidden]``; ``weight`` is ``[hidden]``. The reference
computes in float32 and returns the input dtype, as vLLM's own layers do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_kernels.dispatch import NPU, REFERENCE, resolve_backend, torch_npu_module


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    variance = x32.pow(2).mean(dim=-1, keepdim=True)
    return (x32 * torch.rsqrt(variance + eps) * weight.float()).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             backend: str | None = None) -> torch.Tensor:
    """Root-mean-square norm over the last dimension, scaled by ``weight``."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"rms_norm: hidden size of x ({x.shape[-1]}) does not match weight ({weight.shape[-1]})"
        )
    chosen = resolve_backend("rms_norm", x, (REFERENCE, NPU), backend)
    if chosen == NPU:
        # npu_rms_norm returns (y, rstd); rstd is only needed for training.
        return torch_npu_module().npu_rms_norm(x, weight, epsilon=eps)[0]
    return rms_norm_reference(x, weight, eps)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for ``x`` of shape ``[..., 2d]``."""
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dimension must be even, got {x.shape[-1]}")
    chosen = resolve_backend("silu_and_mul", x, (REFERENCE, NPU), backend)
    if chosen == NPU:
        return torch_npu_module().npu_swiglu(x, dim=-1)
    return silu_and_mul_reference(x)
