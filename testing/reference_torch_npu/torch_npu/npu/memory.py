"""Memory accounting of the reference ``torch.npu``.

Follows torch_npu's Memory management API (Ascend/op-plugin
``docs/context/Memory-management-API.md``), which documents these functions as torch.cuda's.

Tensors on the reference's npu device hold host memory from the extension's allocator
(``csrc/reference_device.cpp``), which accounts each allocation against its NPU as a caching
allocator would: ``allocated`` is the bytes held by live npu tensors (exact sizes, no
rounding); freed bytes stay ``reserved`` (cached) until ``empty_cache()``; an allocation
that would take ``reserved`` past ``TORCH_NPU_REFERENCE_TOTAL_MEMORY`` raises
``torch.OutOfMemoryError`` ("NPU out of memory"); ``mem_get_info`` reports
``total - reserved`` as free. Tests may add modelled bytes on top with
``torch_npu._reference.simulate_allocation`` / ``simulate_free``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_npu import _config, _device_ext
from torch_npu.npu._device import _index, device_count


@dataclass
class _DeviceMemory:
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0


def _ext():
    return _device_ext.load()


def _stats(device) -> _DeviceMemory:
    return _DeviceMemory(*_ext().memory_stats(_index(device)))


def _allocate(nbytes: int, device=None) -> None:
    if nbytes < 0:
        raise ValueError(f"Cannot allocate a negative number of bytes ({nbytes}).")
    _ext().simulate_allocation(_index(device), nbytes)


def _free(nbytes: int, device=None) -> None:
    _ext().simulate_free(_index(device), nbytes)


def _reset() -> None:
    _ext().reset_accounting()


def mem_get_info(device=None) -> tuple[int, int]:
    """``(free, total)`` bytes of an NPU (``torch_npu.npu.mem_get_info``)."""
    stats = _stats(device)
    total = _config.total_memory()
    return total - stats.reserved, total


def memory_allocated(device=None) -> int:
    """Bytes held by tensors (``torch_npu.npu.memory_allocated``)."""
    return _stats(device).allocated


def max_memory_allocated(device=None) -> int:
    """Peak of ``memory_allocated`` since the last reset.

    ``torch_npu.npu.max_memory_allocated``.
    """
    return _stats(device).peak_allocated


def memory_reserved(device=None) -> int:
    """Bytes held by the caching allocator (``torch_npu.npu.memory_reserved``)."""
    return _stats(device).reserved


def max_memory_reserved(device=None) -> int:
    """Peak of ``memory_reserved`` since the last reset (``torch_npu.npu.max_memory_reserved``)."""
    return _stats(device).peak_reserved


def reset_peak_memory_stats(device=None) -> None:
    """Restart both peaks from the current values (``torch_npu.npu.reset_peak_memory_stats``)."""
    _ext().reset_peaks(_index(device), True)


def reset_max_memory_allocated(device=None) -> None:
    """Restart the allocated peak (``torch_npu.npu.reset_max_memory_allocated``)."""
    _ext().reset_peaks(_index(device), False)


def empty_cache() -> None:
    """Give cached, unallocated memory back to the device (``torch_npu.npu.empty_cache``).

    Applies to every visible NPU, as the caching allocator does.
    """
    device_count()  # validates the modelled machine, as the other calls do
    _ext().empty_cache()
