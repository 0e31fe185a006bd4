"""int4 weights with per-token dynamic activations: W4A8_DYNAMIC (int8) and
W4A4_DYNAMIC (int4).

Weights stay int4 in memory (two per byte). Activations are quantized per token:
int8 with ascend-kernels' ``dynamic_per_token_quant``, int4 in torch here (ascend-kernels
has no int4 activation op). With one weight scale per output channel the product is an
exact integer matmul (ascend-kernels' ``scaled_int8_mm`` on int8 tensors holding the int4
values); with grouped weight scales each group needs its own scale inside the sum, so the
host path multiplies the dequantized activations by the dequantized weight in float32.

msModelSlim W4A8_DYNAMIC with a ``group_size`` stores a second, per-group scale
(``weight_scale_second``) that multiplies the per-channel ``weight_scale``.

On npu torch_npu documents no int8 x int4 matmul (``npu_quant_matmul`` multiplies int8 by
int8 or int4 by int4), and its int4 x int4 rows take per-token scales only with grouped
weight scales and offsets, so both schemes are composed of documented ops: activations
are quantized per token (``npu_dynamic_quant`` for int8; ``npu_quantize`` with per-row
scales for int4), dequantized to the activation dtype, and multiplied by the int4 weight
(packed at load by ``npu_convert_weight_to_int4pack``) with
``npu_weight_quant_batchmatmul``, per channel or per group. The result is the host
path's up to the rounding of the dequantized activations to float16/bfloat16.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

import torch

from ascend_kernels import dynamic_per_token_quant, scaled_int8_mm
from ascend_kernels.dispatch import NPU
from ascend_quant.quantize import int_range, quantize_per_token
from ascend_quant.schemes import npu
from ascend_quant.schemes.base import (
    COMPRESSED_TENSORS,
    FLOATS,
    WHOLE_LAYER,
    Kind,
    LayerShapes,
    LinearScheme,
    ParamSpec,
    Placement,
)
from ascend_quant.schemes.runtime import dequantize_kn, input_size, int_weight_kn, runtime_weight
from ascend_quant.schemes.stored import decode_weight, groups_of, weight_param_specs
from ascend_quant.schemes.weight_only import (
    npu_dequantized_weight,
    npu_weight_form,
    npu_weight_matmul,
)


class _Int4Weights(LinearScheme):
    act_bits: ClassVar[int]

    def validate_options(self) -> None:
        o = self.options
        if not o.weight_symmetric or o.weight_per_tensor:
            raise self.fail("only symmetric int4 weights with per-channel or grouped "
                            "scales are served")

    def _modelslim_grouped(self) -> bool:
        return self.layout != COMPRESSED_TENSORS and self.options.group_size is not None

    def checkpoint_params(self, out_features: int, in_features: int) -> list[ParamSpec]:
        if self.layout == COMPRESSED_TENSORS:
            return weight_param_specs(self.options, 4, out_features, in_features)
        # msModelSlim keeps per-channel tensors and adds the per-group ones.
        plain = self.options.__class__(layout=self.layout)
        specs = weight_param_specs(plain, 4, out_features, in_features)
        if self._modelslim_grouped():
            groups = groups_of(in_features, self.options.group_size)
            specs += [
                ParamSpec("weight_scale_second", Kind.GROUP, (out_features, groups), FLOATS),
                ParamSpec("weight_offset_second", Kind.GROUP, (out_features, groups), FLOATS,
                          required=False),
            ]
        return specs

    def process(self, loaded: Mapping[str, torch.Tensor], shapes: LayerShapes,
                placement: Placement = WHOLE_LAYER) -> dict[str, torch.Tensor]:
        if shapes.input_size % 2:
            raise self.fail(f"int4 weights need an even input size, got {shapes.input_size}")
        options = self.options
        if self.layout != COMPRESSED_TENSORS:
            options = options.__class__(layout=self.layout)
        decoded = decode_weight(loaded, options, 4, shapes, self.fail)
        if decoded.zero is not None:
            raise self.fail("non-zero weight offsets (asymmetric weights) are not served "
                            "with quantized activations")
        if self._modelslim_grouped():
            second = loaded["weight_scale_second"].float()
            offset = loaded.get("weight_offset_second")
            if offset is not None and bool((offset != 0).any()):
                raise self.fail("non-zero weight_offset_second values are not served")
            if not bool(torch.isfinite(second).all()):
                raise self.fail("weight_scale_second holds non-finite values")
            decoded.scale = decoded.scale * second
        if npu.use_npu(self.name, decoded.q, self.backend):
            return npu_weight_form(decoded.q, decoded.scale, None, 4, self.fail)
        return runtime_weight(decoded, 4)

    def _npu_activations(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token quantized activations, dequantized to ``rows``' dtype."""
        if self.act_bits == 8:
            xq, scale = dynamic_per_token_quant(rows, backend=NPU)
        else:
            _, qmax = int_range(self.act_bits)
            scale = rows.float().abs().amax(-1) / qmax
            xq = npu.quantize_rows(rows, torch.where(scale == 0, torch.ones_like(scale),
                                                     scale))
        return (xq.float() * scale.unsqueeze(-1)).to(rows.dtype)

    def _quantize_activations(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.act_bits == 8:
            return dynamic_per_token_quant(rows)
        return quantize_per_token(rows, self.act_bits)

    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if "npu_weight" in weights:
            npu.require_half(self.name, x)
            y = npu_weight_matmul(weights, self._npu_activations(rows), bias)
            return y.view(*x.shape[:-1], -1)
        xq, x_scale = self._quantize_activations(rows)
        q_kn = int_weight_kn(weights, input_size(weights))
        scale = weights["weight_scale"]
        if scale.shape[0] == 1:
            y = scaled_int8_mm(xq, q_kn, x_scale, scale[0], x.dtype, bias)
        else:
            x_deq = xq.float() * x_scale.unsqueeze(-1)
            y = x_deq @ dequantize_kn(q_kn, scale, None, torch.float32)
            if bias is not None:
                y = y + bias.float()
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], -1)

    def dequantized_weight(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "npu_weight" in weights:
            return npu_dequantized_weight(weights)
        q_kn = int_weight_kn(weights, input_size(weights))
        return dequantize_kn(q_kn, weights["weight_scale"], None, torch.float32).t()


class W4A8Dynamic(_Int4Weights):
    name = "W4A8_DYNAMIC"
    summary = "int4 weights (per channel or group), int8 activations per token"
    act_bits = 8


class W4A4Dynamic(_Int4Weights):
    name = "W4A4_DYNAMIC"
    summary = "int4 weights (per channel or group), int4 activations per token"
    act_bits = 4
