"""Weight-only schemes: W8A16 (int8 weights) and W4A16 (int4 weights), float activations.

The weight stays quantized in memory (int8, or int4 two per byte); each call
dequantizes it to the activation dtype (torch math: there is no weight-only matmul op
in ascend-kernels; on npu torch_npu's ``npu_weight_quant_batchmatmul`` does this fused).
With one scale per output channel and no zero point, the scale is applied to the
product instead, so only a cast of the int weight is materialised.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from ascend_quant.schemes.base import (
    COMPRESSED_TENSORS,
    LAYOUTS,
    WHOLE_LAYER,
    LayerShapes,
    LinearScheme,
    ParamSpec,
    Placement,
)
from ascend_quant.schemes.runtime import (
    dequantize_kn,
    input_size,
    int_weight_kn,
    runtime_weight,
    weight_only_matmul,
)
from ascend_quant.schemes.stored import decode_weight, weight_param_specs


class _WeightOnly(LinearScheme):
    bits: ClassVar[int]
    layouts: ClassVar[tuple[str, ...]] = LAYOUTS

    def validate_options(self) -> None:
        o = self.options
        if o.layout not in self.layouts:
            raise self.fail(f"the {o.layout} layout of this scheme is not served; "
                            f"layouts served: {', '.join(self.layouts)}")
        if o.weight_per_tensor:
            raise self.fail("per-tensor weight scales are not served; use per-channel "
                            "or grouped scales")
        if o.layout != COMPRESSED_TENSORS and o.group_size is not None:
            raise self.fail("msModelSlim weights are served per channel only")

    def checkpoint_params(self, out_features: int, in_features: int) -> list[ParamSpec]:
        return weight_param_specs(self.options, self.bits, out_features, in_features)

    def process(self, loaded: Mapping[str, torch.Tensor], shapes: LayerShapes,
                placement: Placement = WHOLE_LAYER) -> dict[str, torch.Tensor]:
        if self.bits == 4 and shapes.input_size % 2:
            raise self.fail(f"int4 weights need an even input size, got {shapes.input_size}")
        decoded = decode_weight(loaded, self.options, self.bits, shapes, self.fail)
        return runtime_weight(decoded, self.bits)

    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        q_kn = int_weight_kn(weights, input_size(weights))
        y = weight_only_matmul(rows, q_kn, weights["weight_scale"], weights.get("weight_zero"),
                               bias)
        return y.view(*x.shape[:-1], -1)

    def dequantized_weight(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        q_kn = int_weight_kn(weights, input_size(weights))
        return dequantize_kn(q_kn, weights["weight_scale"], weights.get("weight_zero"),
                             torch.float32).t()


class W8A16(_WeightOnly):
    name = "W8A16"
    summary = "int8 weights (per channel or group), float activations"
    bits = 8


class W4A16(_WeightOnly):
    name = "W4A16"
    summary = "int4 weights (per group or channel, packed), float activations"
    bits = 4
    layouts = (COMPRESSED_TENSORS,)
