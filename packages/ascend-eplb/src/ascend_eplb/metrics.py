"""How well a placement balances the load across GPUs."""

from __future__ import annotations

import torch

from ascend_eplb.validation import as_load_matrix, check_topology, positive_int

__all__ = [
    "balancedness",
    "balancedness_upper_bound",
    "min_max_replica_load",
    "peak_load_lower_bound",
    "rank_loads",
]


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
            f"logcnt must be shaped like weight {tuple(weight.shape)}, got {tuple(logcnt.shape)}"
        )
    if phy2log.dim() != 2 or phy2log.size(0) != num_layers:
        raise ValueError(
            f"phy2log must be shaped [layers={num_layers}, num_replicas], "
            f"got {tuple(phy2log.shape)}"
        )
    num_replicas = phy2log.size(1)
    if num_replicas % num_gpus:
        raise ValueError(
            f"phy2log's num_replicas ({num_replicas}) must be divisible by num_gpus ({num_gpus})"
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


def min_max_replica_load(weight: torch.Tensor, num_replicas: int) -> torch.Tensor:
    """Per layer, the smallest possible largest load per replica: [layers] float64.

    Over all ways of giving ``num_replicas`` slots to the experts (each at least one),
    the minimum of ``max_e weight[e] / replicas[e]``. Any GPU that holds the hottest
    replica carries at least this much. Computed by bisection to within a relative
    1e-12, rounding down, so it stays a valid lower bound.
    """
    weight = as_load_matrix(weight)
    num_replicas = positive_int("num_replicas", num_replicas)
    if num_replicas < weight.size(-1):
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the number of experts ({weight.size(-1)})"
        )
    return replica_load_bracket(weight, num_replicas, iterations=48)[0]


def replica_load_bracket(
    weight: torch.Tensor, num_slots: int | torch.Tensor, iterations: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` per row around the optimal largest load per replica.

    ``high`` is feasible: ``max(1, ceil(weight / high))`` replicas per expert fit into
    ``num_slots`` (an int, or one per row); the optimum is >= ``low``. Bisection in log
    space, starting from the bounds total / num_slots and max / (num_slots - experts + 1)
    below and max above.
    """
    num_rows, num_experts = weight.shape
    if num_rows == 0 or num_experts == 0:
        empty = weight.new_zeros(num_rows)
        return empty, empty.clone()
    peak = weight.amax(dim=-1)
    tiny = torch.finfo(weight.dtype).tiny
    low = torch.maximum(weight.sum(-1) / num_slots, peak / (num_slots - num_experts + 1))
    high = peak.clone()  # feasible: one replica each
    log_low, log_high = low.clamp(min=tiny).log(), high.clamp(min=tiny).log()
    for _ in range(iterations):
        log_mid = (log_low + log_high) * 0.5
        mid = log_mid.exp()
        fits = torch.ceil(weight / mid.unsqueeze(-1)).clamp_(min=1).sum(-1) <= num_slots
        # keep the exact values tested: `high` stays feasible, `low` infeasible (or the
        # starting bound)
        high = torch.where(fits, mid, high)
        low = torch.where(fits, low, mid)
        log_high = torch.where(fits, log_mid, log_high)
        log_low = torch.where(fits, log_low, log_mid)
    zero = peak == 0
    return torch.where(zero, 0.0, low), torch.where(zero, 0.0, high)


def peak_load_lower_bound(
    weight: torch.Tensor,
    num_replicas: int,
    num_gpus: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> torch.Tensor:
    """A lower bound on the smallest achievable peak GPU load, per layer: [layers] float64.

    No placement with these sizes can do better than the largest of:
    - the mean GPU load;
    - the optimal largest load per replica (``min_max_replica_load``);
    - without redundancy (``num_replicas`` == experts), the hottest expert plus the
      ``k - 1`` lightest others, ``k`` being the slots per GPU;
    - for hierarchical placements (``num_groups % num_nodes == 0``, groups kept inside
      one node, as the "default" policy does): the heaviest node's share per GPU, at
      least max(total / nodes, heaviest group) / GPUs per node, each group's optimal
      largest load per replica within the slots its node can give it, and, without
      redundancy and with one group per node, each group's hottest expert plus the
      ``k - 1`` lightest others of its group.
    """
    weight = as_load_matrix(weight)
    num_replicas = positive_int("num_replicas", num_replicas)
    num_gpus = positive_int("num_gpus", num_gpus)
    num_groups = positive_int("num_groups", num_groups)
    num_nodes = positive_int("num_nodes", num_nodes)
    num_layers, num_experts = weight.shape
    check_topology(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    if num_layers == 0:
        return weight.new_zeros(0)
    total = weight.sum(-1)
    bound = torch.maximum(total / num_gpus, replica_load_bracket(weight, num_replicas, 48)[0])
    slots_per_gpu = num_replicas // num_gpus
    if num_replicas == num_experts and num_experts > 1:
        lightest_others = torch.sort(weight, dim=-1).values[:, : slots_per_gpu - 1].sum(-1)
        hottest = weight.amax(-1)
        # The hottest expert's GPU holds k - 1 other experts, each at least as heavy as
        # the lightest ones (the hottest is excluded: it sorts last unless all are equal).
        bound = torch.maximum(bound, hottest + lightest_others.clamp(max=total - hottest))
    if num_groups % num_nodes == 0 and num_experts % num_groups == 0:
        group_size = num_experts // num_groups
        groups_per_node = num_groups // num_nodes
        gpus_per_node = num_gpus // num_nodes
        group_load = weight.view(num_layers, num_groups, group_size)
        if num_replicas == num_experts and groups_per_node == 1 and group_size > 1:
            # A node holds exactly one group: its hottest expert's GPU is filled from
            # the same group.
            ascending = torch.sort(group_load, dim=-1).values
            lightest = ascending[..., : slots_per_gpu - 1].sum(-1)
            hottest = ascending[..., -1]
            within = hottest + lightest.clamp(max=group_load.sum(-1) - hottest)
            bound = torch.maximum(bound, within.amax(-1))
        heaviest_node = torch.maximum(total / num_nodes, group_load.sum(-1).amax(-1))
        bound = torch.maximum(bound, heaviest_node / gpus_per_node)
        slots_for_group = num_replicas // num_nodes - (groups_per_node - 1) * group_size
        if slots_for_group >= group_size:
            per_group = replica_load_bracket(
                group_load.reshape(-1, group_size), slots_for_group, 48
            )[0]
            bound = torch.maximum(bound, per_group.view(num_layers, num_groups).amax(-1))
    return bound


def balancedness_upper_bound(
    weight: torch.Tensor,
    num_replicas: int,
    num_gpus: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> float:
    """The best balancedness any placement could reach: pooled like ``balancedness``,
    sum over layers of the mean GPU load / sum of ``peak_load_lower_bound``.

    The optimum lies between a policy's balancedness and this value.
    """
    weight = as_load_matrix(weight)
    bound = peak_load_lower_bound(weight, num_replicas, num_gpus, num_groups, num_nodes)
    total_bound = float(bound.sum())
    if total_bound == 0.0:
        return 1.0
    return float(weight.sum() / num_gpus) / total_bound
