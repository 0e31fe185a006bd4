"""Weight-only schemes: W8A16 (int8 weights) and W4A16 (int4 weights), float activations.

The weight stays quantized in memory (int8, or int4 two per byte); each call
dequantizes it to the activation dtype (torch math: there is no weight-only matmul op
in ascend-kernels; on npu torch_npu's ``npu_weight_quant_batchmatmul`` does this fused).
With one scale per output channel and no zero point, the scale is applied to the
product instead, so only a cast of the int weight is materialised.

On npu (``ascend_quant.schemes.npu``) ``npu_weight_quant_batchmatmul`` serves both, with
the weight ``[K, N]`` as int8 or, for int4, packed at load by
``npu_convert_weight_to_int4pack``; zero points become its ``antiquant_offset``
(``(w + offset) * scale`` with ``offset = -zero``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from ascend_quant.schemes import npu
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
        if npu.use_npu(self.name, decoded.q, self.backend):
            return npu_weight_form(decoded.q, decoded.scale, decoded.zero, self.bits,
                                   self.fail)
        return runtime_weight(decoded, self.bits)

    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if "npu_weight" in weights:
            npu.require_half(self.name, x)
            y = npu_weight_matmul(weights, x.reshape(-1, x.shape[-1]), bias)
            return y.view(*x.shape[:-1], -1)
        rows = x.reshape(-1, x.shape[-1])
        q_kn = int_weight_kn(weights, input_size(weights))
        y = weight_only_matmul(rows, q_kn, weights["weight_scale"], weights.get("weight_zero"),
                               bias)
        return y.view(*x.shape[:-1], -1)

    def dequantized_weight(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "npu_weight" in weights:
            return npu_dequantized_weight(weights)
        q_kn = int_weight_kn(weights, input_size(weights))
        return dequantize_kn(q_kn, weights["weight_scale"], weights.get("weight_zero"),
                             torch.float32).t()


def npu_weight_form(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    bits: int, fail) -> dict[str, torch.Tensor]:
    """Decoded ``q`` [N, K], ``scale``/``zero`` [N, G] -> npu_weight_quant_batchmatmul's
    weight ``[K, N]`` (int8, or int32 packing 8 int4 values along N) and float32
    ``[G, N]`` antiquant scale and offset."""
    n, k = q.shape
    npu.check_inner(fail, k, n)
    npu.check_weight_only_group(fail, k, scale.shape[1])
    q_kn = q.t().contiguous()
    form = {"npu_weight": npu.int4pack(q_kn, fail) if bits <= 4 else q_kn,
            "npu_scale": scale.t().float().contiguous()}
    if zero is not None:
        form["npu_offset"] = (-zero).t().float().contiguous()
    return form


def npu_weight_matmul(weights: Mapping[str, torch.Tensor], rows: torch.Tensor,
                      bias: torch.Tensor | None) -> torch.Tensor:
    scale = weights["npu_scale"]
    group_size = 0 if scale.shape[0] == 1 else rows.shape[-1] // scale.shape[0]
    return npu.weight_quant_matmul(rows, weights["npu_weight"], scale,
                                   weights.get("npu_offset"), bias, group_size)


def npu_dequantized_weight(weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """float32 [N, K] of an npu form (int4 words unpacked in the documented order)."""
    q_kn = weights["npu_weight"]
    if q_kn.dtype == torch.int32:
        q_kn = npu.unpack_int4pack(q_kn)
    offset = weights.get("npu_offset")
    return dequantize_kn(q_kn, weights["npu_scale"], None if offset is None else -offset,
                         torch.float32).t()


class W8A16(_WeightOnly):
    name = "W8A16"
    nz_weights = ("npu_weight",)  # npu_weight_quant_batchmatmul's int8 weight
    summary = "int8 weights (per channel or group), float activations"
    bits = 8


class W4A16(_WeightOnly):
    name = "W4A16"
    summary = "int4 weights (per group or channel, packed), float activations"
    bits = 4
    layouts = (COMPRESSED_TENSORS,)
