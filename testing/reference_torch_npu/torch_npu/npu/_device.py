"""Device selection of the reference ``torch.npu``: which NPUs exist and which is current.

Follows torch_npu's NPU Device API (Ascend/op-plugin ``docs/context/NPU-Device.md``), which
documents these functions as torch.cuda's, for ``npu`` devices. The modelled machine comes
from environment variables (see ``torch_npu._config``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torch_npu import _config, _device_ext

DEVICE_TYPE = "npu"


class _State:
    # Like the runtime's current device, the selection is per thread; it lives in the
    # extension's device guard, so torch's own device guards and Python agree on it.
    @property
    def current_device(self) -> int:
        return _device_ext.load().current_device()

    @current_device.setter
    def current_device(self, index: int) -> None:
        _device_ext.load().set_current_device(index)


_state = _State()


def _index(device, *, optional: bool = True) -> int:
    """The visible index ``device`` names; ``None`` (when optional) means the current one."""
    if device is None:
        if not optional:
            raise ValueError("Expected an npu device, got None.")
        return current_device()
    if isinstance(device, bool):
        raise TypeError(f"Expected an npu device (int, str or torch.device), got {device!r}.")
    if isinstance(device, int):
        index = device
    else:
        if isinstance(device, str):
            device = torch.device(device)
        if not isinstance(device, torch.device):
            raise TypeError(
                f"Expected an npu device (int, str or torch.device), got {type(device).__name__}."
            )
        if device.type != DEVICE_TYPE:
            raise ValueError(f"Expected an npu device, got {device}.")
        index = current_device() if device.index is None else device.index
    _check_index(index)
    return index


def _check_index(index: int) -> None:
    count = device_count()
    if not 0 <= index < count:
        raise RuntimeError(
            f"Invalid npu device index {index}: this process sees {count} NPU(s) "
            f"(ASCEND_RT_VISIBLE_DEVICES / {_config.DEVICE_COUNT_VAR})."
        )


def device_count() -> int:
    """Number of NPUs this process sees (``torch_npu.npu.device_count``).

    The modelled machine has ``TORCH_NPU_REFERENCE_DEVICE_COUNT`` NPUs (default 1);
    ``ASCEND_RT_VISIBLE_DEVICES`` narrows them as CANN does.
    """
    return len(_config.visible_physical_ids())


def is_available() -> bool:
    """Whether at least one NPU is visible (``torch_npu.npu.is_available``)."""
    return device_count() > 0


def is_initialized() -> bool:
    """Always true: the reference has no lazy runtime (``torch_npu.npu.is_initialized``)."""
    return True


def init() -> None:
    """Nothing to initialise in the reference (``torch_npu.npu.init``)."""


def current_device() -> int:
    """Index of the selected NPU (``torch_npu.npu.current_device``).

    Raises when no NPU is visible, as the runtime does.
    """
    if device_count() == 0:
        raise RuntimeError(
            "No NPU is visible: ASCEND_RT_VISIBLE_DEVICES is empty or "
            f"{_config.DEVICE_COUNT_VAR}=0."
        )
    return _state.current_device


def set_device(device) -> None:
    """Select the NPU that later calls default to (``torch_npu.npu.set_device``).

    Accepts an index, ``"npu:N"`` or ``torch.device("npu", N)``; an index outside the
    visible NPUs raises ``RuntimeError``.
    """
    _state.current_device = _index(device, optional=False)


class device:
    """Context manager selecting an NPU for its body (``torch_npu.npu.device``)."""

    def __init__(self, device) -> None:
        self.index = _index(device)
        self._previous: int | None = None

    def __enter__(self):
        self._previous = _state.current_device
        _state.current_device = self.index
        return self

    def __exit__(self, *exc) -> None:
        _state.current_device = self._previous


def get_device_name(device=None) -> str:
    """Name of an NPU (``torch_npu.npu.get_device_name``); ``TORCH_NPU_REFERENCE_DEVICE_NAME``."""
    _index(device)
    return _config.device_name()


@dataclass(frozen=True)
class _NPUDeviceProperties:
    name: str
    total_memory: int
    cube_core_num: int
    vector_core_num: int
    L2_cache_size: int


def get_device_properties(device=None) -> _NPUDeviceProperties:
    """Properties of an NPU (``torch_npu.npu.get_device_properties``).

    Carries ``name``, ``total_memory`` (``TORCH_NPU_REFERENCE_TOTAL_MEMORY``),
    ``cube_core_num``, ``vector_core_num`` and ``L2_cache_size`` of an Ascend 910B3.
    """
    _index(device)
    return _NPUDeviceProperties(
        name=_config.device_name(),
        total_memory=_config.total_memory(),
        cube_core_num=_config.CUBE_CORE_NUM,
        vector_core_num=_config.VECTOR_CORE_NUM,
        L2_cache_size=_config.L2_CACHE_SIZE,
    )


def get_device_capability(device=None) -> None:
    """Reserved in torch_npu, which documents it as returning ``None`` (NPU-Device.md)."""
    _index(device)


def is_bf16_supported() -> bool:
    """Whether the current NPU computes in bfloat16 (``torch_npu.npu.is_bf16_supported``).

    False for an Ascend 310P (its aclnn kernels take float16 and float32), true otherwise;
    the chip is the one ``TORCH_NPU_REFERENCE_DEVICE_NAME`` names.
    """
    _index(None)
    return "310P" not in _config.device_name()


def synchronize(device=None) -> None:
    """Wait for the NPU's queued work (``torch_npu.npu.synchronize``).

    The reference runs every op synchronously on the CPU, so there is never work to wait for.
    Not permitted while an NPU graph is capturing.
    """
    _index(device)
    from torch_npu.npu import graphs

    graphs._refuse_sync_while_capturing("torch.npu.synchronize()")

