"""Runtime forms shared by the schemes: weights kept input-major ``[K, N]`` (the layout the
matmuls read), scales and zero points ``[G, N]`` (group-major), int4 packed two per byte
along K (``ascend_quant.int4``)."""

from __future__ import annotations

import torch

from ascend_quant.int4 import pack_int4_rows, unpack_int4_rows
from ascend_quant.schemes.stored import DecodedWeight


def runtime_weight(decoded: DecodedWeight, bits: int) -> dict[str, torch.Tensor]:
    """Decoded checkpoint weight -> resident tensors (int4 packed, int8 as is)."""
    q_kn = decoded.q.t().contiguous()
    weights = {"weight_scale": decoded.scale.t().contiguous()}
    if bits <= 4:
        weights["qweight_int4"] = pack_int4_rows(q_kn)
    else:
        weights["qweight"] = q_kn
    if decoded.zero is not None:
        weights["weight_zero"] = decoded.zero.t().contiguous()
    return weights


def int_weight_kn(weights: dict[str, torch.Tensor] | object, k: int) -> torch.Tensor:
    """The int8 ``[K, N]`` weight of a runtime dict (unpacking int4 on the fly)."""
    if "qweight_int4" in weights:  # type: ignore[operator]
        return unpack_int4_rows(weights["qweight_int4"], k)  # type: ignore[index]
    return weights["qweight"]  # type: ignore[index]


def input_size(weights) -> int:
    """K of a runtime dict (int4 weights have an even K, checked when processed)."""
    if "qweight" in weights:
        return weights["qweight"].shape[0]
    return weights["qweight_int4"].shape[0] * 2


def dequantize_kn(q_kn: torch.Tensor, scale_gn: torch.Tensor, zero_gn: torch.Tensor | None,
                  dtype: torch.dtype) -> torch.Tensor:
    """``(q - zero) * scale`` as a ``[K, N]`` matrix of ``dtype`` (computed in float32)."""
    k, n = q_kn.shape
    g = scale_gn.shape[0]
    values = q_kn.float().view(g, k // g, n)
    if zero_gn is not None:
        values = values - zero_gn.unsqueeze(1)
    return (values * scale_gn.unsqueeze(1)).view(k, n).to(dtype)


def weight_only_matmul(x: torch.Tensor, q_kn: torch.Tensor, scale_gn: torch.Tensor,
                       zero_gn: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequant(W) + bias`` for float ``x`` [M, K]; one scale per output channel
    and no zero point factor the scale out of the sum (only a cast of the int weight)."""
    if scale_gn.shape[0] == 1 and zero_gn is None:
        y = (x @ q_kn.to(x.dtype)).float() * scale_gn[0]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)
    y = x @ dequantize_kn(q_kn, scale_gn, zero_gn, x.dtype)
    return y if bias is None else y + bias.to(x.dtype)
