"""Turning one placement into another with the fewest expert weight copies.

``plan_transfers(old_phy2log, new_phy2log, num_gpus, expert_bytes)`` first reorders
the slots inside each GPU of the new placement so that every expert that stays on a
GPU keeps its old slot (``placement.align_to_previous``); the remaining slots each need
one copy of their expert's weights. That is the fewest copies any schedule can do for
these GPU contents: a slot whose expert changes must receive weights, one copy each.

Each copy reads from a slot of the *old* placement that holds the expert, preferring
the destination GPU itself (a local copy, when the new placement adds a replica of an
expert the GPU already has), then a GPU of the same node, and spreading the reads of
one expert over its old replicas. Copies read old weights, so whoever applies a plan
must read every source before overwriting it (e.g. receive into a staging buffer);
the order of the moves does not matter then.

``plan_initial_transfers`` fills a first placement from the layout the weights were
loaded in, which may have another number of slots per rank (e.g. redundant experts
added); ``ascend_eplb.exchange`` applies plans between processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ascend_eplb._threads import one_thread
from ascend_eplb.placement import align_to_previous, check_phy2log, log2phy_from_phy2log
from ascend_eplb.validation import positive_int

__all__ = ["ExpertMove", "TransferPlan", "plan_initial_transfers", "plan_transfers"]

MOVE_COLUMNS = ("layer", "src_rank", "dst_rank", "src_slot", "dst_slot", "expert")


class ExpertMove(NamedTuple):
    """One copy of an expert's weights; slots are physical slot indices of the layer."""

    layer: int
    src_rank: int
    dst_rank: int
    src_slot: int
    dst_slot: int
    expert: int


@dataclass(frozen=True)
class TransferPlan:
    """The copies that turn an old placement into ``phy2log``.

    ``src_slot`` indexes the old placement's slots and ``dst_slot`` the new one's; the
    two have the same number of slots per rank except for ``plan_initial_transfers``,
    whose source layout is the one the weights were loaded in.
    """

    phy2log: torch.Tensor  # [layers, num_replicas]: the new placement, slots aligned
    moves: torch.Tensor  # [num_moves, 6] int64, columns MOVE_COLUMNS, by layer then dst_slot
    expert_bytes: int
    num_gpus: int
    source_slots_per_gpu: int | None = None  # None: as many as the new placement

    @property
    def slots_per_gpu(self) -> int:
        return self.phy2log.size(1) // self.num_gpus

    @property
    def src_slots_per_gpu(self) -> int:
        if self.source_slots_per_gpu is None:
            return self.slots_per_gpu
        return self.source_slots_per_gpu

    @property
    def num_moves(self) -> int:
        return int(self.moves.size(0))

    @property
    def total_bytes(self) -> int:
        """Bytes copied, local copies included."""
        return self.num_moves * self.expert_bytes

    @property
    def bytes_between_ranks(self) -> int:
        """Bytes that cross from one rank to another."""
        crossing = int((self.moves[:, 1] != self.moves[:, 2]).sum()) if self.num_moves else 0
        return crossing * self.expert_bytes

    def moves_per_layer(self) -> torch.Tensor:
        """[layers] int64: copies per layer."""
        counts = torch.zeros(self.phy2log.size(0), dtype=torch.int64)
        if self.num_moves:
            counts.scatter_add_(0, self.moves[:, 0], torch.ones(self.num_moves, dtype=torch.int64))
        return counts

    def to_list(self) -> list[ExpertMove]:
        return [ExpertMove(*row) for row in self.moves.tolist()]


@one_thread
def plan_transfers(
    old_phy2log: torch.Tensor | Any,
    new_phy2log: torch.Tensor | Any,
    num_gpus: int,
    expert_bytes: int,
    *,
    num_nodes: int = 1,
    num_experts: int | None = None,
) -> TransferPlan:
    """The fewest expert weight copies that turn ``old_phy2log`` into ``new_phy2log``.

    Args:
        old_phy2log, new_phy2log: [layers, num_replicas] placements of the same shape.
        num_gpus: ranks; each holds ``num_replicas / num_gpus`` contiguous slots.
        expert_bytes: size of one expert's weights (all layers alike), >= 0.
        num_nodes: nodes the ranks are spread over (contiguously), used to prefer
            sources inside the destination's node.
        num_experts: logical experts; default: one more than the largest id.

    Returns a ``TransferPlan`` whose ``phy2log`` is ``new_phy2log`` with slots reordered
    inside each rank (same rank contents, same loads) so that nothing moves needlessly.
    """
    num_gpus = positive_int("num_gpus", num_gpus)
    num_nodes = positive_int("num_nodes", num_nodes)
    _check_bytes_and_nodes(expert_bytes, num_gpus, num_nodes)
    old = torch.as_tensor(old_phy2log)
    new = torch.as_tensor(new_phy2log)
    if num_experts is None:
        num_experts = 1 + max(
            int(old.max()) if old.numel() else 0, int(new.max()) if new.numel() else 0
        )
    old = check_phy2log(old, num_experts, num_gpus, name="old_phy2log")
    new = check_phy2log(
        new,
        num_experts,
        num_gpus,
        name="new_phy2log",
        num_layers=old.size(0),
        num_replicas=old.size(1),
    )
    aligned = align_to_previous(new, old, num_gpus)
    moves = _moves(old, aligned, aligned != old, num_gpus, num_nodes, num_experts)
    return TransferPlan(aligned, moves, expert_bytes, num_gpus)


@one_thread
def plan_initial_transfers(
    source_phy2log: torch.Tensor | Any,
    target_phy2log: torch.Tensor | Any,
    num_gpus: int,
    expert_bytes: int,
    *,
    num_nodes: int = 1,
    num_experts: int | None = None,
) -> TransferPlan:
    """The copies that fill every slot of ``target_phy2log`` from weights laid out as
    ``source_phy2log``, which may have another number of slots per rank.

    This is how a serving process goes from the layout its weights were loaded in
    (e.g. vLLM's: ``experts / ranks`` experts per rank, no replicas) to its first
    placement (from ``expert_map_path``, with redundant experts): each target slot is
    a fresh buffer, so every slot gets one copy, from the destination rank itself when
    it loaded that expert, else from a rank of its node, else from anywhere. The
    target is used as given (no slot reordering). ``plan.src_slots_per_gpu`` is the
    source's slots per rank.
    """
    num_gpus = positive_int("num_gpus", num_gpus)
    num_nodes = positive_int("num_nodes", num_nodes)
    _check_bytes_and_nodes(expert_bytes, num_gpus, num_nodes)
    source = torch.as_tensor(source_phy2log)
    target = torch.as_tensor(target_phy2log)
    if num_experts is None:
        num_experts = 1 + max(
            int(source.max()) if source.numel() else 0, int(target.max()) if target.numel() else 0
        )
    source = check_phy2log(source, num_experts, num_gpus, name="source_phy2log")
    target = check_phy2log(
        target, num_experts, num_gpus, name="target_phy2log", num_layers=source.size(0)
    )
    everything = torch.ones_like(target, dtype=torch.bool)
    moves = _moves(source, target, everything, num_gpus, num_nodes, num_experts)
    return TransferPlan(
        target.clone(), moves, expert_bytes, num_gpus, source.size(1) // num_gpus
    )


def _check_bytes_and_nodes(expert_bytes: Any, num_gpus: int, num_nodes: int) -> None:
    if isinstance(expert_bytes, bool) or not isinstance(expert_bytes, int) or expert_bytes < 0:
        raise ValueError(f"expert_bytes must be an integer >= 0, got {expert_bytes!r}")
    if num_gpus % num_nodes:
        raise ValueError(f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes})")


def _moves(
    old: torch.Tensor,
    new: torch.Tensor,
    needs_copy: torch.Tensor,
    num_gpus: int,
    num_nodes: int,
    num_experts: int,
) -> torch.Tensor:
    """One move per ``needs_copy`` slot of ``new``, reading from a slot of ``old``."""
    old_slots_per_gpu = old.size(1) // num_gpus
    slots_per_gpu = new.size(1) // num_gpus
    gpus_per_node = num_gpus // num_nodes
    layer, dst_slot = needs_copy.nonzero(as_tuple=True)  # ordered by layer, then slot
    if layer.numel() == 0:
        return torch.zeros(0, len(MOVE_COLUMNS), dtype=torch.int64)
    expert = new[layer, dst_slot]
    dst_rank = dst_slot // slots_per_gpu
    holders = log2phy_from_phy2log(old, num_experts)[0][layer, expert]  # [moves, max_rep]
    valid = holders >= 0
    holder_rank = holders.clamp(min=0) // old_slots_per_gpu
    same_rank = holder_rank == dst_rank.unsqueeze(-1)
    same_node = holder_rank // gpus_per_node == (dst_rank // gpus_per_node).unsqueeze(-1)
    # 0: the destination itself, 1: its node, 2: elsewhere; invalid padding last.
    preference = torch.where(same_rank, 0, torch.where(same_node, 1, 2))
    preference = torch.where(valid, preference, 3)
    best = preference.amin(-1, keepdim=True)
    candidates = preference == best
    # Spread the copies of one expert (in one layer, at one preference) over its
    # candidate holders: the n-th such copy takes candidate n mod (number of candidates).
    group = (layer * num_experts + expert) * 4 + best.squeeze(-1)
    nth = _rank_within_group(group)
    pick = nth % candidates.sum(-1)
    position = (candidates.to(torch.int64).cumsum(-1) - 1).masked_fill(~candidates, -1)
    column = (position == pick.unsqueeze(-1)).to(torch.int8).argmax(-1, keepdim=True)
    src_slot = holders.gather(-1, column).squeeze(-1)
    src_rank = src_slot // old_slots_per_gpu
    return torch.stack([layer, src_rank, dst_rank, src_slot, dst_slot, expert], dim=-1)


def _rank_within_group(group: torch.Tensor) -> torch.Tensor:
    """For each entry, how many earlier entries share its group id."""
    order = torch.sort(group, stable=True).indices
    sorted_group = group[order]
    position = torch.arange(group.numel())
    starts = torch.ones_like(sorted_group, dtype=torch.bool)
    starts[1:] = sorted_group[1:] != sorted_group[:-1]
    run_start = torch.where(starts, position, 0).cummax(0).values
    return torch.empty_like(group).scatter_(0, order, position - run_start)
