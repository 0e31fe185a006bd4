"""Activation ops on torch_npu: ``npu_swiglu``."""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import torch_npu_module


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``torch_npu.npu_swiglu(input, dim=-1)``: ``silu(first half) * second half``."""
    return torch_npu_module().npu_swiglu(x, dim=-1)
