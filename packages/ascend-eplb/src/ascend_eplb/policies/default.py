"""DeepSeek's expert-parallel load balancer, the "default" EPLB policy.

The algorithm of https://github.com/deepseek-ai/EPLB, written anew with torch and
vectorised across layers (the greedy steps stay sequential over items, as the
algorithm is defined):

1. Hierarchical (``num_groups % num_nodes == 0``): pack expert groups onto nodes
   so that node loads are balanced, which keeps each group's experts (and so
   group-limited routing's traffic) inside one node.
2. Inside each node, replicate experts: every redundant slot goes to the expert
   whose load per replica is currently highest.
3. Pack the physical experts of each node onto its GPUs, balancing GPU loads,
   where a replica of expert ``e`` carries ``weight[e] / logcnt[e]``.

Otherwise the placement is global: the same procedure with one node and one group.

Ties are broken deterministically: among equal loads the lower index comes first
(stable sorts, first-index argmin/argmax), as in the reference implementation.
"""

from __future__ import annotations

import torch

from ascend_eplb.validation import as_load_matrix, check_topology, positive_int

__all__ = ["balanced_packing", "rebalance_experts", "replicate_experts"]


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack ``n`` weighted items into ``num_packs`` packs of exactly ``n / num_packs`` items.

    Greedy longest-processing-time: items in descending weight go to the lightest
    pack that still has room.

    Args:
        weight: [rows, n] item weights; ``n`` must be a multiple of ``num_packs``.
        num_packs: number of packs.

    Returns:
        pack_index: [rows, n] int64, the pack of each item.
        rank_in_pack: [rows, n] int64, the item's position inside its pack (0-based,
            in the order the items were placed).
    """
    num_rows, num_items = weight.shape
    items_per_pack = num_items // num_packs
    if items_per_pack == 1:
        pack_index = torch.arange(num_items, dtype=torch.int64).expand(num_rows, -1).clone()
        return pack_index, torch.zeros_like(pack_index)

    order = torch.sort(weight, dim=-1, descending=True, stable=True).indices
    rows = torch.arange(num_rows)
    pack_load = torch.zeros(num_rows, num_packs, dtype=weight.dtype)
    pack_size = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    pack_index = torch.empty(num_rows, num_items, dtype=torch.int64)
    rank_in_pack = torch.empty(num_rows, num_items, dtype=torch.int64)
    for step in range(num_items):
        item = order[:, step]
        open_load = pack_load.masked_fill(pack_size == items_per_pack, float("inf"))
        pack = open_load.argmin(dim=-1)
        pack_index[rows, item] = pack
        rank_in_pack[rows, item] = pack_size[rows, pack]
        pack_load[rows, pack] += weight[rows, item]
        pack_size[rows, pack] += 1
    return pack_index, rank_in_pack


def replicate_experts(
    weight: torch.Tensor, num_physical: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Spread ``num_physical`` slots over ``num_logical`` experts, minimising the largest
    load per replica (greedy: each extra slot goes to the expert with the highest
    ``weight / replicas``).

    Args:
        weight: [rows, num_logical] expert loads.
        num_physical: number of slots, >= num_logical.

    Returns:
        phy2log: [rows, num_physical] int64, the logical expert of each slot; slot
            ``i < num_logical`` holds expert ``i``.
        phy_rank: [rows, num_physical] int64, which replica of its expert each slot is.
        logcnt: [rows, num_logical] int64, replicas per logical expert.
    """
    num_rows, num_logical = weight.shape
    rows = torch.arange(num_rows)
    phy2log = torch.arange(num_physical, dtype=torch.int64).expand(num_rows, -1).clone()
    phy_rank = torch.zeros(num_rows, num_physical, dtype=torch.int64)
    logcnt = torch.ones(num_rows, num_logical, dtype=torch.int64)
    for slot in range(num_logical, num_physical):
        expert = (weight / logcnt).argmax(dim=-1)
        phy2log[:, slot] = expert
        phy_rank[:, slot] = logcnt[rows, expert]
        logcnt[rows, expert] += 1
    return phy2log, phy_rank, logcnt


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of a batch of permutations [rows, n]."""
    inverse = torch.empty_like(permutation)
    positions = torch.arange(permutation.size(-1), dtype=torch.int64)
    inverse.scatter_(-1, permutation, positions.expand_as(permutation))
    return inverse


def _rebalance_hierarchical(
    weight: torch.Tensor, num_physical: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """phy2log, phy_rank [layers, num_physical] and logcnt [layers, num_logical]."""
    num_layers, num_logical = weight.shape
    group_size = num_logical // num_groups
    groups_per_node = num_groups // num_nodes
    logical_per_node = num_logical // num_nodes
    physical_per_node = num_physical // num_nodes
    physical_per_gpu = num_physical // num_gpus

    # Step 1: groups -> nodes. "mlog" renumbers logical experts so that each node's
    # experts are contiguous (node-major, then group rank in node, then expert in group).
    group_load = weight.view(num_layers, num_groups, group_size).sum(dim=-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    first_mlog_of_group = (group_node * groups_per_node + group_rank) * group_size
    log2mlog = (
        first_mlog_of_group.unsqueeze(-1) + torch.arange(group_size, dtype=torch.int64)
    ).flatten(-2)
    mlog2log = _inverse(log2mlog)

    # Step 2: replicate inside each node; rows are (layer, node) pairs from here on.
    mlog_load = weight.gather(-1, mlog2log).view(num_layers * num_nodes, logical_per_node)
    phy2mlog, phy_rank, mlogcnt = replicate_experts(mlog_load, physical_per_node)

    # Step 3: physical experts -> GPUs of their node, by load per replica.
    phy_load = (mlog_load / mlogcnt).gather(-1, phy2mlog)
    gpu, rank_in_gpu = balanced_packing(phy_load, num_gpus // num_nodes)
    pphy2phy = _inverse(gpu * physical_per_gpu + rank_in_gpu)

    # Back to global numbering: node-local mlog -> global mlog -> logical id.
    pphy2mlog = phy2mlog.gather(-1, pphy2phy).view(num_layers, num_nodes, physical_per_node)
    node_offset = torch.arange(0, num_logical, logical_per_node, dtype=torch.int64)
    pphy2mlog = (pphy2mlog + node_offset.view(1, num_nodes, 1)).flatten(-2)
    phy2log = mlog2log.gather(-1, pphy2mlog)
    phy_rank = phy_rank.gather(-1, pphy2phy).view(num_layers, num_physical)
    logcnt = mlogcnt.view(num_layers, num_logical).gather(-1, log2mlog)
    return phy2log, phy_rank, logcnt


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place ``num_replicas`` physical experts onto ``num_gpus`` GPUs from expert loads.

    Args:
        weight: [layers, num_experts] load of each logical expert (any real dtype,
            finite and non-negative; computed on the CPU).
        num_replicas: physical experts in all, a multiple of ``num_gpus`` and at least
            ``num_experts``.
        num_groups: expert groups (of group-limited routing); the placement is
            hierarchical when ``num_groups % num_nodes == 0``, and then
            ``num_experts`` must be a multiple of ``num_groups``.
        num_nodes: server nodes (the intra-node network is the faster one).
        num_gpus: GPUs (ranks) in all, a multiple of ``num_nodes``.

    Returns:
        phy2log: [layers, num_replicas] int64, the logical expert of each physical slot;
            slots ``g * num_replicas / num_gpus ...`` belong to GPU ``g``.
        log2phy: [layers, num_experts, max_replicas] int64, the physical slots of each
            logical expert, padded with -1; ``max_replicas`` is the largest ``logcnt``
            over all layers.
        logcnt: [layers, num_experts] int64, replicas per logical expert.
    """
    weight = as_load_matrix(weight)
    num_replicas = positive_int("num_replicas", num_replicas)
    num_groups = positive_int("num_groups", num_groups)
    num_nodes = positive_int("num_nodes", num_nodes)
    num_gpus = positive_int("num_gpus", num_gpus)
    num_layers, num_experts = weight.shape
    check_topology(num_experts, num_replicas, num_groups, num_nodes, num_gpus)

    if num_groups % num_nodes == 0:
        if num_experts % num_groups:
            raise ValueError(
                f"the number of experts ({num_experts}, weight's second dimension) must be "
                f"divisible by num_groups ({num_groups}) for hierarchical balancing "
                f"(used because num_groups is a multiple of num_nodes={num_nodes}); "
                "pass the model's real expert-group count, or num_groups=1 for global balancing"
            )
        phy2log, phy_rank, logcnt = _rebalance_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
    else:
        phy2log, phy_rank, logcnt = _rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)

    max_replicas = int(logcnt.max()) if logcnt.numel() else 1
    log2phy = torch.full((num_layers, num_experts, max_replicas), -1, dtype=torch.int64)
    log2phy.view(num_layers, num_experts * max_replicas).scatter_(
        -1,
        phy2log * max_replicas + phy_rank,
        torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1),
    )
    return phy2log, log2phy, logcnt
