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

The placement is identical to vLLM's ``DefaultEplbPolicy`` (the de facto standard), ties
included: loads are read at float32 precision as vLLM (and DeepSeek's reference) read
them, group loads are float32 sums and everything after is float64, as in vLLM; items
are ordered with the same numpy ``argsort`` call, so equal loads come in the same order
(numpy's default sort is not stable: with exact ties the order is numpy's, not by
index); argmin/argmax take the first index. Zipf loads with s = 1 have many exact ties
(the expert ranked 2r carries exactly half of the one ranked r), and there other tie
orders give other placements, better or worse by a few thousandths of balancedness.
"""

from __future__ import annotations

import numpy as np
import torch

from ascend_eplb._threads import one_thread
from ascend_eplb.placement import align_to_previous, check_phy2log, log2phy_from_phy2log
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

    # Heaviest first, ordered by the very call vLLM makes (same ties, same placement).
    order = torch.from_numpy(np.argsort(-weight.numpy(), axis=-1)).to(torch.int64)
    sorted_weight = weight.to(torch.float64).gather(-1, order)
    # Open packs hold their load; a full pack holds +inf so argmin never picks it again.
    open_load = torch.zeros(num_rows, num_packs, dtype=torch.float64)
    pack_size = torch.zeros(num_rows, num_packs, dtype=torch.int64)
    picks = torch.empty(num_rows, num_items, dtype=torch.int64)  # pack of the step-th heaviest
    first_step = 0
    if num_rows and (num_packs < 2 or bool((sorted_weight[:, num_packs - 2] > 0).all())):
        # With positive loads the first num_packs items go to the empty packs in index
        # order (argmin's first zero), so those steps need no loop.
        picks[:, :num_packs] = torch.arange(num_packs)
        open_load.copy_(sorted_weight[:, :num_packs])
        pack_size.fill_(1)
        first_step = num_packs
    one = torch.ones(num_rows, 1, dtype=torch.int64)
    item_columns = sorted_weight.t().contiguous().unsqueeze(-1)  # [n, rows, 1]
    pick_columns = picks.t()
    for step in range(first_step, num_items):
        pack = open_load.argmin(dim=-1, keepdim=True)
        pick_columns[step] = pack[:, 0]
        open_load.scatter_add_(-1, pack, item_columns[step])
        pack_size.scatter_add_(-1, pack, one)
        open_load.masked_fill_(pack_size == items_per_pack, float("inf"))

    # Every pack gets exactly items_per_pack items, so after a stable sort by pack the
    # q-th item is number q % items_per_pack of its pack, in placement order.
    by_pack = torch.sort(picks, dim=-1, stable=True).indices
    positions = torch.arange(num_items, dtype=torch.int64) % items_per_pack
    rank_sorted = torch.empty_like(picks).scatter_(-1, by_pack, positions.expand(num_rows, -1))
    pack_index = torch.empty_like(picks).scatter_(-1, order, picks)
    rank_in_pack = torch.empty_like(picks).scatter_(-1, order, rank_sorted)
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
    phy2log = torch.arange(num_physical, dtype=torch.int64).expand(num_rows, -1).clone()
    phy_rank = torch.zeros(num_rows, num_physical, dtype=torch.int64)
    logcnt = torch.ones(num_rows, num_logical, dtype=torch.int64)
    # Only the chosen expert's load per replica changes in a step; updating that one
    # entry gives bit-identical values to recomputing weight / logcnt every step.
    per_replica = weight.clone()
    phy2log_columns = phy2log.t()
    phy_rank_columns = phy_rank.t()
    for slot in range(num_logical, num_physical):
        expert = per_replica.argmax(dim=-1, keepdim=True)
        phy2log_columns[slot] = expert[:, 0]
        count = logcnt.gather(-1, expert)
        phy_rank_columns[slot] = count[:, 0]
        count += 1
        logcnt.scatter_(-1, expert, count)
        per_replica.scatter_(-1, expert, weight.gather(-1, expert) / count)
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
    # float32 sums, as vLLM computes them (other roundings can flip near-ties)
    group_load = torch.from_numpy(
        weight.to(torch.float32).numpy().reshape(num_layers, num_groups, group_size).sum(axis=-1)
    )
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


@one_thread
def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    previous: torch.Tensor | None = None,
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
        previous: optional [layers, num_replicas] placement in service; when given, the
            slots inside each GPU are reordered so that experts already on that GPU keep
            their old slots (like vLLM's ``old_global_expert_indices``). GPU contents,
            and so the balance, are unchanged; ``log2phy`` then lists slots in order.

    Returns:
        phy2log: [layers, num_replicas] int64, the logical expert of each physical slot;
            slots ``g * num_replicas / num_gpus ...`` belong to GPU ``g``.
        log2phy: [layers, num_experts, max_replicas] int64, the physical slots of each
            logical expert, padded with -1; ``max_replicas`` is the largest ``logcnt``
            over all layers.
        logcnt: [layers, num_experts] int64, replicas per logical expert.
    """
    # Loads rounded to float32, as DeepSeek's reference and vLLM read them, then handled
    # in float64 like vLLM's packing and replication: the greedy steps then take the same
    # decisions as vLLM's DefaultEplbPolicy (rounding differently flips near-ties and
    # with them whole placements).
    weight = as_load_matrix(weight).to(torch.float32).to(torch.float64)
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

    if previous is not None:
        previous = check_phy2log(
            previous,
            num_experts,
            num_gpus,
            name="previous",
            num_layers=num_layers,
            num_replicas=num_replicas,
        )
        phy2log = align_to_previous(phy2log, previous, num_gpus)
        log2phy, _ = log2phy_from_phy2log(phy2log, num_experts)
        return phy2log, log2phy, logcnt

    max_replicas = int(logcnt.max()) if logcnt.numel() else 1
    log2phy = torch.full((num_layers, num_experts, max_replicas), -1, dtype=torch.int64)
    log2phy.view(num_layers, num_experts * max_replicas).scatter_(
        -1,
        phy2log * max_replicas + phy_rank,
        torch.arange(num_replicas, dtype=torch.int64).expand(num_layers, -1),
    )
    return phy2log, log2phy, logcnt
