"""compressed-tensors checkpoints: which scheme serves which layer.

The ``quantization_config`` of ``config.json`` is read with the compressed-tensors
library's own models (``QuantizationConfig``, ``QuantizationScheme``,
``QuantizationArgs``) and matched to layers with its matcher (``match_targets``,
``is_match``: exact names, then ``re:`` patterns, then class names, ``ignore`` first), so
what the library wrote is what is read. Each matched ``QuantizationScheme`` is then
classified into one of this package's schemes, or refused with the supported list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ascend_quant.errors import QuantConfigError
from ascend_quant.schemes.base import COMPRESSED_TENSORS, SchemeOptions

QUANTIZED_FORMATS = ("naive-quantized", "int-quantized", "pack-quantized")


@dataclass(frozen=True)
class SchemeChoice:
    """A scheme name (as registered in ascend-core's QUANT_SCHEMES) and its options."""

    name: str
    options: SchemeOptions

    def describe(self) -> str:
        o = self.options
        parts = [self.name]
        if o.group_size is not None:
            parts.append(f"group {o.group_size}")
        if o.weight_per_tensor:
            parts.append("per-tensor weight scale")
        if not o.weight_symmetric:
            parts.append("asymmetric weights")
        if o.packed:
            parts.append("packed")
        return ", ".join(parts)


# What each classification needs, for the error listing the supported schemes.
SUPPORTED = {
    "W8A8": "int8 weights (channel/tensor), int8 static per-tensor activations",
    "W8A8_DYNAMIC": "int8 weights (channel/tensor), int8 dynamic per-token activations",
    "W8A16": "int8 weights (channel/group), no activation quantization",
    "W4A16": "int4 weights (channel/group), no activation quantization",
    "W4A8_DYNAMIC": "int4 symmetric weights (channel/group), int8 dynamic per-token "
                    "activations",
    "W4A4_DYNAMIC": "int4 symmetric weights (channel/group), int4 dynamic per-token "
                    "activations",
}


def supported_list() -> str:
    return "; ".join(f"{name}: {what}" for name, what in SUPPORTED.items())


def describe_args(args: Any) -> str:
    if args is None:
        return "none"
    text = f"{args.type}{args.num_bits} {args.strategy}"
    if args.strategy == "group":
        text += f" {args.group_size}"
    text += " dynamic" if args.dynamic else " static"
    if not args.symmetric:
        text += " asymmetric"
    return text


def describe_scheme(scheme: Any, fmt: str | None) -> str:
    return (f"weights {describe_args(scheme.weights)}, input activations "
            f"{describe_args(scheme.input_activations)}, output activations "
            f"{describe_args(scheme.output_activations)}, format {fmt}")


def classify(scheme: Any, fmt: str | None, layer: str) -> SchemeChoice:
    """A compressed-tensors QuantizationScheme -> the scheme that serves it, or refuse."""
    w, a = scheme.weights, scheme.input_activations

    def refuse(why: str) -> QuantConfigError:
        return QuantConfigError(
            f"layer {layer!r}: compressed-tensors scheme ({describe_scheme(scheme, fmt)}) "
            f"is not supported: {why}. Supported: {supported_list()}."
        )

    if scheme.output_activations is not None:
        raise refuse("output activation quantization")
    if w is None:
        raise refuse("activation-only quantization")
    if w.type != "int":
        raise refuse(f"{w.type} weights")
    if w.strategy not in ("channel", "group", "tensor"):
        raise refuse(f"weight strategy {w.strategy!r}")
    if w.actorder == "group":
        raise refuse("group activation ordering (g_idx)")
    if fmt not in QUANTIZED_FORMATS:
        raise refuse(f"storage format {fmt!r} (served: {', '.join(QUANTIZED_FORMATS)})")
    options = SchemeOptions(
        layout=COMPRESSED_TENSORS,
        group_size=w.group_size if w.strategy == "group" else None,
        weight_symmetric=bool(w.symmetric),
        weight_per_tensor=w.strategy == "tensor",
        packed=fmt == "pack-quantized",
        act_symmetric=True if a is None else bool(a.symmetric),
    )
    bits = w.num_bits
    if a is None:
        names = {8: "W8A16", 4: "W4A16"}
        if bits not in names:
            raise refuse(f"{bits}-bit weights")
        return SchemeChoice(names[bits], options)
    if a.type != "int":
        raise refuse(f"{a.type} activations")
    if a.dynamic is True and a.strategy == "token":
        if not a.symmetric:
            raise refuse("asymmetric dynamic activations")
        names = {(8, 8): "W8A8_DYNAMIC", (4, 8): "W4A8_DYNAMIC", (4, 4): "W4A4_DYNAMIC"}
    elif a.dynamic is False and a.strategy == "tensor":
        names = {(8, 8): "W8A8"}
    else:
        raise refuse(f"activation quantization {describe_args(a)}")
    key = (bits, a.num_bits)
    if key not in names:
        raise refuse(f"{bits}-bit weights with {a.num_bits}-bit "
                     f"{'dynamic' if a.dynamic else 'static'} activations")
    return SchemeChoice(names[key], options)


class CompressedTensorsFormat:
    """A parsed compressed-tensors ``quantization_config`` (see the module docstring)."""

    def __init__(self, config: Any, raw: dict[str, Any]) -> None:
        self.config = config
        self.raw = raw
        self.ignore: list[str] = list(config.ignore or [])
        self.target_to_scheme: OrderedDict[str, Any] = OrderedDict()
        for scheme in config.config_groups.values():
            for target in scheme.targets:
                self.target_to_scheme[target] = scheme

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CompressedTensorsFormat:
        from compressed_tensors.quantization import QuantizationConfig
        from pydantic import ValidationError

        try:
            config = QuantizationConfig.model_validate(raw)
        except ValidationError as err:
            raise QuantConfigError(
                f"config.json's quantization_config is not a valid compressed-tensors "
                f"QuantizationConfig: {err}"
            ) from None
        if config.kv_cache_scheme is not None:
            raise QuantConfigError(
                "compressed-tensors kv_cache_scheme (KV-cache quantization) is not supported "
                "by the ascend plugin; serve the checkpoint without it")
        if raw.get("sparsity_config"):
            raise QuantConfigError("compressed-tensors sparsity_config is not supported")
        if raw.get("transform_config"):
            raise QuantConfigError("compressed-tensors transform_config (rotations) is not "
                                   "supported")
        return cls(config, raw)

    def rename_targets(self, rename) -> None:
        """Apply ``rename(name) -> name | None`` to dotted layer names in targets/ignore
        (class names and ``re:`` patterns stay)."""
        def one(target: str) -> str | None:
            return rename(target) if "." in target and not target.startswith("re:") else target

        self.target_to_scheme = OrderedDict(
            (new, scheme) for target, scheme in self.target_to_scheme.items()
            if (new := one(target)) is not None)
        self.ignore = [new for target in self.ignore if (new := one(target)) is not None]

    def scheme_for(self, name: str, module: torch.nn.Module) -> Any | None:
        """The library QuantizationScheme for a module name (None: not quantized)."""
        from compressed_tensors.utils.match import is_match, match_targets

        if self.ignore and is_match(name, module, self.ignore):
            return None
        matched = match_targets(name, module, list(self.target_to_scheme))
        return self.target_to_scheme[matched[0]] if matched else None

    def format_of(self, scheme: Any) -> str | None:
        return scheme.format or self.config.format

    def resolve(self, layer: str, shard_names: Sequence[str],
                module: torch.nn.Module) -> SchemeChoice | None:
        """The one scheme serving ``layer`` (whose checkpoint names are ``shard_names``),
        None when unquantized; refuses shards that disagree."""
        found: list[tuple[str, SchemeChoice | None]] = []
        for shard in shard_names:
            scheme = self.scheme_for(shard, module)
            choice = None if scheme is None else classify(scheme, self.format_of(scheme),
                                                          shard)
            found.append((shard, choice))
        return same_choice(layer, found)


def same_choice(layer: str, found: list[tuple[str, SchemeChoice | None]]
                ) -> SchemeChoice | None:
    """The shared choice of a fused layer's shards, or QuantConfigError if they differ."""
    choices = {choice for _, choice in found}
    if len(choices) > 1:
        listing = "; ".join(f"{shard}: {'unquantized' if c is None else c.describe()}"
                            for shard, c in found)
        raise QuantConfigError(
            f"layer {layer!r} fuses shards quantized differently ({listing}); vLLM runs "
            "them as one matrix, so all shards must use one scheme. Re-quantize these "
            "modules with the same scheme.")
    return next(iter(choices)) if choices else None
