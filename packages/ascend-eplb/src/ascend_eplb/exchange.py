"""Moving expert weights between ranks as a ``TransferPlan`` says.

Each rank holds, per MoE layer, a few expert-major tensors (e.g. ``w13`` and ``w2``),
whose row ``j`` is the weights of the rank's local slot ``j``. Applying a plan is two
steps, so that a failure never leaves a half-moved layer:

1. ``stage_expert_weights``: every rank sends the rows other ranks need and receives
   the rows it needs into fresh staging buffers, with one batch of torch.distributed
   point-to-point operations (``batch_isend_irecv`` of ``P2POp``s: gloo on the host,
   HCCL on NPUs); copies inside a rank are staged too. Nothing in service is written.
2. ``commit_staged_weights``: writes the staged rows into their slots.

Between the two, the ranks can agree that every one of them staged successfully (see
``ascend_eplb.runtime``) and drop the staging otherwise. Sends and receives between
two ranks are issued in the same order on both sides (the plan's move order, then
parameter order) and tagged with that position, which is how they are matched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ascend_eplb.transfer import TransferPlan

__all__ = [
    "StagedWeights",
    "apply_transfer_plan",
    "commit_staged_weights",
    "stage_expert_weights",
]

LayerWeights = Sequence[Sequence[torch.Tensor]]  # [layer][param] -> [slots, ...] tensor


@dataclass
class StagedWeights:
    """The rows one rank received (or copied locally) for a plan, not yet in service."""

    layer: torch.Tensor  # [n] int64: MoE layer of each staged row
    slot: torch.Tensor  # [n] int64: local destination slot of each staged row
    rows: list[torch.Tensor]  # per parameter: [n, ...] staged rows, in move order
    rows_sent: int  # rows this rank sent to other ranks (one per move, all parameters)
    rows_received: int  # rows this rank received from other ranks
    rows_copied_locally: int

    @property
    def num_rows(self) -> int:
        return int(self.layer.numel())


def stage_expert_weights(
    plan: TransferPlan,
    sources: LayerWeights,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
) -> StagedWeights:
    """Send, receive and copy this rank's share of ``plan`` into staging buffers.

    Args:
        plan: the moves of every rank (all ranks pass the same plan).
        sources: ``sources[layer][p]`` is this rank's tensor of parameter ``p``,
            ``[plan.src_slots_per_gpu, ...]``; every layer has the same parameters
            (same shapes and dtypes).
        rank: this rank's index among the plan's ``num_gpus`` ranks (its rank in
            ``group``).
        group: the process group of those ranks; None for the default group. Unused
            when no move crosses ranks.

    Raises ValueError for sources that do not fit the plan (checked before any
    message is sent, so every rank raises alike when the inputs are alike).
    """
    moves = plan.moves
    num_ranks = plan.num_gpus
    if not 0 <= rank < num_ranks:
        raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
    templates = _check_sources(sources, plan)
    src_k = plan.src_slots_per_gpu
    dst_k = plan.slots_per_gpu

    incoming = moves[moves[:, 2] == rank] if moves.numel() else moves
    rows = [
        torch.empty((incoming.size(0),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
        for t in templates
    ]
    ops: list[dist.P2POp] = []
    sent = received = copied = 0
    position = 0  # next staging row, in the order of incoming moves
    num_params = len(templates)
    for index, (layer, src_rank, dst_rank, src_slot, _dst_slot, _expert) in enumerate(
        moves.tolist()
    ):
        if src_rank == rank and dst_rank == rank:
            for p, staged in enumerate(rows):
                staged[position].copy_(sources[layer][p][src_slot - rank * src_k])
            position += 1
            copied += 1
        elif dst_rank == rank:
            for p, staged in enumerate(rows):
                ops.append(dist.P2POp(dist.irecv, staged[position], group=group,
                                      tag=index * num_params + p, group_peer=src_rank))
            position += 1
            received += 1
        elif src_rank == rank:
            for p in range(num_params):
                row = sources[layer][p][src_slot - rank * src_k]
                ops.append(dist.P2POp(dist.isend, row.contiguous(), group=group,
                                      tag=index * num_params + p, group_peer=dst_rank))
            sent += 1
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    if incoming.numel():
        local_slot = incoming[:, 4] - rank * dst_k
        layer_index = incoming[:, 0].clone()
    else:
        local_slot = layer_index = torch.zeros(0, dtype=torch.int64)
    return StagedWeights(layer_index, local_slot, rows, sent, received, copied)


def commit_staged_weights(staged: StagedWeights, targets: LayerWeights) -> None:
    """Write staged rows into ``targets[layer][p]`` (``[plan.slots_per_gpu, ...]``)."""
    if staged.num_rows == 0:
        return
    for layer in staged.layer.unique().tolist():
        pick = (staged.layer == layer).nonzero(as_tuple=True)[0]
        slots = staged.slot[pick]
        for p, rows in enumerate(staged.rows):
            target = targets[layer][p]
            target.index_copy_(0, slots.to(target.device), rows[pick.to(rows.device)])


def apply_transfer_plan(
    plan: TransferPlan,
    weights: LayerWeights,
    rank: int,
    *,
    group: dist.ProcessGroup | None = None,
) -> StagedWeights:
    """Stage then commit ``plan`` in place (same slots per rank before and after)."""
    if plan.src_slots_per_gpu != plan.slots_per_gpu:
        raise ValueError(
            f"apply_transfer_plan moves weights in place, but the plan changes the slots per "
            f"rank from {plan.src_slots_per_gpu} to {plan.slots_per_gpu}; stage into new "
            "buffers with stage_expert_weights and commit_staged_weights instead"
        )
    staged = stage_expert_weights(plan, weights, rank, group=group)
    commit_staged_weights(staged, weights)
    return staged


def _check_sources(sources: LayerWeights, plan: TransferPlan) -> list[torch.Tensor]:
    num_layers = plan.phy2log.size(0)
    if len(sources) != num_layers:
        raise ValueError(
            f"the plan has {num_layers} MoE layers but weights were given for {len(sources)}"
        )
    if num_layers == 0:
        return []
    templates = list(sources[0])
    if not templates:
        raise ValueError("every layer needs at least one expert weight tensor, layer 0 has none")
    for layer, params in enumerate(sources):
        if len(params) != len(templates):
            raise ValueError(
                f"layer {layer} has {len(params)} expert weight tensors, layer 0 has "
                f"{len(templates)}; every layer must have the same ones"
            )
        for p, (tensor, template) in enumerate(zip(params, templates, strict=True)):
            if tensor.dim() < 1 or tensor.size(0) != plan.src_slots_per_gpu:
                raise ValueError(
                    f"layer {layer} weight {p} has shape {tuple(tensor.shape)}; expected "
                    f"{plan.src_slots_per_gpu} rows, one per local slot of the source layout"
                )
            if tensor.shape[1:] != template.shape[1:] or tensor.dtype != template.dtype:
                raise ValueError(
                    f"layer {layer} weight {p} is {tuple(tensor.shape)} {tensor.dtype}, layer 0's "
                    f"is {tuple(template.shape)} {template.dtype}; layers must match"
                )
    return templates
