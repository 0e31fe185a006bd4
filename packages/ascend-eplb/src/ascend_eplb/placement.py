"""Placements as tensors: checks and conversions shared by policies, planner and files.

A placement is ``phy2log`` [layers, num_replicas]: the logical expert held by each
physical slot, where GPU (rank) ``g`` holds the contiguous slots
``g * k ... g * k + k - 1`` with ``k = num_replicas / num_gpus``.
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_eplb.validation import positive_int

__all__ = [
    "align_to_previous",
    "check_phy2log",
    "log2phy_from_phy2log",
    "logcnt_from_phy2log",
]


def check_phy2log(
    phy2log: Any,
    num_experts: int,
    num_gpus: int,
    *,
    name: str = "phy2log",
    num_layers: int | None = None,
    num_replicas: int | None = None,
) -> torch.Tensor:
    """``phy2log`` as an int64 CPU tensor, after checking that it is a usable placement.

    A usable placement is 2-D, holds integer expert ids in ``[0, num_experts)``, has a
    number of slots divisible by ``num_gpus`` and gives every expert at least one
    replica in every layer. ``num_layers`` / ``num_replicas``, when given, must match.
    Errors name ``name``, the offending layer and value.
    """
    num_gpus = positive_int("num_gpus", num_gpus)
    if not isinstance(phy2log, torch.Tensor):
        try:
            phy2log = torch.as_tensor(phy2log)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                f"{name} must be an integer tensor shaped [layers, num_replicas], "
                f"got {type(phy2log).__name__} that torch cannot convert: {err}"
            ) from None
    if phy2log.dtype == torch.bool or phy2log.is_complex():
        raise ValueError(f"{name} must hold integer expert ids, got dtype {phy2log.dtype}")
    if phy2log.dtype.is_floating_point and not bool(
        (torch.isfinite(phy2log) & (phy2log == phy2log.round())).all()
    ):
        raise ValueError(
            f"{name} must hold integer expert ids, got non-integer values (dtype {phy2log.dtype})"
        )
    phy2log = phy2log.detach().to(device="cpu", dtype=torch.int64)
    if phy2log.dim() != 2:
        raise ValueError(
            f"{name} must be 2-D, shaped [layers, num_replicas], got shape {tuple(phy2log.shape)}"
        )
    layers, replicas = phy2log.shape
    if num_layers is not None and layers != num_layers:
        raise ValueError(f"{name} has {layers} layers, expected {num_layers} (one per MoE layer)")
    if num_replicas is not None and replicas != num_replicas:
        raise ValueError(f"{name} has {replicas} slots per layer, expected {num_replicas}")
    if replicas % num_gpus:
        raise ValueError(
            f"{name} has {replicas} slots per layer, which is not divisible by "
            f"num_gpus ({num_gpus}); every GPU must hold the same number of slots"
        )
    if phy2log.numel() == 0:
        return phy2log
    low, high = int(phy2log.min()), int(phy2log.max())
    if low < 0 or high >= num_experts:
        bad = ((phy2log < 0) | (phy2log >= num_experts)).nonzero()[0].tolist()
        raise ValueError(
            f"{name} must hold logical expert ids in [0, {num_experts}); "
            f"layer {bad[0]} slot {bad[1]} holds {int(phy2log[bad[0], bad[1]])}"
        )
    counts = logcnt_from_phy2log(phy2log, num_experts)
    if (counts == 0).any():
        layer, expert = (int(i) for i in (counts == 0).nonzero()[0])
        missing = int((counts == 0).sum())
        raise ValueError(
            f"{name} gives no replica to {missing} (layer, expert) pair(s), the first "
            f"being expert {expert} in layer {layer}; every expert needs at least one slot"
        )
    return phy2log


def logcnt_from_phy2log(phy2log: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Replicas per logical expert: [layers, num_experts] int64."""
    phy2log = torch.as_tensor(phy2log, dtype=torch.int64)
    counts = torch.zeros(phy2log.size(0), num_experts, dtype=torch.int64)
    return counts.scatter_add_(-1, phy2log, torch.ones_like(phy2log))


def log2phy_from_phy2log(
    phy2log: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log2phy, logcnt)`` of a placement; each expert's slots are listed in slot order.

    ``log2phy`` is [layers, num_experts, max_replicas], padded with -1, where
    ``max_replicas`` is the largest replica count (at least 1).
    """
    phy2log = torch.as_tensor(phy2log, dtype=torch.int64)
    num_layers, num_replicas = phy2log.shape
    logcnt = logcnt_from_phy2log(phy2log, num_experts)
    max_replicas = max(int(logcnt.max()), 1) if logcnt.numel() else 1
    log2phy = torch.full((num_layers, num_experts, max_replicas), -1, dtype=torch.int64)
    if num_layers == 0 or num_replicas == 0:
        return log2phy, logcnt
    # Slots sorted by (expert, slot); a slot's replica index is its position minus the
    # position where its expert's run starts.
    slots = torch.sort(phy2log, dim=-1, stable=True).indices
    experts = phy2log.gather(-1, slots)
    run_start = (logcnt.cumsum(-1) - logcnt).gather(-1, experts)
    replica = torch.arange(num_replicas, dtype=torch.int64) - run_start
    log2phy.view(num_layers, -1).scatter_(-1, experts * max_replicas + replica, slots)
    return log2phy, logcnt


def align_to_previous(phy2log: torch.Tensor, previous: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Reorder the slots inside each GPU of ``phy2log`` so that experts already on that
    GPU in ``previous`` keep their old slots; experts new to the GPU fill the freed
    slots in their original order. GPU contents (and so every load) are unchanged.

    Repeated replicas of one expert on a GPU are matched occurrence by occurrence, so the
    number of slots whose expert changes is the fewest possible for these GPU contents.
    """
    phy2log = torch.as_tensor(phy2log, dtype=torch.int64)
    previous = torch.as_tensor(previous, dtype=torch.int64)
    if phy2log.shape != previous.shape:
        raise ValueError(
            f"the new placement {tuple(phy2log.shape)} and the previous one "
            f"{tuple(previous.shape)} must have the same shape [layers, num_replicas]"
        )
    num_layers, num_replicas = phy2log.shape
    if num_layers == 0 or num_replicas == 0:
        return phy2log.clone()
    slots_per_gpu = num_replicas // num_gpus
    new = phy2log.reshape(num_layers * num_gpus, slots_per_gpu)
    old = previous.reshape(num_layers * num_gpus, slots_per_gpu)
    new_key = _occurrence_keys(new, slots_per_gpu)
    old_key = _occurrence_keys(old, slots_per_gpu)
    # match[r, i, j]: new slot i holds the same (expert, occurrence) as old slot j;
    # keys are unique inside a GPU, so each new slot matches at most one old slot.
    match = new_key.unsqueeze(-1) == old_key.unsqueeze(-2)
    new_kept = match.any(-1)
    old_kept = match.any(-2)
    target = torch.where(new_kept, match.to(torch.int8).argmax(-1), -1)
    # Unmatched new slots (in order) go to unmatched old slots (in order).
    free_old = torch.sort(old_kept.to(torch.int8), dim=-1, stable=True).indices
    rank_unkept = (~new_kept).to(torch.int64).cumsum(-1) - 1
    target = torch.where(new_kept, target, free_old.gather(-1, rank_unkept.clamp(min=0)))
    aligned = torch.empty_like(new).scatter_(-1, target, new)
    return aligned.view(num_layers, num_replicas)


def _occurrence_keys(rows: torch.Tensor, width: int) -> torch.Tensor:
    """``expert * width + n`` where ``n`` counts earlier slots of the row with that expert."""
    order = torch.sort(rows, dim=-1, stable=True).indices
    values = rows.gather(-1, order)
    position = torch.arange(width, dtype=torch.int64).expand_as(rows)
    starts_run = torch.ones_like(values, dtype=torch.bool)
    starts_run[:, 1:] = values[:, 1:] != values[:, :-1]
    run_start = torch.where(starts_run, position, 0).cummax(-1).values
    occurrence = torch.empty_like(rows).scatter_(-1, order, position - run_start)
    return rows * width + occurrence
