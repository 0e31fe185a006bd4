"""Norm ops on torch_npu: ``npu_rms_norm`` and ``npu_add_rms_norm``."""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import torch_npu_module


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch_npu.npu_rms_norm(input, gamma, epsilon)`` returns ``(y, rstd)``; rstd is
    only needed for training."""
    gamma = weight if weight.dtype in (x.dtype, torch.float32) else weight.to(x.dtype)
    return torch_npu_module().npu_rms_norm(x, gamma, epsilon=eps)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch_npu.npu_add_rms_norm(x1, x2, gamma, epsilon)`` returns ``(y, rstd, x)``
    with ``x = x1 + x2``; gamma must have x1's dtype."""
    y, _rstd, added = torch_npu_module().npu_add_rms_norm(
        x, residual, weight.to(x.dtype), epsilon=eps)
    return y, added
