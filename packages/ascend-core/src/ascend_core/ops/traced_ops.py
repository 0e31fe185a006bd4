"""The custom-op layers' kernels as torch custom ops (``torch.ops.ascend.*``), for Dynamo.

vLLM's compilation (PIECEWISE graphs on the npu target: ``VLLM_COMPILE`` with the eager
backend) traces the model with Dynamo into one FX graph. The kernels behind our layers
(``ascend_kernels``) pick a backend in Python and call torch_npu, whose functions are
opaque kernels Dynamo cannot look into. Registered as custom ops with fake (shape-only)
implementations, each kernel call is one node of the traced graph, run as such when the
graph runs, and one step (one launch) when an NPU graph captures it.

The layers call these ops only while Dynamo traces (``torch.compiler.is_compiling()``);
eager forwards call ``ascend_kernels`` directly, as before.
"""

from __future__ import annotations

import torch

import ascend_kernels

_NAMESPACE = "ascend"


@torch.library.custom_op(f"{_NAMESPACE}::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return ascend_kernels.rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op(f"{_NAMESPACE}::add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ascend_kernels.add_rms_norm(x, residual, weight, eps)


@add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op(f"{_NAMESPACE}::rotary_embedding_", mutates_args=("query", "key"))
def rotary_embedding_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                      cos_sin_cache: torch.Tensor, head_size: int, is_neox_style: bool,
                      ub_size_kb: int) -> None:
    """Rotates ``query`` and ``key`` in place."""
    ascend_kernels.rotary_embedding(positions, query, key, cos_sin_cache, head_size,
                                    is_neox_style, inplace=True, ub_size_kb=ub_size_kb)


@rotary_embedding_.register_fake
def _(positions, query, key, cos_sin_cache, head_size, is_neox_style, ub_size_kb) -> None:
    return None


@torch.library.custom_op(f"{_NAMESPACE}::mrope_", mutates_args=("query", "key"))
def mrope_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
           cos_sin_cache: torch.Tensor, head_size: int, mrope_section: list[int],
           is_neox_style: bool, interleaved: bool, ub_size_kb: int) -> None:
    """Multimodal rotary embedding of ``query`` and ``key``, in place."""
    ascend_kernels.mrope(positions, query, key, cos_sin_cache, head_size, mrope_section,
                         is_neox_style, interleaved, inplace=True, ub_size_kb=ub_size_kb)


@mrope_.register_fake
def _(positions, query, key, cos_sin_cache, head_size, mrope_section, is_neox_style,
      interleaved, ub_size_kb) -> None:
    return None


@torch.library.custom_op(f"{_NAMESPACE}::silu_and_mul", mutates_args=())
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return ascend_kernels.silu_and_mul(x)


@silu_and_mul.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))
