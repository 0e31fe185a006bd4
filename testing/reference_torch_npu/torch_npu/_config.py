"""The modelled machine, read from environment variables at each call (never cached).

=====================================  ===========================================
variable                               meaning (default)
=====================================  ===========================================
``TORCH_NPU_REFERENCE_DEVICE_COUNT``   physical NPUs in the modelled machine (1)
``ASCEND_RT_VISIBLE_DEVICES``          comma-separated physical ids this process
                                       sees, as with CANN; unset: all of them;
                                       empty: none
``TORCH_NPU_REFERENCE_TOTAL_MEMORY``   bytes of memory per NPU (64 GiB, an
                                       Atlas A2's HBM)
``TORCH_NPU_REFERENCE_DEVICE_NAME``    ``get_device_name()`` ("Ascend910B-reference")
=====================================  ===========================================

A value that does not parse raises ``ValueError`` naming the variable and the value; a
visible id outside the modelled machine raises ``RuntimeError``, as CANN refuses it.
"""

from __future__ import annotations

import os

DEVICE_COUNT_VAR = "TORCH_NPU_REFERENCE_DEVICE_COUNT"
VISIBLE_DEVICES_VAR = "ASCEND_RT_VISIBLE_DEVICES"
TOTAL_MEMORY_VAR = "TORCH_NPU_REFERENCE_TOTAL_MEMORY"
DEVICE_NAME_VAR = "TORCH_NPU_REFERENCE_DEVICE_NAME"

DEFAULT_DEVICE_COUNT = 1
DEFAULT_TOTAL_MEMORY = 64 * 1024**3
DEFAULT_DEVICE_NAME = "Ascend910B-reference"

# Fixed properties of the modelled chip (an Ascend 910B3 has 20 cube and 40 vector cores).
CUBE_CORE_NUM = 20
VECTOR_CORE_NUM = 40
L2_CACHE_SIZE = 192 * 1024**2


def _non_negative_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not an integer; set it to a whole number such as {default}."
        ) from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} is negative; it must be 0 or more.")
    return value


def physical_device_count() -> int:
    """NPUs in the modelled machine (``TORCH_NPU_REFERENCE_DEVICE_COUNT``)."""
    return _non_negative_int(DEVICE_COUNT_VAR, DEFAULT_DEVICE_COUNT)


def visible_physical_ids() -> list[int]:
    """Physical ids this process sees, in visible order."""
    physical = physical_device_count()
    raw = os.environ.get(VISIBLE_DEVICES_VAR)
    if raw is None:
        return list(range(physical))
    if raw.strip() == "":
        return []
    ids = []
    for item in raw.split(","):
        try:
            device_id = int(item)
        except ValueError:
            raise ValueError(
                f"{VISIBLE_DEVICES_VAR}={raw!r} holds {item!r}, which is not a device id; "
                "use comma-separated integers such as '0,1'."
            ) from None
        if not 0 <= device_id < physical:
            raise RuntimeError(
                f"{VISIBLE_DEVICES_VAR}={raw!r} names NPU {device_id}, but the modelled "
                f"machine has {physical} NPU(s) (ids 0..{physical - 1}); raise "
                f"{DEVICE_COUNT_VAR} or name an existing id."
            )
        if device_id in ids:
            raise RuntimeError(f"{VISIBLE_DEVICES_VAR}={raw!r} names NPU {device_id} twice.")
        ids.append(device_id)
    return ids


def total_memory() -> int:
    """Bytes of memory of each modelled NPU (``TORCH_NPU_REFERENCE_TOTAL_MEMORY``)."""
    return _non_negative_int(TOTAL_MEMORY_VAR, DEFAULT_TOTAL_MEMORY)


def device_name() -> str:
    """Name each modelled NPU reports (``TORCH_NPU_REFERENCE_DEVICE_NAME``)."""
    return os.environ.get(DEVICE_NAME_VAR) or DEFAULT_DEVICE_NAME
