"""Memory accounting of the reference ``torch.npu``.

Follows torch_npu's Memory management API (Ascend/op-plugin
``docs/context/Memory-management-API.md``), which documents these functions as torch.cuda's.

The reference allocates nothing on an NPU (its tensors live on the CPU), so the numbers are
those of a modelled caching allocator: each NPU has ``TORCH_NPU_REFERENCE_TOTAL_MEMORY``
bytes; tests move ``allocated`` with ``torch_npu._reference.simulate_allocation`` /
``simulate_free``; freed bytes stay ``reserved`` (cached) until ``empty_cache()``;
``mem_get_info`` reports ``total - reserved`` as free.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch_npu import _config
from torch_npu.npu._device import _index, device_count


@dataclass
class _DeviceMemory:
    allocated: int = 0
    reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0


_memory: dict[int, _DeviceMemory] = {}


def _stats(device) -> _DeviceMemory:
    return _memory.setdefault(_index(device), _DeviceMemory())


def _allocate(nbytes: int, device=None) -> None:
    if nbytes < 0:
        raise ValueError(f"Cannot allocate a negative number of bytes ({nbytes}).")
    stats = _stats(device)
    allocated = stats.allocated + nbytes
    reserved = max(stats.reserved, allocated)
    total = _config.total_memory()
    if reserved > total:
        raise RuntimeError(
            f"NPU out of memory. Tried to allocate {nbytes} bytes; {stats.allocated} of "
            f"{total} bytes are allocated and {stats.reserved} reserved."
        )
    stats.allocated = allocated
    stats.reserved = reserved
    stats.peak_allocated = max(stats.peak_allocated, allocated)
    stats.peak_reserved = max(stats.peak_reserved, reserved)


def _free(nbytes: int, device=None) -> None:
    stats = _stats(device)
    if not 0 <= nbytes <= stats.allocated:
        raise ValueError(
            f"Cannot free {nbytes} bytes: {stats.allocated} bytes are allocated on this NPU."
        )
    stats.allocated -= nbytes


def _reset() -> None:
    _memory.clear()


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
    stats = _stats(device)
    stats.peak_allocated = stats.allocated
    stats.peak_reserved = stats.reserved


def reset_max_memory_allocated(device=None) -> None:
    """Restart the allocated peak (``torch_npu.npu.reset_max_memory_allocated``)."""
    stats = _stats(device)
    stats.peak_allocated = stats.allocated


def empty_cache() -> None:
    """Give cached, unallocated memory back to the device (``torch_npu.npu.empty_cache``).

    Applies to every visible NPU, as the caching allocator does.
    """
    for index in range(device_count()):
        stats = _stats(index)
        stats.reserved = stats.allocated
