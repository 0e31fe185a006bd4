"""msModelSlim checkpoints: ``quant_model_description.json``.

The description maps every tensor of the checkpoint to a type string (``W8A8``,
``W8A8_DYNAMIC``, ``W8A16``, ``W4A8_DYNAMIC``, ``W4A4_DYNAMIC``, ``FLOAT``...), with
a few metadata keys (``model_quant_type``, ``version``, ``group_size``, KV-cache
settings). A layer's type is the type of its ``<name>.weight`` entry; the tensors each
type stores are the ones its scheme declares (``checkpoint_params``), which is what
:func:`check_against_checkpoint` holds the safetensors files to before anything loads.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ascend_quant.errors import QuantConfigError
from ascend_quant.formats.compressed_tensors import SchemeChoice, same_choice
from ascend_quant.lookup import scheme_class
from ascend_quant.schemes.base import MODELSLIM, Kind, SchemeOptions

DESCRIPTION_FILE = "quant_model_description.json"
FLOAT = "FLOAT"
# Types whose weights take the description's group_size.
GROUPED_TYPES = ("W4A8_DYNAMIC", "W4A16")
# Metadata that turns on features this plugin does not serve (value: what it is).
UNSERVED_FEATURES = {
    "kv_cache_type": "KV-cache quantization",
    "fa_quant_type": "attention (FA) quantization",
    "indexer_quant_type": "indexer quantization",
}
_EXPERT = re.compile(r"\.(\d+)\.([A-Za-z0-9_]+)\.weight$")

SAFETENSORS_DTYPES = {
    "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32,
    "I64": torch.int64, "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
    "F64": torch.float64, "BOOL": torch.bool,
}


class ModelSlimDescription:
    """A parsed ``quant_model_description.json`` (see the module docstring)."""

    def __init__(self, raw: Mapping[str, Any], source: str = DESCRIPTION_FILE) -> None:
        self.source = source
        self.entries: dict[str, str] = {}
        self.metadata: dict[str, Any] = {}
        for key, value in raw.items():
            if "." in key:
                if not isinstance(value, str):
                    raise QuantConfigError(f"{source}: entry {key!r} has {value!r}; tensor "
                                           "entries are type strings such as 'W8A8'")
                self.entries[key] = value
            else:
                self.metadata[key] = value
        if not self.entries:
            raise QuantConfigError(f"{source} describes no tensors")
        for key, feature in UNSERVED_FEATURES.items():
            if self.metadata.get(key):
                raise QuantConfigError(
                    f"{source}: {key}={self.metadata[key]!r} ({feature}) is not supported by "
                    "the ascend plugin yet; export the checkpoint without it")
        group_size = self.metadata.get("group_size", 0) or 0
        if not isinstance(group_size, int) or group_size < 0:
            raise QuantConfigError(f"{source}: group_size must be a non-negative int, got "
                                   f"{group_size!r}")
        self.group_size = group_size or None

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> ModelSlimDescription:
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except json.JSONDecodeError as err:
            raise QuantConfigError(f"{path} is not valid JSON: {err}") from None
        if not isinstance(raw, dict):
            raise QuantConfigError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return cls(raw, str(path))

    def rename(self, rename) -> None:
        """Apply ``rename(name) -> name | None`` to the tensor entries."""
        self.entries = {new: t for name, t in self.entries.items()
                        if (new := rename(name)) is not None}

    def options(self, type_name: str) -> SchemeOptions:
        grouped = type_name in GROUPED_TYPES and self.group_size is not None
        return SchemeOptions(layout=MODELSLIM, group_size=self.group_size if grouped else None)

    def choice_for(self, module: str) -> SchemeChoice | None:
        key = f"{module}.weight"
        type_name = self.entries.get(key)
        if type_name is None:
            raise QuantConfigError(
                f"layer {module!r}: {self.source} has no entry for {key!r}; the description "
                "does not match the model (wrong file, or a model with other module names)")
        if type_name == FLOAT:
            return None
        return SchemeChoice(type_name, self.options(type_name))

    def resolve(self, layer: str, shard_names: Sequence[str]) -> SchemeChoice | None:
        return same_choice(layer, [(s, self.choice_for(s)) for s in shard_names])

    def expert_modules(self, layer: str) -> list[str]:
        """Every ``<layer>.<expert>.<proj>`` module the description lists."""
        prefix = f"{layer}."
        found = []
        for key in self.entries:
            if key.startswith(prefix) and _EXPERT.fullmatch("." + key[len(prefix):]):
                found.append(key.removesuffix(".weight"))
        return sorted(found)

    def resolve_experts(self, layer: str) -> SchemeChoice | None:
        modules = self.expert_modules(layer)
        if not modules:
            raise QuantConfigError(f"layer {layer!r}: {self.source} lists no expert weights "
                                   f"under {layer!r}")
        return same_choice(layer, [(m, self.choice_for(m)) for m in modules])


def read_checkpoint_headers(model_dir: str | os.PathLike
                            ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every tensor in the folder's safetensors files, read
    from the headers only."""
    from safetensors import safe_open

    headers = {}
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise QuantConfigError(f"{model_dir} holds no .safetensors files")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                piece = f.get_slice(name)
                dtype = SAFETENSORS_DTYPES.get(piece.get_dtype())
                headers[name] = (tuple(piece.get_shape()), dtype)
    return headers


def _listing(items: Iterable[str], limit: int = 6) -> str:
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


def check_against_checkpoint(description: ModelSlimDescription,
                             headers: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
                             ) -> None:
    """Refuse a description that does not match the checkpoint's tensors: names on one
    side only, quantized weights stored as floats (or the reverse), and tensors missing
    or shaped differently from what the weight's type stores."""
    problems = []
    entries = description.entries
    missing = set(entries) - set(headers)
    if missing:
        problems.append(f"described but not in the checkpoint: {_listing(missing)}")
    undescribed = set(headers) - set(entries)
    if undescribed:
        problems.append(f"in the checkpoint but not described: {_listing(undescribed)}")
    for name, type_name in sorted(entries.items()):
        if not name.endswith(".weight") or name not in headers:
            continue
        shape, dtype = headers[name]
        module = name.removesuffix(".weight")
        if type_name == FLOAT:
            if dtype is not None and not dtype.is_floating_point:
                problems.append(f"{name} is described FLOAT but stored as {dtype}")
            continue
        if len(shape) != 2:
            problems.append(f"{name} is described {type_name} but has shape {shape}")
            continue
        is_expert = bool(_EXPERT.search(name)) and ".experts." in name
        cls = scheme_class(type_name, MODELSLIM, module, moe=is_expert)
        scheme = cls(description.options(type_name), module)
        for spec in scheme.checkpoint_params(*shape):
            tensor = f"{module}.{spec.name}"
            if tensor not in headers:
                if spec.required:
                    problems.append(f"{tensor} is missing; {type_name} stores it")
                continue
            got_shape, got_dtype = headers[tensor]
            want = spec.shape
            shape_ok = (got_shape in ((), (1,))) if spec.kind == Kind.PER_SHARD \
                else got_shape == want
            if not shape_ok:
                problems.append(f"{tensor} has shape {got_shape}; {type_name} stores {want}")
            floats_ok = spec.dtype.is_floating_point and got_dtype is not None \
                and got_dtype.is_floating_point
            if not (spec.accepts(got_dtype) or floats_ok):
                problems.append(f"{tensor} is stored as {got_dtype}; {type_name} stores "
                                f"{' or '.join(str(d) for d in spec.dtypes)}")
            if entries.get(tensor, type_name) != type_name:
                problems.append(f"{tensor} is described {entries[tensor]} but its weight "
                                f"{name} is {type_name}")
    if problems:
        raise QuantConfigError(
            f"{description.source} does not match the checkpoint's weights:\n  - "
            + "\n  - ".join(problems[:12])
            + (f"\n  ... {len(problems) - 12} more" if len(problems) > 12 else ""))
