"""An adapter's shapes against the served model, before vLLM loads it.

vLLM refuses an adapter whose rank is above ``max_lora_rank`` or whose modules the model
lacks, with messages that say so; an adapter of another base model (other hidden or
intermediate sizes) gets only torch's "The size of tensor a (128) must match the size of
tensor b (256)" from deep inside the copy into the stacked weights. This check reads the
tensor shapes from the adapter's safetensors header (nothing is loaded) and names the first
layer that does not fit, with both shapes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open

WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


class AdapterMismatch(ValueError):
    """A LoRA adapter whose layer shapes do not fit the served model."""


def adapter_shapes(folder: str | os.PathLike) -> dict[str, dict[str, list[int]]]:
    """``{module path: {"lora_A": shape, "lora_B": shape}}`` from a peft-format folder;
    empty when it holds no safetensors weights (vLLM then reports what it finds)."""
    path = Path(folder) / WEIGHTS_FILE
    if not path.is_file():
        return {}
    shapes: dict[str, dict[str, list[int]]] = {}
    with safe_open(str(path), framework="pt") as weights:
        for key in weights.keys():  # noqa: SIM118 - safe_open is not a mapping
            for part in ("lora_A", "lora_B"):
                marker = f".{part}."
                if marker in key:
                    module = key.split(marker)[0].removeprefix(PEFT_PREFIX)
                    shapes.setdefault(module, {})[part] = weights.get_slice(key).get_shape()
    return shapes


def _model_linear(model: torch.nn.Module, modules: dict, path: str) -> tuple[int, int] | None:
    """(inputs, outputs) of the model's linear layer that ``path`` (a peft module path)
    lands in, through the model's packed modules (q/k/v in qkv_proj, ...); None for a
    layer this check does not know (vLLM checks the names)."""
    parent, _, name = path.rpartition(".")
    index = None
    for packed, parts in getattr(model, "packed_modules_mapping", {}).items():
        if name in parts:
            index, name = parts.index(name), packed
            break
    layer = modules.get(f"{parent}.{name}" if parent else name)
    layer = getattr(layer, "base_layer", layer)
    if layer is None or not hasattr(layer, "input_size"):
        return None
    sizes = getattr(layer, "output_sizes", None)
    outputs = sizes[index] if index is not None and sizes else layer.output_size
    return layer.input_size, outputs


def check_adapter_fits(model: torch.nn.Module, folder: str | os.PathLike) -> None:
    """Raise AdapterMismatch, in one line, for the first adapted layer whose lora_A inputs
    or lora_B outputs differ from the model's layer."""
    modules = dict(model.named_modules())
    for path, parts in adapter_shapes(folder).items():
        expected = _model_linear(model, modules, path)
        if expected is None or set(parts) != {"lora_A", "lora_B"}:
            continue
        inputs, outputs = expected
        lora_a, lora_b = parts["lora_A"], parts["lora_B"]
        if lora_a[-1] != inputs or lora_b[0] != outputs:
            raise AdapterMismatch(
                f"LoRA adapter {folder} does not fit this model: {path} takes {inputs} "
                f"inputs and gives {outputs} outputs here, but the adapter's lora_A is "
                f"{list(lora_a)} and lora_B {list(lora_b)} (expected [rank, {inputs}] and "
                f"[{outputs}, rank]); it was made for another base model")


class CheckedLoRARunnerMixin:
    """Mixed into the model runners, before vLLM's runner: every adapter's shapes are
    checked once (per id and path) before vLLM loads it, whether it comes through
    ``add_lora`` (``--lora-modules``, ``/v1/load_lora_adapter``) or with a request."""

    def add_lora(self, lora_request) -> bool:
        self._check_adapter(lora_request)
        return super().add_lora(lora_request)

    def _set_active_loras(self, prompt_lora_mapping, token_lora_mapping, lora_requests,
                          *args, **kwargs) -> None:
        for request in lora_requests:
            self._check_adapter(request)
        return super()._set_active_loras(prompt_lora_mapping, token_lora_mapping,
                                         lora_requests, *args, **kwargs)

    def _check_adapter(self, lora_request) -> None:
        checked = self.__dict__.setdefault("_checked_adapters", set())
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key in checked:
            return
        # Warm-up adapters have no folder; a missing one is vLLM's to report.
        folder = getattr(lora_request, "lora_path", None)
        if folder and os.path.isdir(folder):
            check_adapter_fits(self.get_model(), folder)
        checked.add(key)
