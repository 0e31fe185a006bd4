"""A quantized linear layer's npu form as one torch custom op (``torch.ops.ascend_quant``),
for Dynamo.

vLLM's compilation (PIECEWISE graphs on the npu target: ``VLLM_COMPILE`` with the eager
backend) traces the model with Dynamo. A scheme's npu form picks ascend-kernels' backend in
Python, quantizes activations and calls torch_npu's quantized matmuls, none of which Dynamo
can trace. ``linear`` runs ``scheme.apply`` on the layer's runtime tensors as one opaque
node of the traced graph; its fake implementation only gives the output's shape and dtype
(``x`` ``[..., in]`` -> ``[..., out_features]`` in ``x``'s dtype, as every scheme's
``apply`` returns), so Dynamo never runs the kernels. When an NPU graph captures the piece
holding the node, the scheme's torch_npu calls are its steps.

A layer is registered once, after its weights are processed (``register_layer``): the op
names it by a key, deterministic per process (the layer's name, made unique), and gets its
runtime tensors as arguments, so the traced graph reads the weights as its inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ascend_quant.schemes.base import LinearScheme

_NAMESPACE = "ascend_quant"


@dataclass(frozen=True)
class TracedLayer:
    """What the op needs besides tensors: the scheme and its runtime tensors' names."""

    scheme: LinearScheme
    weight_names: tuple[str, ...]
    out_features: int


_LAYERS: dict[str, TracedLayer] = {}


def register_layer(name: str, scheme: LinearScheme, weight_names: Sequence[str],
                   out_features: int) -> str:
    """Register a processed layer for ``linear``; returns the key the op takes.

    ``name`` is the layer's name (its prefix in the model); a second layer of the same name
    in this process (another model instance) gets ``name#1``, ``name#2``, ... in order.
    """
    if not isinstance(out_features, int) or out_features < 1:
        raise ValueError(f"register_layer({name!r}): out_features must be a positive "
                         f"integer, got {out_features!r}.")
    entry = TracedLayer(scheme, tuple(weight_names), out_features)
    key, n = name or scheme.name, 0
    while key in _LAYERS:
        n += 1
        key = f"{name or scheme.name}#{n}"
    _LAYERS[key] = entry
    return key


def registered_layer(key: str) -> TracedLayer:
    try:
        return _LAYERS[key]
    except KeyError:
        raise KeyError(f"ascend_quant.linear: no layer registered as {key!r}; layers are "
                       "registered after their weights are processed (register_layer). "
                       f"Registered: {len(_LAYERS)} layer(s).") from None


@torch.library.custom_op(f"{_NAMESPACE}::linear", mutates_args=())
def linear(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None,
           layer: str) -> torch.Tensor:
    """``scheme.apply`` of the layer registered as ``layer`` on ``weights`` (its runtime
    tensors, in the registered order)."""
    entry = registered_layer(layer)
    if len(weights) != len(entry.weight_names):
        raise ValueError(f"ascend_quant.linear({layer!r}): {len(weights)} weight tensors, the "
                         f"layer's scheme {entry.scheme.name} reads {entry.weight_names}.")
    return entry.scheme.apply(dict(zip(entry.weight_names, weights, strict=True)), x, bias)


@linear.register_fake
def _(x: torch.Tensor, weights: list[torch.Tensor], bias: torch.Tensor | None,
      layer: str) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], registered_layer(layer).out_features))


__all__ = ["TracedLayer", "linear", "register_layer", "registered_layer"]
