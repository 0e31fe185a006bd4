"""How well a placement balances the load across GPUs."""

from __future__ import annotations

import torch

from ascend_eplb.validation import as_load_matrix, positive_int

__all__ = ["balancedness", "rank_loads"]


def rank_loads(
    weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int
) -> torch.Tensor:
    """Load of each GPU: [layers, num_gpus] float64.

    A replica of logical expert ``e`` carries ``weight[e] / logcnt[e]``; GPU ``g`` holds
    the contiguous slots ``g * slots_per_gpu ... (g + 1) * slots_per_gpu - 1`` of
    ``phy2log`` ([layers, num_replicas]).
    """
    weight = as_load_matrix(weight)
    num_gpus = positive_int("num_gpus", num_gpus)
    num_layers, num_experts = weight.shape
    phy2log = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
    logcnt = torch.as_tensor(logcnt, dtype=torch.int64).cpu()
    if logcnt.shape != weight.shape:
        raise ValueError(
            f"logcnt must be shaped like weight {tuple(weight.shape)}, "
            f"got {tuple(logcnt.shape)}"
        )
    if phy2log.dim() != 2 or phy2log.size(0) != num_layers:
        raise ValueError(
            f"phy2log must be shaped [layers={num_layers}, num_replicas], "
            f"got {tuple(phy2log.shape)}"
        )
    num_replicas = phy2log.size(1)
    if num_replicas % num_gpus:
        raise ValueError(
            f"phy2log's num_replicas ({num_replicas}) must be divisible by "
            f"num_gpus ({num_gpus})"
        )
    if phy2log.numel() and (phy2log.min() < 0 or phy2log.max() >= num_experts):
        raise ValueError(
            f"phy2log must hold logical expert ids in [0, {num_experts}), "
            f"got values from {int(phy2log.min())} to {int(phy2log.max())}"
        )
    used = torch.zeros_like(logcnt, dtype=torch.bool).scatter_(-1, phy2log, True)
    if (logcnt[used] < 1).any():
        raise ValueError("logcnt must be >= 1 for every expert that phy2log places")
    per_replica = weight / logcnt.clamp(min=1)
    slot_load = per_replica.gather(-1, phy2log)
    return slot_load.view(num_layers, num_gpus, num_replicas // num_gpus).sum(dim=-1)


def balancedness(
    weight: torch.Tensor, phy2log: torch.Tensor, logcnt: torch.Tensor, num_gpus: int
) -> float:
    """Sum over layers of the mean GPU load / sum over layers of the max GPU load.

    Pooled over layers rather than averaged per layer, so heavily loaded layers
    count for more, as they do for step time. 1.0 is perfect balance; a placement
    with no load at all counts as perfectly balanced.
    """
    loads = rank_loads(weight, phy2log, logcnt, num_gpus)
    total_max = float(loads.max(dim=-1).values.sum()) if loads.numel() else 0.0
    if total_max == 0.0:
        return 1.0
    return float(loads.mean(dim=-1).sum()) / total_max
