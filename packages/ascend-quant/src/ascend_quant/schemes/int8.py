"""int8 weights with int8 activations: W8A8 (static per-tensor) and W8A8_DYNAMIC (per token).

Both multiply int8 by int8 with an exact int32 accumulation (ascend-kernels'
``scaled_int8_mm``) and scale per output channel; W8A8_DYNAMIC quantizes activations per
token with ascend-kernels' ``dynamic_per_token_quant``. Static activation quantization
with a zero point is written here in torch (ascend-kernels has no standalone op for it).

msModelSlim W8A8 stores ``deq_scale = input_scale * weight_scale`` per channel (float32,
or int64 carrying the float32 bits for float16 models) and ``quant_bias`` (int32), which
holds the layer's bias and the activation zero-point correction in accumulator units:
``y = (x_q @ W_q^T + quant_bias) * deq_scale``; the layer's float bias is folded in and
not added again.

On npu (``ascend_quant.schemes.npu``): W8A8 quantizes activations with ``npu_quantize``
and multiplies with ``npu_quant_matmul`` taking the int32 bias (``quant_bias``, or the
activation zero-point correction) and one float32 scale per channel; W8A8_DYNAMIC runs
ascend-kernels' ops on their npu backends (``npu_dynamic_quant`` and ``npu_quant_matmul``
with ``pertoken_scale``).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ascend_kernels import dynamic_per_token_quant, scaled_int8_mm
from ascend_kernels.dispatch import NPU, torch_npu_module
from ascend_quant.quantize import quantize_static
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
from ascend_quant.schemes.stored import decode_weight, weight_param_specs


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def decode_deq_scale(deq: torch.Tensor) -> torch.Tensor:
    """msModelSlim's deq_scale as float32: int64 tensors carry the float32 bits in their
    low 32 bits (the layout torch_npu's quant matmul takes for float16 output)."""
    if deq.dtype == torch.int64:
        low = ((deq + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)
        return low.view(torch.float32)
    return deq.float()


def _one_value(values: torch.Tensor, what: str, fail, reduce: str) -> torch.Tensor:
    flat = values.reshape(-1).float()
    if not bool(torch.isfinite(flat).all()):
        raise fail(f"{what} holds non-finite values {flat.tolist()}")
    if reduce == "max":
        return flat.max().reshape(1)
    if bool((flat != flat[0]).any()):
        raise fail(f"the fused shards carry different {what} values {flat.tolist()}; "
                   "they quantize the same input and must agree")
    return flat[:1]


class W8A8Static(LinearScheme):
    name = "W8A8"
    nz_weights = ("npu_qweight",)  # npu_quant_matmul's x2
    summary = "int8 weights (per channel), int8 activations with one static scale"

    def validate_options(self) -> None:
        o = self.options
        if o.layout == COMPRESSED_TENSORS and (o.group_size is not None or o.packed
                                               or not o.weight_symmetric):
            raise self.fail("only symmetric int8 weights per channel or per tensor, "
                            "stored unpacked (int-quantized), are served")

    @property
    def folds_layer_bias(self) -> bool:  # type: ignore[override]
        return self.layout != COMPRESSED_TENSORS

    def checkpoint_params(self, out_features: int, in_features: int) -> list[ParamSpec]:
        specs = [ParamSpec("input_scale", Kind.PER_SHARD, (1,), FLOATS)]
        if self.layout == COMPRESSED_TENSORS:
            specs += weight_param_specs(self.options, 8, out_features, in_features)
            if not self.options.act_symmetric:
                specs.append(ParamSpec("input_zero_point", Kind.PER_SHARD, (1,),
                                       (torch.int8, torch.int32)))
            return specs
        return specs + [
            ParamSpec("weight", Kind.WEIGHT, (out_features, in_features), (torch.int8,)),
            ParamSpec("input_offset", Kind.PER_SHARD, (1,), (torch.int8,) + FLOATS),
            ParamSpec("deq_scale", Kind.CHANNEL, (out_features,),
                      (torch.float32, torch.int64)),
            ParamSpec("quant_bias", Kind.CHANNEL, (out_features,), (torch.int32,)),
            ParamSpec("weight_scale", Kind.CHANNEL, (out_features, 1), FLOATS,
                      required=False),
            ParamSpec("weight_offset", Kind.CHANNEL, (out_features, 1), FLOATS,
                      required=False),
        ]

    def process(self, loaded: Mapping[str, torch.Tensor], shapes: LayerShapes,
                placement: Placement = WHOLE_LAYER) -> dict[str, torch.Tensor]:
        act_scale = _one_value(loaded["input_scale"], "input_scale", self.fail, "max")
        if bool(act_scale <= 0):
            raise self.fail(f"input_scale must be positive, got {act_scale.item()}")
        if self.layout == COMPRESSED_TENSORS:
            decoded = decode_weight(loaded, self.options, 8, shapes, self.fail)
            zero = (_one_value(loaded["input_zero_point"], "input_zero_point", self.fail,
                               "equal") if not self.options.act_symmetric
                    else torch.zeros(1))
            q, scale_a, scale_b = decoded.q, act_scale, decoded.scale[:, 0]
            # Asymmetric activations: (x_q - z) @ W_q^T = x_q @ W_q^T - z * rowsum(W_q).
            int_bias = -zero.to(torch.int64) * q.sum(1, dtype=torch.int64)
            bias = -zero * act_scale * scale_b * q.sum(1, dtype=torch.int64).float()
        else:
            q = loaded["weight"]
            zero = _one_value(loaded["input_offset"], "input_offset", self.fail, "equal")
            deq = decode_deq_scale(loaded["deq_scale"])
            if not bool(torch.isfinite(deq).all()):
                raise self.fail("deq_scale holds non-finite values")
            if placement.input_is_sharded and bool(zero != 0):
                raise self.fail("a non-zero input_offset with the input dim split across "
                                "tensor-parallel ranks is not served: quant_bias holds the "
                                "offset correction of the whole input")
            scale_a, scale_b = torch.ones(1), deq
            int_bias = loaded["quant_bias"].to(torch.int64)
            bias = loaded["quant_bias"].double() * deq.double()
            if not placement.owns_bias:
                bias = torch.zeros_like(bias)
                int_bias = torch.zeros_like(int_bias)
        if npu.use_npu("W8A8 static", q, self.backend):
            return self._npu_form(q, act_scale, zero, (scale_a * scale_b).float(), int_bias)
        return {
            "qweight": q.t().contiguous(),
            "act_scale": act_scale,
            "act_zero": zero.float(),
            "scale_a": scale_a.float(),
            "scale_b": scale_b.float().contiguous(),
            "bias": bias.float(),
        }

    def _npu_form(self, q: torch.Tensor, act_scale: torch.Tensor, zero: torch.Tensor,
                  deq_scale: torch.Tensor, int_bias: torch.Tensor) -> dict[str, torch.Tensor]:
        """npu_quantize's scale and zero point, npu_quant_matmul's weight [K, N], float32
        per-channel scale and int32 bias: ``(x_q @ W_q + int_bias) * deq_scale``."""
        npu.check_inner(self.fail, q.shape[1], q.shape[0])
        if int_bias.numel() and int(int_bias.abs().max()) >= 1 << 31:
            raise self.fail("the int32 bias of npu_quant_matmul overflows: "
                            f"max |bias| = {int(int_bias.abs().max())}")
        form = {
            "npu_qweight": q.t().contiguous(),
            "act_scale": act_scale.float(),
            "npu_deq_scale": deq_scale.reshape(-1).contiguous(),
            "npu_int_bias": int_bias.to(torch.int32).contiguous(),
        }
        if bool(zero != 0):
            form["npu_act_zero"] = zero.round().to(torch.int32).reshape(1)
        return form

    def _apply_npu(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
        npu.require_half(self.name, x)
        xq = npu.quantize_static(_rows(x), weights["act_scale"], weights.get("npu_act_zero"))
        y = torch_npu_module().npu_quant_matmul(
            xq, weights["npu_qweight"], weights["npu_deq_scale"],
            bias=weights["npu_int_bias"], output_dtype=x.dtype)
        if bias is not None and not self.folds_layer_bias:
            y = y + bias.to(x.dtype)
        return y.view(*x.shape[:-1], -1)

    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if "npu_qweight" in weights:
            return self._apply_npu(weights, x, bias)
        rows = _rows(x)
        zero = weights["act_zero"]
        xq = quantize_static(rows, weights["act_scale"], zero if bool(zero != 0) else None)
        total_bias = weights["bias"]
        if bias is not None and not self.folds_layer_bias:
            total_bias = total_bias + bias.float()
        y = scaled_int8_mm(xq, weights["qweight"], weights["scale_a"], weights["scale_b"],
                           x.dtype, total_bias)
        return y.view(*x.shape[:-1], -1)

    def dequantized_weight(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "npu_qweight" in weights:
            per_row = weights["npu_deq_scale"] / weights["act_scale"]
            return weights["npu_qweight"].t().float() * per_row.unsqueeze(1)
        per_row = weights["scale_a"] * weights["scale_b"] / weights["act_scale"]
        return weights["qweight"].t().float() * per_row.unsqueeze(1)


class W8A8Dynamic(LinearScheme):
    name = "W8A8_DYNAMIC"
    nz_weights = ("npu_qweight",)  # npu_quant_matmul's x2
    summary = "int8 weights (per channel), int8 activations quantized per token at run time"

    def validate_options(self) -> None:
        o = self.options
        if o.group_size is not None or o.packed or not o.weight_symmetric:
            raise self.fail("only symmetric int8 weights per channel or per tensor, "
                            "stored unpacked, are served")

    def checkpoint_params(self, out_features: int, in_features: int) -> list[ParamSpec]:
        return weight_param_specs(self.options, 8, out_features, in_features)

    def process(self, loaded: Mapping[str, torch.Tensor], shapes: LayerShapes,
                placement: Placement = WHOLE_LAYER) -> dict[str, torch.Tensor]:
        decoded = decode_weight(loaded, self.options, 8, shapes, self.fail)
        if decoded.zero is not None:
            raise self.fail("non-zero weight offsets (asymmetric weights) are not served "
                            "with per-token int8 activations")
        if npu.use_npu("W8A8 dynamic", decoded.q, self.backend):
            npu.check_inner(self.fail, decoded.q.shape[1], decoded.q.shape[0])
            return {"npu_qweight": decoded.q.t().contiguous(),
                    "npu_weight_scale": decoded.scale[:, 0].contiguous()}
        return {"qweight": decoded.q.t().contiguous(),
                "weight_scale": decoded.scale[:, 0].contiguous()}

    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if "npu_qweight" in weights:
            # ascend-kernels' npu backends: npu_dynamic_quant, npu_quant_matmul.
            npu.require_half(self.name, x)
            xq, x_scale = dynamic_per_token_quant(_rows(x), backend=NPU)
            y = scaled_int8_mm(xq, weights["npu_qweight"], x_scale,
                               weights["npu_weight_scale"], x.dtype, bias, backend=NPU)
            return y.view(*x.shape[:-1], -1)
        xq, x_scale = dynamic_per_token_quant(_rows(x))
        y = scaled_int8_mm(xq, weights["qweight"], x_scale, weights["weight_scale"], x.dtype,
                           bias)
        return y.view(*x.shape[:-1], -1)

    def dequantized_weight(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if "npu_qweight" in weights:
            return weights["npu_qweight"].t().float() * weights["npu_weight_scale"].unsqueeze(1)
        return weights["qweight"].t().float() * weights["weight_scale"].unsqueeze(1)
