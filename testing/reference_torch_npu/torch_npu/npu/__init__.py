"""The reference ``torch.npu`` namespace (``torch_npu.npu``), backed by the CPU.

Importing ``torch_npu`` registers this module as ``torch.npu``, as torch_npu does. What is
modelled: device selection (``_device``), memory accounting (``memory``), streams and events
(``streams``), seeding (``random``), graphs (``graphs``) and their task groups and
updates (``task_groups``). Anything else is absent, so
using it fails with
``AttributeError`` instead of pretending.
"""

from torch_npu.npu._device import (
    current_device,
    device,
    device_count,
    get_device_capability,
    get_device_name,
    get_device_properties,
    init,
    is_available,
    is_bf16_supported,
    is_initialized,
    set_device,
    synchronize,
)
from torch_npu.npu.graphs import (
    NPUGraph,
    graph,
    graph_pool_handle,
    is_current_stream_capturing,
)
from torch_npu.npu.memory import (
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    mem_get_info,
    memory_allocated,
    memory_reserved,
    reset_max_memory_allocated,
    reset_peak_memory_stats,
)
from torch_npu.npu.random import initial_seed, manual_seed, manual_seed_all
from torch_npu.npu.streams import (
    Event,
    Stream,
    StreamContext,
    current_stream,
    default_stream,
    set_stream,
    stream,
)
from torch_npu.npu.task_groups import (
    ExternalEvent,
    graph_task_group_begin,
    graph_task_group_end,
    graph_task_update_begin,
    graph_task_update_end,
)


def _is_in_bad_fork() -> bool:
    """torch calls this before seeding a PrivateUse1 device module; nothing forks badly here."""
    return False


__all__ = [
    "Event",
    "ExternalEvent",
    "NPUGraph",
    "Stream",
    "StreamContext",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "empty_cache",
    "get_device_capability",
    "get_device_name",
    "get_device_properties",
    "graph",
    "graph_pool_handle",
    "graph_task_group_begin",
    "graph_task_group_end",
    "graph_task_update_begin",
    "graph_task_update_end",
    "init",
    "initial_seed",
    "is_available",
    "is_bf16_supported",
    "is_current_stream_capturing",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "reset_max_memory_allocated",
    "reset_peak_memory_stats",
    "set_device",
    "set_stream",
    "stream",
    "synchronize",
]
