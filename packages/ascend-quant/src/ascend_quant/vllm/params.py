"""vLLM parameters for a scheme's checkpoint tensors, and the checks on what loads into them.

Every parameter gets a loader that, before handing the tensor to vLLM's own loader,
checks its shape and dtype against what the scheme says the checkpoint stores for that
shard (full, un-sharded size) and records that it arrived. After loading,
:meth:`LoadLedger.missing` lists required tensors that never came, so a checkpoint
without a scale fails at start-up instead of running on uninitialised memory. (vLLM
itself only checks for unloaded weights when no quantization is configured.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    ModelWeightParameter,
    PackedvLLMParameter,
)

from ascend_quant.errors import QuantConfigError
from ascend_quant.schemes.base import Kind, ParamSpec

QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


def make_parameter(spec: ParamSpec, shape: tuple[int, ...], loader: Callable
                   ) -> BasevLLMParameter:
    """A vLLM parameter of ``shape`` whose class tells vLLM how to shard and stack it."""
    data = torch.zeros(shape, dtype=spec.dtype)
    if spec.kind == Kind.WEIGHT:
        return ModelWeightParameter(data=data, input_dim=1, output_dim=0, weight_loader=loader)
    if spec.kind == Kind.PACKED_WEIGHT:
        return PackedvLLMParameter(data=data, input_dim=1, output_dim=0, packed_dim=1,
                                   packed_factor=spec.packed_factor, weight_loader=loader)
    if spec.kind == Kind.CHANNEL:
        return ChannelQuantScaleParameter(data=data, output_dim=0, weight_loader=loader)
    if spec.kind == Kind.GROUP:
        return GroupQuantScaleParameter(data=data, output_dim=0, input_dim=1,
                                        weight_loader=loader)
    if spec.kind == Kind.PACKED_GROUP:
        return PackedvLLMParameter(data=data, input_dim=1, output_dim=0, packed_dim=0,
                                   packed_factor=spec.packed_factor, weight_loader=loader)
    # PER_SHARD and SHAPE: loaded by the ledger's loader itself.
    return BasevLLMParameter(data=data, weight_loader=loader)


def dtype_ok(spec: ParamSpec, dtype: torch.dtype) -> bool:
    return spec.accepts(dtype) or (spec.dtype.is_floating_point and dtype.is_floating_point)


def describe_dtypes(spec: ParamSpec) -> str:
    return "a float dtype" if spec.dtype.is_floating_point else " or ".join(
        str(d) for d in spec.dtypes)


@dataclass
class LoadLedger:
    """Which checkpoint tensors of one layer arrived, per shard."""

    layer: str
    scheme: str
    shard_names: Sequence[str]
    specs: dict[str, ParamSpec]
    arrived: dict[str, set] = field(default_factory=dict)

    def record(self, name: str, keys) -> None:
        self.arrived.setdefault(name, set()).update(keys)

    def fail(self, message: str) -> QuantConfigError:
        return QuantConfigError(f"layer {self.layer!r} ({self.scheme}): {message}")

    def check(self, spec: ParamSpec, where: str, tensor: torch.Tensor,
              expected: tuple[int, ...]) -> None:
        shape = tuple(tensor.shape)
        if spec.kind == Kind.PER_SHARD:
            ok = tensor.numel() == 1
        else:
            ok = shape == expected
        if not ok:
            raise self.fail(f"checkpoint tensor {where} has shape {shape}; {self.scheme} "
                            f"stores {expected} for it")
        if not dtype_ok(spec, tensor.dtype):
            raise self.fail(f"checkpoint tensor {where} is {tensor.dtype}; {self.scheme} "
                            f"stores it as {describe_dtypes(spec)} (is the checkpoint "
                            "quantized as its config says?)")

    def missing(self, expected_keys: Sequence) -> list[str]:
        """Names (checkpoint spelling) of required tensors that never arrived."""
        lost = []
        for name, spec in self.specs.items():
            if not spec.required:
                continue
            got = self.arrived.get(name, set())
            for key, where in expected_keys:
                if key not in got:
                    lost.append(f"{where}.{name}")
        return lost

    def refuse_missing(self, expected_keys: Sequence) -> None:
        lost = self.missing(expected_keys)
        if lost:
            shown = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8
                                           else "")
            raise self.fail(f"the checkpoint lacks {shown}, which {self.scheme} needs; "
                            "refusing to serve the layer with uninitialised values")
