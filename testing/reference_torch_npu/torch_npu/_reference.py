"""Controls for tests; not part of torch_npu's API.

Tests use these to move the modelled device into the state they need and to leave the
process as they found it.
"""

from __future__ import annotations

from torch_npu import _config, _registration
from torch_npu.npu import _device, memory, random, streams

IS_REFERENCE = True

DEVICE_COUNT_VAR = _config.DEVICE_COUNT_VAR
TOTAL_MEMORY_VAR = _config.TOTAL_MEMORY_VAR
DEVICE_NAME_VAR = _config.DEVICE_NAME_VAR
VISIBLE_DEVICES_VAR = _config.VISIBLE_DEVICES_VAR


def simulate_allocation(nbytes: int, device=None) -> None:
    """Account ``nbytes`` as allocated by tensors on an NPU, as the caching allocator would.

    Reuses cached bytes first, then reserves more; raises ``RuntimeError`` ("NPU out of
    memory") when reserving would exceed the NPU's total memory.
    """
    memory._allocate(nbytes, device)


def simulate_free(nbytes: int, device=None) -> None:
    """Account ``nbytes`` as freed by tensors; they stay reserved until ``empty_cache()``."""
    memory._free(nbytes, device)


def reset_state() -> None:
    """Back to a fresh process: NPU 0 current, no memory used, default streams, no seeds."""
    _device._state.current_device = 0
    memory._reset()
    streams._reset()
    random._reset()


def uninstall() -> None:
    """Unregister the reference from torch and drop the ``torch_npu`` modules.

    ``torch.npu`` stays, inert (no NPU available), because torch cannot undo the rename of
    its PrivateUse1 backend to "npu"; see ``torch_npu._registration``.
    """
    _registration.uninstall()
