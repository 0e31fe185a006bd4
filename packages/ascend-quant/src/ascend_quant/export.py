"""Writing one quantized matrix the way each checkpoint layout stores it.

compressed-tensors tensors come from the compressed-tensors library itself: this module
builds the library's ``QuantizationScheme`` for a scheme name, computes min-max scales
(and zero points) and lets the library's compressor for the storage format quantize and
pack. msModelSlim tensors are written here, following the layout its description types
name (see ``ascend_quant.formats.modelslim``).

Used by the tests, the end-to-end checkpoints and the benchmark; imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ascend_quant.quantize import int_range, quantize_weight

# name -> (weight bits, activation bits or None, activations dynamic)
SCHEME_BITS = {
    "W8A8": (8, 8, False),
    "W8A8_DYNAMIC": (8, 8, True),
    "W8A16": (8, None, False),
    "W4A16": (4, None, False),
    "W4A8_DYNAMIC": (4, 8, True),
    "W4A4_DYNAMIC": (4, 4, True),
}


@dataclass(frozen=True)
class ActivationStats:
    """Calibration of a static activation quantizer: the input's observed range."""

    low: float
    high: float

    def scale_and_zero(self, bits: int = 8, symmetric: bool = True) -> tuple[float, int]:
        qmin, qmax = int_range(bits)
        if symmetric:
            amax = max(abs(self.low), abs(self.high))
            return (amax / qmax if amax else 1.0), 0
        low, high = min(self.low, 0.0), max(self.high, 0.0)
        scale = (high - low) / (qmax - qmin) or 1.0
        return scale, int(round(qmin - low / scale))


def ct_scheme(name: str, targets: list[str], *, group_size: int | None = None,
              symmetric: bool = True, act_symmetric: bool = True) -> Any:
    """The compressed-tensors QuantizationScheme of one of this package's schemes."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    w_bits, a_bits, dynamic = SCHEME_BITS[name]
    weights = QuantizationArgs(
        num_bits=w_bits, type="int", symmetric=symmetric,
        strategy="group" if group_size else "channel", group_size=group_size)
    activations = None
    if a_bits is not None:
        activations = QuantizationArgs(
            num_bits=a_bits, type="int", dynamic=dynamic,
            symmetric=True if dynamic else act_symmetric,
            strategy="token" if dynamic else "tensor")
    return QuantizationScheme(targets=targets, weights=weights, input_activations=activations)


def ct_format(name: str, packed: bool | None = None) -> str:
    """The storage format llm-compressor picks (weight-only: packed; else unpacked),
    unless ``packed`` says otherwise."""
    if packed is None:
        packed = SCHEME_BITS[name][1] is None
    return "pack-quantized" if packed else "int-quantized"


def ct_qparams(scheme: Any, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Min-max ``weight_scale`` (and ``weight_zero_point``) in compressed-tensors' shapes
    ([N, 1] per channel, [N, G] per group), scales in the weight's dtype."""
    args = scheme.weights
    group = args.group_size if args.strategy == "group" else None
    qw = quantize_weight(weight, args.num_bits, group, args.symmetric)
    params = {"weight_scale": qw.scale.to(weight.dtype)}
    if not args.symmetric:
        params["weight_zero_point"] = qw.zero
    return params


def export_compressed_tensors(scheme: Any, fmt: str, weight: torch.Tensor,
                              activations: ActivationStats | None = None
                              ) -> dict[str, torch.Tensor]:
    """One matrix compressed by the compressed-tensors library (local tensor names)."""
    from compressed_tensors.compressors import BaseCompressor

    state = {"weight": weight, **ct_qparams(scheme, weight)}
    if scheme.input_activations is not None and not scheme.input_activations.dynamic:
        if activations is None:
            raise ValueError("static activation quantization needs calibration statistics")
        args = scheme.input_activations
        scale, zero = activations.scale_and_zero(args.num_bits, args.symmetric)
        state["input_scale"] = torch.tensor([scale], dtype=weight.dtype)
        if not args.symmetric:
            state["input_zero_point"] = torch.tensor([zero], dtype=torch.int8)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    return dict(compressor.compress(state, scheme))


def export_modelslim(type_name: str, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     *, group_size: int | None = None,
                     activations: ActivationStats | None = None, symmetric: bool = True,
                     act_symmetric: bool = True) -> dict[str, torch.Tensor]:
    """One matrix as msModelSlim stores it for ``type_name`` (local tensor names);
    ``symmetric=False`` gives W8A16 weights an offset, ``act_symmetric=False`` gives W8A8
    activations one."""
    n = weight.shape[0]
    w_bits, _, _ = SCHEME_BITS[type_name]
    zeros = torch.zeros(n, 1, dtype=torch.float32)
    if type_name == "W4A8_DYNAMIC" and group_size:
        qw = quantize_weight(weight, 4, group_size)
        row = qw.scale.amax(1, keepdim=True)
        out = {"weight": qw.q, "weight_scale": row, "weight_offset": zeros,
               "weight_scale_second": qw.scale / row,
               "weight_offset_second": torch.zeros_like(qw.scale)}
    elif type_name in ("W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_DYNAMIC"):
        qw = quantize_weight(weight, w_bits)
        out = {"weight": qw.q, "weight_scale": qw.scale, "weight_offset": zeros}
    elif type_name == "W8A16":
        qw = quantize_weight(weight, 8, symmetric=symmetric)
        offset = zeros if qw.zero is None else -qw.zero.float()
        out = {"weight": qw.q, "weight_scale": qw.scale, "weight_offset": offset}
    elif type_name == "W8A8":
        if activations is None:
            raise ValueError("W8A8 needs calibration statistics for its input scale")
        qw = quantize_weight(weight, 8)
        in_scale, in_offset = activations.scale_and_zero(8, act_symmetric)
        deq = (in_scale * qw.scale[:, 0]).float()
        acc_bias = torch.zeros(n, dtype=torch.float64) if bias is None \
            else torch.round(bias.double() / deq.double())
        correction = in_offset * qw.q.sum(1, dtype=torch.int64).double()
        out = {"weight": qw.q,
               "weight_scale": qw.scale, "weight_offset": zeros,
               "input_scale": torch.tensor([in_scale], dtype=torch.float32),
               "input_offset": torch.tensor([float(in_offset)], dtype=torch.float32),
               "deq_scale": deq,
               "quant_bias": (acc_bias - correction).to(torch.int32)}
    else:
        raise ValueError(f"no msModelSlim export for {type_name!r}")
    if bias is not None:
        out["bias"] = bias
    return out
