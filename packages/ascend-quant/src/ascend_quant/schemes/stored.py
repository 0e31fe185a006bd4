"""How the two checkpoint layouts store a quantized weight, and decoding it to one form.

compressed-tensors: ``weight`` (int8, ``naive``/``int-quantized``) or ``weight_packed``
(int32 words, ``pack-quantized``) plus ``weight_shape``; ``weight_scale`` per tensor,
row or group; ``weight_zero_point`` for asymmetric weights (packed along the output
dim when the weight is packed). Dequantization: ``(q - zero_point) * scale``.

msModelSlim: ``weight`` (int8 holding the values, int4 included), ``weight_scale`` and
``weight_offset`` per row, ``[out, 1]``. Dequantization follows torch_npu's antiquant
convention, ``(q + offset) * scale``.

Decoded form: ``q`` int8 [N, K], ``scale`` float32 [N, G], ``zero`` float32 [N, G] or
None, with ``weight = (q - zero) * scale`` and ``G = K / group_size``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ascend_quant.errors import QuantConfigError
from ascend_quant.int4 import unpack_int32
from ascend_quant.quantize import int_range
from ascend_quant.schemes.base import (
    COMPRESSED_TENSORS,
    FLOATS,
    Kind,
    LayerShapes,
    ParamSpec,
    SchemeOptions,
)

INT_META = (torch.int64, torch.int32)


def groups_of(in_features: int, group_size: int | None) -> int:
    return 1 if group_size is None else max(1, in_features // group_size)


def weight_param_specs(options: SchemeOptions, bits: int, out_features: int,
                       in_features: int) -> list[ParamSpec]:
    """The weight, scale and zero-point tensors of one [out, in] matrix."""
    if options.layout == COMPRESSED_TENSORS:
        return _compressed_tensors_specs(options, bits, out_features, in_features)
    return [
        ParamSpec("weight", Kind.WEIGHT, (out_features, in_features), (torch.int8,)),
        ParamSpec("weight_scale", Kind.CHANNEL, (out_features, 1), FLOATS),
        ParamSpec("weight_offset", Kind.CHANNEL, (out_features, 1), FLOATS, required=False),
    ]


def _compressed_tensors_specs(options: SchemeOptions, bits: int, out_features: int,
                              in_features: int) -> list[ParamSpec]:
    per_word = 32 // bits
    specs = []
    if options.packed:
        specs.append(ParamSpec("weight_packed", Kind.PACKED_WEIGHT,
                               (out_features, math.ceil(in_features / per_word)),
                               (torch.int32,), packed_factor=per_word))
        specs.append(ParamSpec("weight_shape", Kind.SHAPE, (2,), INT_META))
    else:
        specs.append(ParamSpec("weight", Kind.WEIGHT, (out_features, in_features),
                               (torch.int8,)))
    groups = groups_of(in_features, options.group_size)
    if options.weight_per_tensor:
        scale = ParamSpec("weight_scale", Kind.PER_SHARD, (1,), FLOATS)
    elif options.group_size is not None:
        scale = ParamSpec("weight_scale", Kind.GROUP, (out_features, groups), FLOATS)
    else:
        scale = ParamSpec("weight_scale", Kind.CHANNEL, (out_features, 1), FLOATS)
    specs.append(scale)
    if not options.weight_symmetric:
        if options.packed:
            specs.append(ParamSpec("weight_zero_point", Kind.PACKED_GROUP,
                                   (math.ceil(out_features / per_word), groups),
                                   (torch.int32,), packed_factor=per_word))
        else:
            specs.append(ParamSpec("weight_zero_point", scale.kind, scale.shape,
                                   (torch.int8,)))
    return specs


def expand_per_shard(values: torch.Tensor, output_sizes: list[int] | tuple[int, ...]
                     ) -> torch.Tensor:
    """One value per fused shard -> one per output row, float32 [N, 1]."""
    flat = values.reshape(-1).float()
    if flat.numel() != len(output_sizes):
        raise QuantConfigError(f"{flat.numel()} per-shard values for {len(output_sizes)} "
                               "shards")
    sizes = torch.tensor(list(output_sizes))
    return flat.repeat_interleave(sizes).unsqueeze(-1)


@dataclass
class DecodedWeight:
    q: torch.Tensor        # int8 [N, K]
    scale: torch.Tensor    # float32 [N, G]
    zero: torch.Tensor | None  # float32 [N, G]

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        g = self.scale.shape[1]
        values = self.q.float().view(n, g, k // g)
        if self.zero is not None:
            values = values - self.zero.view(n, g, 1)
        return (values * self.scale.view(n, g, 1)).view(n, k)


def decode_weight(loaded: Mapping[str, torch.Tensor], options: SchemeOptions, bits: int,
                  shapes: LayerShapes, fail: Callable[[str], QuantConfigError]
                  ) -> DecodedWeight:
    """Checkpoint tensors (this rank's fused layer) -> the decoded form, checked."""
    n, k = shapes.out_features, shapes.input_size
    if options.layout == COMPRESSED_TENSORS:
        if options.packed:
            q = unpack_int32(loaded["weight_packed"], bits, k)
        else:
            q = loaded["weight"]
        if options.weight_per_tensor:
            scale = expand_per_shard(loaded["weight_scale"], list(shapes.output_sizes))
        else:
            scale = loaded["weight_scale"].float().reshape(n, -1)
        zero = None
        if not options.weight_symmetric:
            stored = loaded["weight_zero_point"]
            if options.packed:
                stored = unpack_int32(stored, bits, n, packed_dim=0)
            zero = stored.float().reshape(n, -1)
    else:
        q = loaded["weight"]
        scale = loaded["weight_scale"].float().reshape(n, -1)
        offset = loaded.get("weight_offset")
        zero = None
        if offset is not None and bool((offset != 0).any()):
            zero = -offset.float().reshape(n, -1)
    _check_values(q, scale, zero, bits, k, fail)
    return DecodedWeight(q.contiguous(), scale.contiguous(), zero)


def _check_values(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                  bits: int, k: int, fail: Callable[[str], QuantConfigError]) -> None:
    low, high = int_range(bits)
    if q.numel() and (int(q.min()) < low or int(q.max()) > high):
        raise fail(f"weight values span [{int(q.min())}, {int(q.max())}], outside the "
                   f"{bits}-bit range [{low}, {high}]: the weights are not stored as "
                   "this scheme says")
    if k % scale.shape[1]:
        raise fail(f"{scale.shape[1]} scale groups do not divide the input size {k}")
    if not bool(torch.isfinite(scale).all()):
        raise fail("weight_scale holds non-finite values")
    if zero is not None and not bool(torch.isfinite(zero).all()):
        raise fail("weight zero points / offsets hold non-finite values")
