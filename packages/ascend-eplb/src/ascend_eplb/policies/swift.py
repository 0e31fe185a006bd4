"""The "swift" policy: incremental rebalancing that moves few experts.

Given the placement in service (``previous``) and fresh loads, swift leaves every
layer whose peak GPU load is already within ``threshold`` of the lower bound alone
(``ascend_eplb.metrics.peak_load_lower_bound`` applied to the placement's constraints),
and repairs the others with the fewest moves it can find: swaps of two replicas between
a heavy and a light GPU (2 expert transfers each), the heaviest GPUs first, until the
layer's peak is within ``threshold / 2`` of its bound (hysteresis, so a repaired layer
does not come straight back) or ``max_moves_per_layer`` transfers are spent. Replica
counts never change, so no expert ever loses its last replica.

Without ``previous`` (the first plan) it plans from scratch with ``flashlb``.

Hierarchical placements (``num_groups % num_nodes == 0``) are repaired node by node,
swaps staying inside a node, when ``previous`` keeps every expert's replicas inside one
node; otherwise the repair is global.
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_eplb._threads import one_thread
from ascend_eplb.metrics import replica_load_bracket
from ascend_eplb.placement import check_phy2log, log2phy_from_phy2log, logcnt_from_phy2log
from ascend_eplb.policies import flashlb
from ascend_eplb.policies._layout import validated
from ascend_eplb.policies._search import improve
from ascend_eplb.validation import positive_int

__all__ = ["rebalance_experts"]


@one_thread
def rebalance_experts(
    weight: torch.Tensor | Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    previous: torch.Tensor | Any | None = None,
    max_moves_per_layer: int | None = None,
    threshold: float = 0.02,
    max_iterations: int = 12,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Repair ``previous`` for the new loads ``weight`` with few expert moves.

    Arguments and results as ``ascend_eplb.policies.default.rebalance_experts``, plus:

    Args:
        previous: [layers, num_replicas] the placement in service (``phy2log``); None
            plans from scratch with ``flashlb``.
        max_moves_per_layer: expert weight transfers allowed per layer (a swap costs 2);
            default ``num_gpus``. 0 returns ``previous`` unchanged.
        threshold: a layer is left alone while its peak GPU load is at most
            ``(1 + threshold)`` times its lower bound; repaired layers are brought to
            ``(1 + threshold / 2)`` where the budget allows.
        max_iterations: bound on the search steps (each can swap in many layers).
    """
    if previous is None:
        return flashlb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical = validated(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    num_layers, num_experts = weight.shape
    previous = check_phy2log(
        previous,
        num_experts,
        num_gpus,
        name="previous",
        num_layers=num_layers,
        num_replicas=num_replicas,
    )
    budget = num_gpus if max_moves_per_layer is None else max_moves_per_layer
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
        raise ValueError(
            f"max_moves_per_layer must be an integer >= 0 (or None), got {max_moves_per_layer!r}"
        )
    threshold = float(threshold)
    if not threshold >= 0.0:
        raise ValueError(f"threshold must be a number >= 0, got {threshold!r}")
    max_iterations = positive_int("max_iterations", max_iterations)

    if num_layers == 0 or budget == 0:
        log2phy, logcnt = log2phy_from_phy2log(previous, num_experts)
        return previous.clone(), log2phy, logcnt
    logcnt = logcnt_from_phy2log(previous, num_experts)
    num_row_groups = num_nodes if hierarchical and _node_closed(previous, num_nodes) else 1
    rows_per_layer = num_row_groups
    gpus_per_row = num_gpus // rows_per_layer
    slots_per_row = num_replicas // rows_per_layer

    experts = previous.reshape(num_layers * rows_per_layer, slots_per_row).clone()
    # Loads per replica, normalised per layer so that the layer's mean GPU load is 1.
    total = weight.sum(-1, keepdim=True)
    scale = torch.where(total > 0, num_gpus / total.clamp(min=1e-300), 0.0)
    replica_load = (weight * scale / logcnt.clamp(min=1)).gather(-1, previous)
    loads = replica_load.to(torch.float32).reshape(experts.shape)

    bound = _row_bounds(weight * scale, previous, rows_per_layer, gpus_per_row)
    layer_bound = bound.view(num_layers, rows_per_layer).amax(-1)
    layer_peak = loads.view(num_layers, num_gpus, -1).sum(-1).amax(-1)
    needs_repair = layer_peak > layer_bound * (1 + threshold)
    target = (layer_bound * (1 + threshold / 2)).to(torch.float32)
    row_target = target.repeat_interleave(rows_per_layer)
    row_peak = loads.view(-1, gpus_per_row, slots_per_row // gpus_per_row).sum(-1).amax(-1)
    row_needs = needs_repair.repeat_interleave(rows_per_layer) & (row_peak > row_target)
    # The layer's budget is shared by its rows that need repair.
    sharing = row_needs.view(num_layers, rows_per_layer).sum(-1).clamp(min=1)
    row_budget = torch.where(
        row_needs, (budget // sharing).repeat_interleave(rows_per_layer), 0
    ).to(torch.int64)
    improve(
        experts,
        loads,
        gpus_per_row,
        stop_at=torch.where(row_needs, row_target, float("inf")),
        above=row_target,
        budget=row_budget,
        max_iterations=max_iterations,
    )
    phy2log = experts.view(num_layers, num_replicas)
    log2phy, logcnt = log2phy_from_phy2log(phy2log, num_experts)
    return phy2log, log2phy, logcnt


def _node_closed(phy2log: torch.Tensor, num_nodes: int) -> bool:
    """Whether every expert's replicas all sit in one node."""
    num_layers, num_replicas = phy2log.shape
    node = (torch.arange(num_replicas) // (num_replicas // num_nodes)).expand_as(phy2log)
    size = int(phy2log.max()) + 1 if phy2log.numel() else 1
    lowest = torch.full((num_layers, size), num_nodes).scatter_reduce(
        -1, phy2log, node, reduce="amin"
    )
    highest = torch.full((num_layers, size), -1).scatter_reduce(-1, phy2log, node, reduce="amax")
    present = highest >= 0
    return bool((lowest[present] == highest[present]).all())


def _row_bounds(
    scaled: torch.Tensor, phy2log: torch.Tensor, rows_per_layer: int, gpus_per_row: int
) -> torch.Tensor:
    """Lower bound on each row's peak GPU load for the row's experts and slots (in the
    normalised units): the row's mean GPU load and its optimal largest replica load,
    plus, without spare slots, the hottest expert with the lightest others."""
    num_layers, num_experts = scaled.shape
    slots_per_row = phy2log.size(1) // rows_per_layer
    rows = phy2log.view(num_layers * rows_per_layer, slots_per_row)
    row_of = torch.arange(num_layers).repeat_interleave(rows_per_layer)
    present = torch.zeros(rows.size(0), num_experts, dtype=torch.bool).scatter_(-1, rows, True)
    row_weight = torch.where(present, scaled[row_of], 0.0)
    mean = row_weight.sum(-1) / gpus_per_row
    # Absent experts count one slot each in the bisection, so give them those slots.
    slots = slots_per_row + (~present).sum(-1)
    cap = replica_load_bracket(row_weight, slots, iterations=16)[0]
    bound = torch.maximum(mean, cap)
    distinct = present.sum(-1)
    k = slots_per_row // gpus_per_row
    exact = distinct == slots_per_row  # one replica each: pieces are the loads themselves
    if bool(exact.any()) and k > 1:
        pieces = scaled[row_of].gather(-1, rows)
        ascending = torch.sort(pieces, dim=-1).values
        floor = ascending[:, -1] + ascending[:, : k - 1].sum(-1)
        bound = torch.where(exact, torch.maximum(bound, floor), bound)
    return bound.to(torch.float32)
