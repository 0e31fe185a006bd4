"""``enable_cpu_binding``: each worker process on its own share of the host's CPU cores.

An NPU worker's host work (scheduling its kernels, the sampler, HCCL's threads) competes
with the other ranks' for the cores when every process may run anywhere. With the key
set, local rank ``r`` of ``w`` takes the ``r``-th of ``w`` contiguous, near-equal slices
of the cores the process may use, ordered by NUMA node, so that a slice stays within one
node whenever the ranks divide the nodes evenly. Every thread the process has is bound
(threads started later inherit it), and torch's intra-op pool is sized to the slice.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

NODES = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> list[int]:
    """Linux's cpulist format ("0-3,8,10-11") as the sorted core ids."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return sorted(cores)


def numa_node_of_core(nodes: Path = NODES) -> dict[int, int]:
    """Core id -> NUMA node, from sysfs; empty where the kernel exposes no nodes."""
    found: dict[int, int] = {}
    for entry in sorted(nodes.glob("node[0-9]*")) if nodes.is_dir() else ():
        match = re.fullmatch(r"node(\d+)", entry.name)
        cpulist = entry / "cpulist"
        if match and cpulist.is_file():
            for core in parse_cpu_list(cpulist.read_text()):
                found[core] = int(match.group(1))
    return found


def cpu_share(allowed: Iterable[int], local_rank: int, local_world_size: int,
              node_of: dict[int, int] | None = None) -> list[int]:
    """The cores local rank ``local_rank`` of ``local_world_size`` binds to.

    ``allowed`` are the cores the process may use; they are ordered by (NUMA node, id)
    and cut into ``local_world_size`` contiguous slices, the first ones one core larger
    where they do not divide evenly. With fewer cores than ranks, ranks share cores
    round-robin (one core each).
    """
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"enable_cpu_binding: local rank {local_rank} is not in "
                         f"0..{local_world_size - 1} (the ranks on this host)")
    node_of = node_of or {}
    cores = sorted(set(allowed), key=lambda core: (node_of.get(core, 0), core))
    if not cores:
        raise ValueError("enable_cpu_binding: this process may run on no CPU core")
    if len(cores) < local_world_size:
        return [cores[local_rank % len(cores)]]
    start = local_rank * len(cores) // local_world_size
    end = (local_rank + 1) * len(cores) // local_world_size
    return cores[start:end]


def bind_this_process(cores: Sequence[int]) -> None:
    """Bind every thread of this process to ``cores`` and size torch's thread pool."""
    import torch

    tasks = Path("/proc/self/task")
    thread_ids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for thread_id in thread_ids:
        try:
            os.sched_setaffinity(thread_id, cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass
    torch.set_num_threads(len(cores))


def bind_worker(local_rank: int, local_world_size: int) -> list[int]:
    """Pick this rank's cores (see :func:`cpu_share`), bind to them, log it; returns them."""
    node_of = numa_node_of_core()
    cores = cpu_share(os.sched_getaffinity(0), local_rank, local_world_size, node_of)
    bind_this_process(cores)
    nodes = sorted({node_of.get(core, 0) for core in cores})
    logger.info("enable_cpu_binding: local rank %d of %d bound to CPU cores %s (NUMA node %s)",
                local_rank, local_world_size, ",".join(map(str, cores)),
                ",".join(map(str, nodes)))
    return cores
