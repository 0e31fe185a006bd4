"""Static expert maps: placements stored as JSON (``eplb_config.expert_map_path`` and
``expert_map_record_path``).

The layout is the one vllm-ascend reads and writes, so existing map files load as
they are; two optional keys carry what that layout leaves implicit::

    {
      "moe_layer_count": 2,                 # number of MoE layers (int >= 0)
      "num_experts": 8,                     # optional: logical experts per layer
      "layer_list": [                       # one entry per layer, in layer order
        {
          "layer_id": 0,                    # optional; if present, its index
          "device_count": 4,                # optional; if present, len(device_list)
          "device_list": [                  # one entry per rank, in rank order
            {"device_id": 0,                # optional; if present, its index
             "device_expert": [0, 5]},      # logical expert of each slot of the rank
            ...
          ]
        },
        ...
      ],
      "metadata": {"policy": "flashlb"}     # optional, free-form, kept as read
    }

Every layer has the same number of ranks and every rank the same number of slots;
expert ids are integers in ``[0, num_experts)`` (``num_experts`` defaults to the
largest id + 1) and every expert has at least one slot in every layer. Rank ``g`` of a
layer holds physical slots ``g * k ... g * k + k - 1`` of that layer's ``phy2log``.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ascend_eplb.placement import check_phy2log, log2phy_from_phy2log, logcnt_from_phy2log
from ascend_eplb.validation import positive_int

__all__ = [
    "ExpertMap",
    "ExpertMapError",
    "expert_map_from_dict",
    "expert_map_to_dict",
    "load_expert_map",
    "save_expert_map",
]


class ExpertMapError(ValueError):
    """A malformed expert map file or object; the message says where and what."""


@dataclass(frozen=True)
class ExpertMap:
    phy2log: torch.Tensor  # [layers, num_replicas] int64
    num_gpus: int
    num_experts: int
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return int(self.phy2log.size(0))

    @property
    def num_replicas(self) -> int:
        return int(self.phy2log.size(1))

    @property
    def slots_per_gpu(self) -> int:
        return self.num_replicas // self.num_gpus

    @property
    def logcnt(self) -> torch.Tensor:
        return logcnt_from_phy2log(self.phy2log, self.num_experts)

    @property
    def log2phy(self) -> torch.Tensor:
        return log2phy_from_phy2log(self.phy2log, self.num_experts)[0]


def load_expert_map(path: str | os.PathLike[str]) -> ExpertMap:
    """Read and check an expert map JSON file (schema in this module's docstring)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ExpertMapError(f"{path}: not a UTF-8 text file ({err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise ExpertMapError(
            f"{path}: not valid JSON: {err.msg} at line {err.lineno}, column {err.colno}"
        ) from None
    return expert_map_from_dict(data, source=str(path))


def save_expert_map(
    path: str | os.PathLike[str],
    phy2log: torch.Tensor | Any,
    num_gpus: int,
    *,
    num_experts: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> ExpertMap:
    """Check ``phy2log`` and write it as an expert map; returns what was written.

    The file is replaced atomically (written beside it, then renamed), so a reader
    never sees half a map.
    """
    expert_map = _checked_map(phy2log, num_gpus, num_experts, metadata)
    data = expert_map_to_dict(expert_map)
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(data, out, indent=1)
            out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return expert_map


def expert_map_to_dict(expert_map: ExpertMap) -> dict[str, Any]:
    k = expert_map.slots_per_gpu
    layers = []
    for layer_id, row in enumerate(expert_map.phy2log.tolist()):
        devices = [
            {"device_id": g, "device_expert": row[g * k : (g + 1) * k]}
            for g in range(expert_map.num_gpus)
        ]
        layers.append(
            {"layer_id": layer_id, "device_count": expert_map.num_gpus, "device_list": devices}
        )
    data: dict[str, Any] = {
        "moe_layer_count": expert_map.num_layers,
        "num_experts": expert_map.num_experts,
        "layer_list": layers,
    }
    if expert_map.metadata:
        data["metadata"] = expert_map.metadata
    return data


def expert_map_from_dict(data: Any, *, source: str = "expert map") -> ExpertMap:
    """Check a parsed expert map (schema in this module's docstring)."""

    def fail(where: str, message: str) -> ExpertMapError:
        return ExpertMapError(f"{source}: {where}: {message}")

    if not isinstance(data, dict):
        raise fail("top level", f"must be a JSON object, got {_kind(data)}")
    for key in ("moe_layer_count", "layer_list"):
        if key not in data:
            raise fail("top level", f"missing required key {key!r}")
    layer_count = data["moe_layer_count"]
    if not _is_int(layer_count) or layer_count < 0:
        raise fail("moe_layer_count", f"must be an integer >= 0, got {layer_count!r}")
    layers = data["layer_list"]
    if not isinstance(layers, list):
        raise fail("layer_list", f"must be a list, got {_kind(layers)}")
    if len(layers) != layer_count:
        raise fail("layer_list", f"has {len(layers)} layers but moe_layer_count is {layer_count}")
    num_experts = data.get("num_experts")
    if num_experts is not None and (not _is_int(num_experts) or num_experts < 1):
        raise fail("num_experts", f"must be an integer >= 1, got {num_experts!r}")
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict):
        raise fail("metadata", f"must be a JSON object, got {_kind(metadata)}")

    rows: list[list[int]] = []
    shape: tuple[int, int] | None = None  # (ranks, slots per rank) of the first layer
    for layer_index, layer in enumerate(layers):
        where = f"layer_list[{layer_index}]"
        if not isinstance(layer, dict):
            raise fail(where, f"must be a JSON object, got {_kind(layer)}")
        if "device_list" not in layer:
            raise fail(where, "missing required key 'device_list'")
        if "layer_id" in layer and layer["layer_id"] != layer_index:
            raise fail(f"{where}.layer_id", f"is {layer['layer_id']!r}, expected {layer_index}")
        devices = layer["device_list"]
        if not isinstance(devices, list) or not devices:
            raise fail(f"{where}.device_list", f"must be a non-empty list, got {_kind(devices)}")
        if "device_count" in layer and layer["device_count"] != len(devices):
            raise fail(
                f"{where}.device_count",
                f"is {layer['device_count']!r} but device_list has {len(devices)} entries",
            )
        row: list[int] = []
        for device_index, device in enumerate(devices):
            at = f"{where}.device_list[{device_index}]"
            if not isinstance(device, dict):
                raise fail(at, f"must be a JSON object, got {_kind(device)}")
            if "device_expert" not in device:
                raise fail(at, "missing required key 'device_expert'")
            if "device_id" in device and device["device_id"] != device_index:
                raise fail(
                    f"{at}.device_id", f"is {device['device_id']!r}, expected {device_index}"
                )
            experts = device["device_expert"]
            if not isinstance(experts, list) or not experts:
                raise fail(f"{at}.device_expert", f"must be a non-empty list, got {_kind(experts)}")
            for slot, expert in enumerate(experts):
                if not _is_int(expert) or expert < 0:
                    raise fail(
                        f"{at}.device_expert[{slot}]",
                        f"must be an expert id (integer >= 0), got {expert!r}",
                    )
                if num_experts is not None and expert >= num_experts:
                    raise fail(
                        f"{at}.device_expert[{slot}]",
                        f"expert id {expert} is out of range [0, {num_experts})",
                    )
            this_shape = (len(devices), len(experts))
            if shape is None:
                shape = this_shape
            elif len(devices) != shape[0]:
                raise fail(
                    f"{where}.device_list",
                    f"has {len(devices)} ranks but layer_list[0] has {shape[0]}",
                )
            elif len(experts) != shape[1]:
                raise fail(
                    f"{at}.device_expert",
                    f"has {len(experts)} slots but every rank must have {shape[1]} "
                    "(those of layer_list[0].device_list[0])",
                )
            row.extend(experts)
        rows.append(row)

    if shape is None:  # no layers at all
        num_gpus = positive_int("device_count", data.get("device_count", 1))
        return ExpertMap(
            torch.zeros(0, 0, dtype=torch.int64), num_gpus, num_experts or 1, dict(metadata)
        )
    phy2log = torch.tensor(rows, dtype=torch.int64)
    if num_experts is None:
        num_experts = int(phy2log.max()) + 1
    try:
        return _checked_map(phy2log, shape[0], num_experts, metadata)
    except ValueError as err:
        raise fail("layer_list", str(err)) from None


def _checked_map(
    phy2log: Any, num_gpus: int, num_experts: int | None, metadata: dict[str, Any] | None
) -> ExpertMap:
    num_gpus = positive_int("num_gpus", num_gpus)
    if num_experts is None:
        values = torch.as_tensor(phy2log)
        num_experts = int(values.max()) + 1 if values.numel() else 1
    num_experts = positive_int("num_experts", num_experts)
    phy2log = check_phy2log(phy2log, num_experts, num_gpus)
    if metadata is not None:
        if not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict, got {type(metadata).__name__}")
        json.dumps(metadata)  # fail now, not halfway through writing the file
    return ExpertMap(phy2log, num_gpus, num_experts, dict(metadata or {}))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), f"{type(value).__name__} {value!r}")
