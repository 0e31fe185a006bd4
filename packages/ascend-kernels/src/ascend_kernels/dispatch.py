"""Backend selection shared by every op."""

from __future__ import annotations

import importlib
import importlib.util
from functools import lru_cache

import torch

REFERENCE = "reference"
TRITON = "triton"
NPU = "npu"
BACKENDS = (REFERENCE, TRITON, NPU)


class BackendUnavailable(RuntimeError):
    """A backend was forced that this op or this machine does not have."""


@lru_cache(maxsize=1)
def torch_npu_module():
    """torch_npu if it imports, else None (it needs CANN to import)."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # ImportError, or OSError for a missing libhccl.so
        return None


def resolve_backend(op: str, tensor: torch.Tensor, implemented: tuple[str, ...],
                    requested: str | None = None) -> str:
    """Pick the backend for ``op`` on ``tensor``'s device.

    ``implemented`` lists the backends the op has. A forced ``requested`` backend
    must be one of them and usable here; ``None`` picks npu for npu tensors and
    the reference otherwise (Triton is opt-in until it is measured to pay).
    """
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"{op}: unknown backend {requested!r}; choose one of {BACKENDS}")
        if requested not in implemented:
            raise BackendUnavailable(
                f"{op} has no {requested!r} backend; it has {implemented}"
            )
        if requested == NPU and torch_npu_module() is None:
            raise BackendUnavailable(
                f"{op}: backend 'npu' needs torch_npu, which does not import here"
            )
        return requested
    if tensor.device.type == NPU and NPU in implemented:
        return NPU
    return REFERENCE
