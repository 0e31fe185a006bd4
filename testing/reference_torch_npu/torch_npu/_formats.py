"""Storage formats of npu tensors: ``npu_format_cast``, ``get_npu_format``, ``Format``.

Follows Ascend's torch_npu documentation, ``(beta) torch_npu.npu_format_cast``
(``npu_format_cast(input, acl_format, customize_dtype=None) -> Tensor``: a new tensor in the
target format, the input keeps its own) and ``torch_npu.get_npu_format``.

On an NPU the format belongs to the storage (torch_npu's storage descriptor): views and a
``Parameter`` whose ``.data`` was replaced by a cast tensor report the cast's format. The
reference keeps the values in the logical (ND) layout -- every op computes on them as
before -- and records the format of each storage that was cast, forgotten when the storage
is freed. A tensor never cast has torch_npu's base format for its rank: NCHW (0) for 4
dimensions, NCDHW (30) for 5, ND (2) otherwise (the documentation's example reads 0 for a
``torch.rand(2, 3, 4, 5).npu()``).

Modelled targets: ND and FRACTAL_NZ (and a tensor's own base format). FRACTAL_NZ needs two
dimensions or more. ``customize_dtype`` (which sets NZ's C0 on CANN 9.1 and later) and the
other formats raise NotImplementedError.

Which ops take FRACTAL_NZ: each wrapped torch_npu function names the arguments that may be
FRACTAL_NZ (``_on_device.on_device(..., nz=...)``, from the op's documentation or, where
that lags, the real binding); any other argument in FRACTAL_NZ raises the ``RuntimeError``
a real op raises for a format it does not take. torch's own ops on npu tensors take NZ
tensors as torch_npu's format-aware kernels do.
"""

from __future__ import annotations

import enum

import torch
from torch.utils.weak import WeakIdKeyDictionary

DEVICE_TYPE = "npu"


class Format(enum.IntEnum):
    """``torch_npu.Format``: the ACL data formats, by the integers torch_npu uses."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47


# untyped storage (torch keeps one Python object per live storage) -> its format
_recorded: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _base_format(tensor: torch.Tensor) -> Format:
    return {4: Format.NCHW, 5: Format.NCDHW}.get(tensor.dim(), Format.ND)


def _require_npu(name: str, tensor) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name}(): argument 'input' must be Tensor, not {type(tensor).__name__}")
    if tensor.device.type != DEVICE_TYPE:
        raise RuntimeError(f"{name} takes an npu tensor; got one on {tensor.device}")


def get_npu_format(tensor: torch.Tensor) -> int:
    """``torch_npu.get_npu_format(tensor) -> int``: the format of the tensor's storage."""
    _require_npu("get_npu_format", tensor)
    return int(_recorded.get(tensor.untyped_storage(), _base_format(tensor)))


def format_of(tensor: torch.Tensor) -> Format:
    """The recorded format of an npu tensor's storage, or its base format (no check)."""
    return Format(_recorded.get(tensor.untyped_storage(), _base_format(tensor)))


def any_recorded() -> bool:
    """Whether any live storage was cast (lets the op wrappers skip the format check)."""
    return len(_recorded) > 0


def npu_format_cast(input, acl_format, customize_dtype=None):
    """``torch_npu.npu_format_cast(input, acl_format, customize_dtype=None) -> Tensor``."""
    _require_npu("npu_format_cast", input)
    try:
        target = Format(int(acl_format))
    except (TypeError, ValueError):
        raise RuntimeError(f"npu_format_cast: acl_format {acl_format!r} is not a torch_npu "
                           f"format; use one of {', '.join(f'{f.name}={f.value}' for f in Format)}"
                           ) from None
    if customize_dtype is not None:
        raise NotImplementedError("npu_format_cast: customize_dtype (NZ's C0 on CANN 9.1+) is "
                                  "not modelled by the reference torch_npu")
    if target not in (Format.ND, Format.FRACTAL_NZ, _base_format(input)):
        raise NotImplementedError(f"npu_format_cast to {target.name} is not modelled by the "
                                  "reference torch_npu (ND and FRACTAL_NZ are)")
    if target == Format.FRACTAL_NZ and input.dim() < 2:
        raise RuntimeError(f"npu_format_cast: FRACTAL_NZ needs a tensor of 2 dimensions or "
                           f"more, got shape {tuple(input.shape)}")
    if format_of(input) == target:
        return input
    result = input.clone(memory_format=torch.contiguous_format)
    _recorded[result.untyped_storage()] = target
    return result


def check_formats(name: str, arguments, nz_arguments: frozenset[str]) -> None:
    """Raise as a real op does when an argument not in ``nz_arguments`` is FRACTAL_NZ.

    ``arguments``: (argument name, value) pairs; a value may be a tensor or a list of them.
    """
    for argument, value in arguments:
        tensors = value if isinstance(value, (list, tuple)) else (value,)
        for tensor in tensors:
            if (isinstance(tensor, torch.Tensor) and tensor.device.type == DEVICE_TYPE
                    and format_of(tensor) == Format.FRACTAL_NZ
                    and argument not in nz_arguments):
                takes = (f"only {', '.join(sorted(nz_arguments))} may be FRACTAL_NZ"
                         if nz_arguments else "every argument must be ND")
                raise RuntimeError(f"torch_npu.{name}: argument '{argument}' is FRACTAL_NZ, "
                                   f"which this op does not take there ({takes})")
