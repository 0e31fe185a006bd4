"""Quantization schemes: the math of quantized linear and MoE-expert layers (no vLLM)."""

from ascend_quant.schemes.base import (
    COMPRESSED_TENSORS,
    LAYOUTS,
    MODELSLIM,
    Kind,
    LayerShapes,
    LinearScheme,
    ParamSpec,
    Placement,
    SchemeOptions,
)
from ascend_quant.schemes.int4_act import W4A4Dynamic, W4A8Dynamic
from ascend_quant.schemes.int8 import W8A8Dynamic, W8A8Static
from ascend_quant.schemes.moe import MoEScheme, MoEW8A8Dynamic
from ascend_quant.schemes.weight_only import W4A16, W8A16

LINEAR_SCHEMES: tuple[type[LinearScheme], ...] = (
    W8A8Static, W8A8Dynamic, W8A16, W4A16, W4A8Dynamic, W4A4Dynamic,
)
MOE_SCHEMES: tuple[type[MoEScheme], ...] = (MoEW8A8Dynamic,)

__all__ = [
    "COMPRESSED_TENSORS",
    "LAYOUTS",
    "LINEAR_SCHEMES",
    "MODELSLIM",
    "MOE_SCHEMES",
    "Kind",
    "LayerShapes",
    "LinearScheme",
    "MoEScheme",
    "MoEW8A8Dynamic",
    "ParamSpec",
    "Placement",
    "SchemeOptions",
    "W4A16",
    "W4A4Dynamic",
    "W4A8Dynamic",
    "W8A16",
    "W8A8Dynamic",
    "W8A8Static",
]
