"""Quantization arithmetic the schemes share: weight quantizers (min-max), dequantization,
static and per-token activation quantization.

int8 per-token quantization comes from ascend-kernels (``dynamic_per_token_quant``);
what ascend-kernels has no op for yet is written here in torch: static per-tensor
activation quantization with a zero point, and per-token int4 activation quantization.
Rounding is to nearest, ties to even (``torch.round``), saturating at the type's range,
as in ascend-kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def int_range(bits: int) -> tuple[int, int]:
    """The signed range of a ``bits``-bit integer: (-2**(bits-1), 2**(bits-1) - 1)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be in [2, 8], got {bits}")
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


@dataclass(frozen=True)
class QuantizedWeight:
    """``weight ~= (q - zero) * scale`` per output row and input group.

    q: int8 [N, K] (values within the bit range); scale: float32 [N, G];
    zero: int8 [N, G] or None (symmetric); group_size: K // G.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int
    bits: int

    def dequantize(self) -> torch.Tensor:
        return dequantize_weight(self.q, self.scale, self.zero)


def _grouped(w: torch.Tensor, group_size: int | None) -> tuple[torch.Tensor, int]:
    n, k = w.shape
    size = k if group_size is None else group_size
    if size <= 0 or k % size:
        raise ValueError(f"group_size={group_size} does not divide the input size {k}")
    return w.reshape(n, k // size, size), size


def quantize_weight(w: torch.Tensor, bits: int, group_size: int | None = None,
                    symmetric: bool = True) -> QuantizedWeight:
    """Min-max quantization of ``w`` [N, K] per output row (``group_size=None``) or per
    ``group_size`` consecutive inputs of a row."""
    if w.dim() != 2:
        raise ValueError(f"quantize_weight takes [N, K], got {tuple(w.shape)}")
    qmin, qmax = int_range(bits)
    groups, size = _grouped(w.float(), group_size)
    if symmetric:
        scale = groups.abs().amax(-1) / qmax
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        q = torch.round(groups / scale.unsqueeze(-1)).clamp(qmin, qmax)
        zero = None
    else:
        low = groups.amin(-1).clamp(max=0)
        high = groups.amax(-1).clamp(min=0)
        scale = (high - low) / (qmax - qmin)
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
        zero_f = torch.round(qmin - low / scale).clamp(qmin, qmax)
        q = (torch.round(groups / scale.unsqueeze(-1)) + zero_f.unsqueeze(-1)).clamp(qmin, qmax)
        zero = zero_f.to(torch.int8)
    return QuantizedWeight(q.reshape(w.shape).to(torch.int8), scale.float(), zero, size, bits)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor,
                      zero: torch.Tensor | None = None) -> torch.Tensor:
    """float32 ``(q - zero) * scale``, scales [N, G] applied to K // G inputs each."""
    n, k = q.shape
    g = scale.shape[-1]
    if scale.shape != (n, g) or k % g:
        raise ValueError(f"scale of shape {tuple(scale.shape)} does not fit a weight {n}x{k}")
    values = q.float().reshape(n, g, k // g)
    if zero is not None:
        values = values - zero.float().reshape(n, g, 1)
    return (values * scale.float().reshape(n, g, 1)).reshape(n, k)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor | None,
                    bits: int = 8) -> torch.Tensor:
    """``clamp(round(x / scale) + zero_point)`` with one scale (and zero point) for all of
    ``x``; int8 result. Division (not multiplication by a reciprocal) matches the
    checkpoint tools' rounding."""
    qmin, qmax = int_range(bits)
    q = torch.round(x.float() / scale.float().reshape(()))
    if zero_point is not None:
        q = q + zero_point.float().reshape(())
    return q.clamp(qmin, qmax).to(torch.int8)


def quantize_per_token(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of ``x`` [..., K] to ``bits`` bits (held in int8).

    ``scale = amax(|row|) / qmax``; a zero row gets scale 0 and zeros. Returns
    ``(q, scale)`` with scale float32 shaped ``x.shape[:-1]``.
    """
    qmin, qmax = int_range(bits)
    x32 = x.float()
    scale = x32.abs().amax(-1, keepdim=True) / qmax
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round(x32 / safe).clamp(qmin, qmax).to(torch.int8)
    return q, scale.squeeze(-1)
