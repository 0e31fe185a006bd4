"""Running a function on several processes joined by a gloo process group (tests only).

The rank functions live in this module (or another importable one), since spawned
processes import them by name.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(function: Callable[..., None], world_size: int, *args: Any) -> None:
    """Run ``function(rank, world_size, *args)`` on ``world_size`` gloo ranks.

    An exception (a failed assertion) on any rank fails the caller.
    """
    with tempfile.TemporaryDirectory() as folder:
        init_method = "file://" + os.path.join(folder, "store")
        mp.spawn(_rank_main, args=(world_size, init_method, function, args),
                 nprocs=world_size, join=True)


def _rank_main(
    rank: int, world_size: int, init_method: str, function: Callable[..., None], args: tuple
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        function(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def expert_rows(
    phy2log: torch.Tensor, layer: int, rank: int, num_ranks: int, param: int
) -> torch.Tensor:
    """Rank ``rank``'s slot rows of parameter ``param`` of ``layer`` for ``phy2log``
    [layers, slots]: each row holds values that name (layer, expert, param), so a
    misplaced row is visible. Parameter 0 is [3, 4] per expert, parameter 1 [5]."""
    k = phy2log.size(1) // num_ranks
    experts = phy2log[layer, rank * k : (rank + 1) * k].to(torch.float32)
    shape = (3, 4) if param == 0 else (5,)
    base = experts.view(-1, *([1] * len(shape))) * 100 + layer * 10_000 + param * 10
    return base + torch.arange(int(torch.tensor(shape).prod())).view(shape).to(torch.float32)
