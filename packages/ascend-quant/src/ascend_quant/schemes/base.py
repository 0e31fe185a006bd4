"""What every linear quantization scheme provides, and how it describes its parameters.

A scheme is the math of one quantized linear layer, independent of vLLM:

1. ``checkpoint_params(out_features, in_features)``: the tensors a checkpoint stores for
   one ``[out, in]`` matrix, with shapes and dtypes exactly as stored (``ParamSpec``).
   The vLLM glue creates parameters from these and checks every loaded tensor against
   them, so a mis-shaped scale fails at load time with the layer's name.
2. ``process(loaded, ...)``: after loading, turn the checkpoint tensors of one
   (possibly fused) layer into the runtime tensors ``apply`` reads (transposes,
   int4 repacking, folded biases); validates what it reads.
3. ``apply(weights, x, bias)``: ``y = x @ W^T + bias`` with the quantized weight.

``process`` picks the runtime form once: the host form (ascend-kernels' ops, reference or
Triton) or, for weights on an npu device, the npu form (torch_npu's quantized matmuls; see
``ascend_quant.schemes.npu``); ``apply`` serves whichever form it is given.

Two checkpoint layouts exist for the same math: ``compressed-tensors`` and msModelSlim
(``modelslim``); a scheme instance is built for one of them.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ascend_quant.errors import QuantConfigError

COMPRESSED_TENSORS = "compressed-tensors"
MODELSLIM = "modelslim"
LAYOUTS = (COMPRESSED_TENSORS, MODELSLIM)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class Kind(enum.Enum):
    """How a parameter is laid out relative to its ``[out, in]`` matrix (and so how
    tensor parallelism shards it and fused shards stack)."""

    WEIGHT = "weight"            # [out, in]
    PACKED_WEIGHT = "packed"     # [out, ceil(in / factor)] words packed along in
    CHANNEL = "channel"          # [out, 1] or [out]: one value per output row
    GROUP = "group"              # [out, groups]
    PACKED_GROUP = "packed_group"  # [ceil(out / factor), groups] packed along out
    PER_SHARD = "per_shard"      # one value per logical matrix of a fused layer
    SHAPE = "shape"              # the [out, in] of a packed matrix, as stored metadata


@dataclass(frozen=True)
class ParamSpec:
    """One checkpoint tensor of one ``[out, in]`` matrix.

    ``dtypes``: the stored dtypes accepted (the first is the one created); float scales
    accept any float dtype and are converted on copy. ``required=False`` marks tensors
    some producers omit; a missing optional tensor reads as zeros.
    """

    name: str
    kind: Kind
    shape: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    packed_factor: int = 1
    required: bool = True

    @property
    def dtype(self) -> torch.dtype:
        return self.dtypes[0]

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype in self.dtypes


@dataclass(frozen=True)
class SchemeOptions:
    """How a checkpoint stores one scheme (from its config), beyond the scheme's name.

    group_size: inputs per weight scale (None: one scale per output row).
    weight_symmetric: False when weights carry zero points (offsets).
    weight_per_tensor: one weight scale per matrix (compressed-tensors ``tensor``).
    packed: weights packed into int32 words (compressed-tensors ``pack-quantized``).
    act_symmetric: False when static activations carry a zero point.
    """

    layout: str
    group_size: int | None = None
    weight_symmetric: bool = True
    weight_per_tensor: bool = False
    packed: bool = False
    act_symmetric: bool = True

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise QuantConfigError(f"unknown checkpoint layout {self.layout!r}; "
                                   f"known: {', '.join(LAYOUTS)}")


@dataclass(frozen=True)
class Placement:
    """Where this rank's slice of a layer sits under tensor parallelism.

    input_is_sharded: this rank holds part of the input dim (row parallel, tp > 1).
    owns_bias: this rank adds the layer's bias (row parallel: rank 0 only).
    """

    input_is_sharded: bool = False
    owns_bias: bool = True


WHOLE_LAYER = Placement()


@dataclass
class LayerShapes:
    """One (possibly fused) layer on this rank: its shards' output sizes and its input."""

    output_sizes: Sequence[int]
    input_size: int
    shard_names: Sequence[str] = field(default_factory=tuple)

    @property
    def out_features(self) -> int:
        return sum(self.output_sizes)


class LinearScheme(ABC):
    """The math of one quantized linear layer; see the module docstring."""

    #: registry name, as msModelSlim spells the type (e.g. "W8A8_DYNAMIC")
    name: ClassVar[str]
    #: one line for error messages and docs
    summary: ClassVar[str]
    #: True when ``apply`` ignores the layer's float bias because the checkpoint
    #: folds it into its own quantized bias (msModelSlim W8A8).
    folds_layer_bias: bool = False
    #: the runtime tensors of the npu form that its torch_npu matmul takes in FRACTAL_NZ
    #: (cast at load under weight_nz_mode, see ascend_core.worker.weight_format)
    nz_weights: ClassVar[tuple[str, ...]] = ()

    def __init__(self, options: SchemeOptions, layer_name: str = "", *,
                 backend: str | None = None) -> None:
        self.options = options
        self.layer_name = layer_name
        #: None: the npu form for weights on an npu device (with torch_npu), else the host
        #: form; "npu" / "reference" force one (see ``ascend_quant.schemes.npu``).
        self.backend = backend
        self.validate_options()

    @property
    def layout(self) -> str:
        return self.options.layout

    def validate_options(self) -> None:
        """Raise QuantConfigError for option combinations this scheme does not serve."""
        return None

    def fail(self, message: str) -> QuantConfigError:
        where = f"layer {self.layer_name!r}: " if self.layer_name else ""
        return QuantConfigError(f"{where}{self.name} ({self.layout}): {message}")

    @abstractmethod
    def checkpoint_params(self, out_features: int, in_features: int) -> list[ParamSpec]:
        """The checkpoint tensors of one [out, in] matrix."""

    @abstractmethod
    def process(self, loaded: Mapping[str, torch.Tensor], shapes: LayerShapes,
                placement: Placement = WHOLE_LAYER) -> dict[str, torch.Tensor]:
        """Checkpoint tensors of this rank's layer -> the runtime tensors of ``apply``.

        Fused layers arrive stacked along the output dim; PER_SHARD tensors as
        ``[num_shards]`` and SHAPE tensors as ``[num_shards, 2]``.
        """

    @abstractmethod
    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., in] -> [..., out] in ``x``'s dtype."""

    @abstractmethod
    def dequantized_weight(self, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The float32 [out, in] weight the runtime tensors represent (for references)."""
