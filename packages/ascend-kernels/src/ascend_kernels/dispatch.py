"""Backend selection shared by every op, and the input checks every op repeats.

Backends:

- ``reference``: plain torch, the specification; runs on any device.
- ``triton``: a Triton kernel. Usable when ``triton`` imports and the tensor is on
  ``cuda`` (upstream Triton), on ``npu`` (triton-ascend) or on the CPU with
  ``TRITON_INTERPRET=1`` (Triton's interpreter, how CI runs the kernels). The variable
  is read by Triton when a kernel module is first imported, so set it before the first
  Triton op of the process.
- ``npu``: a fused torch_npu op; needs torch_npu to import.

``backend=None`` picks, per call: npu tensors take the npu backend when the op has one
and torch_npu accepts these inputs, else Triton (triton-ascend), else the reference;
cuda tensors take Triton when the op has it; CPU tensors take the reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Mapping
from functools import lru_cache

import torch

REFERENCE = "reference"
TRITON = "triton"
NPU = "npu"
BACKENDS = (REFERENCE, TRITON, NPU)

INTERPRET_VAR = "TRITON_INTERPRET"


class BackendUnavailable(RuntimeError):
    """A backend was forced that this op, these inputs or this machine do not have."""


@lru_cache(maxsize=1)
def torch_npu_module():
    """torch_npu if it imports, else None (it needs CANN to import)."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        return importlib.import_module("torch_npu")
    except Exception:  # ImportError, or OSError for a missing libhccl.so
        return None


@lru_cache(maxsize=1)
def triton_module():
    """triton if it imports, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    try:
        return importlib.import_module("triton")
    except Exception:  # a broken install must not break the reference path
        return None


def triton_interpreter_enabled() -> bool:
    return os.environ.get(INTERPRET_VAR, "0").strip().lower() in ("1", "true", "on", "yes")


@lru_cache(maxsize=1)
def _triton_driver_problem() -> str | None:
    """Why Triton has no device to launch on (None when a driver is active). Upstream Triton
    beside torch_npu without triton-ascend imports but has no driver for npu tensors."""
    try:
        triton_module().runtime.driver.active.get_current_target()
    except Exception as error:
        return (f"Triton has no active device driver ({error}); npu tensors need "
                "triton-ascend")
    return None


def triton_unusable_reason(tensor: torch.Tensor) -> str | None:
    """Why Triton cannot run on ``tensor``'s device here, or None when it can."""
    if triton_module() is None:
        return "triton is not installed (or does not import)"
    device = tensor.device.type
    if device == "cuda":
        return None
    if device == NPU:
        return _triton_driver_problem()
    if device == "cpu":
        if triton_interpreter_enabled():
            return None
        return (f"CPU tensors need Triton's interpreter: set {INTERPRET_VAR}=1 before the "
                "first Triton op of the process")
    return f"Triton has no backend for {device} tensors"


def resolve_backend(op: str, tensor: torch.Tensor, implemented: tuple[str, ...],
                    requested: str | None = None,
                    unsupported: Mapping[str, str | None] | None = None) -> str:
    """Pick the backend for ``op`` on ``tensor``'s device.

    ``implemented`` lists the backends the op has. ``unsupported`` maps a backend to the
    reason it cannot take these particular inputs (a dtype torch_npu rejects, a size
    beyond a kernel's block); such a backend is skipped by the automatic choice and
    refused, with the reason, when forced. A forced ``requested`` backend must be
    implemented and usable here.
    """
    reasons = dict(unsupported or {})
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
        if requested == TRITON:
            why = triton_unusable_reason(tensor)
            if why is not None:
                raise BackendUnavailable(f"{op}: backend 'triton' is unavailable: {why}")
        if reasons.get(requested):
            raise BackendUnavailable(
                f"{op}: backend {requested!r} cannot take these inputs: {reasons[requested]}"
            )
        return requested

    device = tensor.device.type
    if device == NPU:
        if NPU in implemented and not reasons.get(NPU) and torch_npu_module() is not None:
            return NPU
        if _triton_fits(tensor, implemented, reasons):
            return TRITON
        return REFERENCE
    if device == "cuda" and _triton_fits(tensor, implemented, reasons):
        return TRITON
    return REFERENCE


def _triton_fits(tensor: torch.Tensor, implemented: tuple[str, ...],
                 reasons: Mapping[str, str | None]) -> bool:
    return (TRITON in implemented and not reasons.get(TRITON)
            and triton_unusable_reason(tensor) is None)


# --- input checks shared by the ops -------------------------------------------------------

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def require_float(op: str, name: str, tensor: torch.Tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} has dtype {tensor.dtype}; use float32, bfloat16 or float16"
        )


def require_dtype(op: str, name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != dtype:
        raise TypeError(f"{op}: {name} has dtype {tensor.dtype}; it must be {dtype}")


def require_same_device(op: str, **tensors: torch.Tensor | None) -> None:
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        where = ", ".join(f"{name} on {t.device}" for name, t in present.items())
        raise ValueError(f"{op}: tensors must share one device; got {where}")


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last dim]`` with a unit stride along the last dim (copying only
    when it must), which is the layout every row kernel reads."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.shape[-1] > 1 and rows.stride(-1) != 1:
        rows = rows.contiguous()
    return rows
