"""int4 storage: the resident two-per-byte layout and compressed-tensors' int32 packing.

Resident layout (what the schemes keep in memory): a ``uint8`` tensor ``[ceil(K/2), N]``
for a ``[K, N]`` matrix of signed int4 values; byte row ``i`` holds rows ``2i`` (low
nibble) and ``2i + 1`` (high nibble), each stored offset-binary (``value + 8``). Packing
along K keeps the unpacked matrix ``[K, N]`` contiguous, which is the layout the matmuls
read, and halves int8 storage.

compressed-tensors layout (``pack-quantized``): ``int32`` words along the packed dim,
``32 // bits`` values each, the first value in the lowest bits, offset-binary
(``value + 2**(bits-1)``), the packed dim padded up to a whole word.
"""

from __future__ import annotations

import math

import torch

INT4_MIN, INT4_MAX = -8, 7
_OFFSET4 = 8


def _check_int4_values(q: torch.Tensor) -> None:
    if q.dtype != torch.int8:
        raise TypeError(f"int4 values must be held in an int8 tensor, got {q.dtype}")
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise ValueError(
            f"int4 values must lie in [{INT4_MIN}, {INT4_MAX}]; got "
            f"[{int(q.min())}, {int(q.max())}]"
        )


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Pack a ``[K, N]`` int8 tensor of int4 values into ``uint8 [ceil(K/2), N]``."""
    _check_int4_values(q)
    if q.dim() != 2:
        raise ValueError(f"pack_int4_rows takes a [K, N] matrix, got shape {tuple(q.shape)}")
    k = q.shape[0]
    biased = (q.to(torch.int16) + _OFFSET4).to(torch.uint8)
    if k % 2:
        biased = torch.cat([biased, torch.full_like(biased[:1], _OFFSET4)])
    pairs = biased.view(-1, 2, biased.shape[1])
    return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()


def unpack_int4_rows(packed: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of :func:`pack_int4_rows`: ``int8 [k, N]``, contiguous."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(
            f"unpack_int4_rows takes a uint8 [ceil(K/2), N] tensor, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    if packed.shape[0] != math.ceil(k / 2):
        raise ValueError(f"{packed.shape[0]} packed rows cannot hold k={k} rows")
    low = (packed & 0xF).to(torch.int8) - _OFFSET4
    high = (packed >> 4).to(torch.int8) - _OFFSET4
    return torch.stack([low, high], dim=1).view(-1, packed.shape[1])[:k]


def pack_int32(q: torch.Tensor, bits: int, packed_dim: int = 1) -> torch.Tensor:
    """compressed-tensors' packing of a 2-D int8 tensor of ``bits``-bit values into int32."""
    if q.dim() != 2:
        raise ValueError(f"pack_int32 takes a 2-D tensor, got shape {tuple(q.shape)}")
    if 32 % bits:
        raise ValueError(f"bits={bits} does not divide 32")
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if q.dtype != torch.int8 or (q.numel() and (int(q.min()) < low or int(q.max()) > high)):
        raise ValueError(f"pack_int32 needs int8 values in [{low}, {high}]")
    values = q if packed_dim == 1 else q.t()
    per_word = 32 // bits
    rows, cols = values.shape
    padded = math.ceil(cols / per_word) * per_word
    biased = values.to(torch.int64) + (1 << (bits - 1))
    if padded != cols:
        biased = torch.nn.functional.pad(biased, (0, padded - cols))
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (biased.view(rows, padded // per_word, per_word) << shifts).sum(-1)
    # Values above 2**31 wrap to the negative int32 with the same bits.
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)
    return words if packed_dim == 1 else words.t().contiguous()


def unpack_int32(words: torch.Tensor, bits: int, size: int, packed_dim: int = 1) -> torch.Tensor:
    """The inverse of :func:`pack_int32`; ``size`` is the unpadded length of the packed dim."""
    if words.dtype != torch.int32 or words.dim() != 2:
        raise ValueError(f"unpack_int32 takes a 2-D int32 tensor, got {words.dtype} "
                         f"{tuple(words.shape)}")
    per_word = 32 // bits
    values = words if packed_dim == 1 else words.t()
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    fields = (values.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    flat = fields.reshape(values.shape[0], -1)
    if flat.shape[1] < size:
        raise ValueError(f"{words.shape} int32 words hold {flat.shape[1]} values, not {size}")
    out = (flat[:, :size] - (1 << (bits - 1))).to(torch.int8)
    return out if packed_dim == 1 else out.t().contiguous()
