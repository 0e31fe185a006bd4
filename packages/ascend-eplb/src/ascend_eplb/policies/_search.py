"""Vectorised building blocks of the search policies (flashlb, swift).

The unit of work is a *row*: one balancing problem (a layer, or a layer's node in the
hierarchical case) with ``n`` experts, ``S`` slots and ``P`` GPUs of ``k = S / P``
slots each. A row's placement is held GPU-major, like ``phy2log``: ``experts[r, s]``
is the (row-local) expert in slot ``s`` and ``loads[r, s]`` the load that replica
carries (the expert's load / its replica count). Every step works on all rows at
once; loops run over steps, never over experts.

Loads are float32 normalised so that a row's mean GPU load is 1: the search only
compares sums of a few numbers, and the final balance is measured in float64 by the
callers.
"""

from __future__ import annotations

import torch

from ascend_eplb.metrics import replica_load_bracket

# (factor on the optimal largest replica load, where the leftover slots go).
# "hot" hands leftovers to the largest replicas, as DeepSeek's greedy replication does;
# "cold" splits the heaviest single-replica experts instead, which leaves hot replicas
# larger but gives the packing more small pieces to fill GPUs with (this is what
# wins the FlashLB example).
COUNT_CANDIDATES: tuple[tuple[float, str], ...] = (
    (1.0, "hot"),
    (1.0, "cold"),
    (1.15, "cold"),
    (1.3, "cold"),
    (1.5, "cold"),
)

_EXCLUDED = 1e30  # added to a candidate's score to rule it out


def normalise(weight: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """float32 loads scaled so that each row's mean GPU load is 1 (all-zero rows stay 0)."""
    total = weight.sum(-1, keepdim=True)
    scale = torch.where(total > 0, num_gpus / total.clamp(min=1e-300), 0.0)
    return (weight * scale).to(torch.float32)


def candidate_counts(
    weight: torch.Tensor, num_slots: int, candidates=COUNT_CANDIDATES
) -> torch.Tensor:
    """Replica counts to try: [rows, C, n] int64, each row summing to ``num_slots``.

    Candidate (f, where): every expert gets ``max(1, ceil(load / (f * cap)))`` replicas,
    ``cap`` being the optimal largest replica load, then the leftover slots go one each
    to the experts first in the candidate's order (cycling if there are more leftovers
    than experts).
    """
    num_rows, num_experts = weight.shape
    cap = replica_load_bracket(weight, num_slots, iterations=16)[1]
    factors = torch.tensor([f for f, _ in candidates], dtype=weight.dtype)
    hot = torch.tensor([where == "hot" for _, where in candidates])
    if bool((factors < 1).any()):
        raise ValueError("count candidates need factors >= 1 so that the counts fit")
    limit = (cap.unsqueeze(-1) * factors).clamp(min=torch.finfo(weight.dtype).tiny)
    counts = torch.ceil(weight.unsqueeze(1) / limit.unsqueeze(-1)).clamp_(min=1)
    leftover = (num_slots - counts.sum(-1, keepdim=True)).clamp(min=0).to(torch.int64)
    piece = weight.unsqueeze(1) / counts
    # Order for the leftovers: hot = by replica load; cold = single-replica experts by
    # load, then the rest. Stable sorts break ties by expert id.
    cold_key = torch.where(counts == 1, piece, -1.0)
    key = torch.where(hot.view(1, -1, 1), piece, cold_key)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        -1, order, torch.arange(num_experts).expand_as(order).contiguous()
    )
    extra = leftover // num_experts + (rank < leftover % num_experts).to(torch.int64)
    return counts.to(torch.int64) + extra


def sorted_pieces(weight: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The replicas of each row, heaviest first: (experts, loads), both [rows, S]."""
    num_rows = weight.size(0)
    piece = weight / counts
    order = torch.sort(piece, dim=-1, descending=True, stable=True).indices
    repeats = counts.gather(-1, order).flatten()
    experts = torch.repeat_interleave(order.flatten(), repeats).view(num_rows, -1)
    loads = torch.repeat_interleave(piece.gather(-1, order).flatten(), repeats)
    return experts, loads.view(num_rows, -1)


def pack_in_rounds(
    experts: torch.Tensor, loads: torch.Tensor, num_gpus: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place sorted replicas onto GPUs, ``P`` at a time: in each round the next ``P``
    heaviest replicas go heaviest-first to the GPUs sorted lightest-first, so every GPU
    gets one replica per round and ``k`` in all. Returns GPU-major (experts, loads).
    """
    num_rows, num_slots = loads.shape
    slots_per_gpu = num_slots // num_gpus
    gpu_load = torch.zeros(num_rows, num_gpus, dtype=loads.dtype)
    destination = torch.empty(num_rows, num_slots, dtype=torch.int64)
    for round_ in range(slots_per_gpu):
        lightest_first = torch.sort(gpu_load, dim=-1, stable=True).indices
        chunk = slice(round_ * num_gpus, (round_ + 1) * num_gpus)
        destination[:, chunk] = lightest_first * slots_per_gpu + round_
        gpu_load.scatter_add_(-1, lightest_first, loads[:, chunk])
    placed_experts = torch.empty_like(experts).scatter_(-1, destination, experts)
    placed_loads = torch.empty_like(loads).scatter_(-1, destination, loads)
    return placed_experts, placed_loads


def gpu_loads(loads: torch.Tensor, num_gpus: int) -> torch.Tensor:
    return loads.view(loads.size(0), num_gpus, -1).sum(-1)


def _swap(
    experts: torch.Tensor,
    loads: torch.Tensor,
    first: torch.Tensor,
    second: torch.Tensor,
    apply: torch.Tensor,
) -> None:
    """Exchange slots ``first`` and ``second`` ([rows, m], disjoint) where ``apply``."""
    for tensor in (loads, experts):
        a = tensor.gather(-1, first)
        b = tensor.gather(-1, second)
        tensor.scatter_(-1, first, torch.where(apply, b, a))
        tensor.scatter_(-1, second, torch.where(apply, a, b))


def pair_step(
    experts: torch.Tensor,
    loads: torch.Tensor,
    gpu_load: torch.Tensor,
    shift: int,
    active: torch.Tensor,
    above: torch.Tensor,
    swaps_allowed: torch.Tensor | None,
    eps: torch.Tensor,
) -> torch.Tensor:
    """Pair the heavier half of the GPUs with the lighter half (the i-th heaviest with the
    ``(i + shift) % (P/2)``-th lightest) and make, in each pair, the one swap of replicas
    that best evens the pair, if it lowers the heavier GPU and creates no duplicate
    expert on a GPU. Only pairs whose heavy GPU is above ``above`` move, at most
    ``swaps_allowed`` per row (None: no limit), heaviest pairs first. Returns swaps made
    per row.
    """
    num_rows, num_gpus = gpu_load.shape
    half = num_gpus // 2
    k = loads.size(1) // num_gpus
    by_load = torch.sort(gpu_load, dim=-1, descending=True).indices
    heavy = by_load[:, :half]
    light = by_load[:, num_gpus - 1 - (torch.arange(half) + shift) % half]
    within = torch.arange(k)
    heavy_slots = (heavy.unsqueeze(-1) * k + within).view(num_rows, -1)
    light_slots = (light.unsqueeze(-1) * k + within).view(num_rows, -1)
    pairs = num_rows * half

    def columns(tensor: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # [k, pairs], contiguous so the broadcasts below stay fast
        return tensor.gather(-1, slots).view(pairs, k).t().contiguous()

    heavy_load, light_load = columns(loads, heavy_slots), columns(loads, light_slots)
    heavy_expert, light_expert = columns(experts, heavy_slots), columns(experts, light_slots)
    high = gpu_load.gather(-1, heavy).view(pairs)
    half_gap = (high - gpu_load.gather(-1, light).view(pairs)) * 0.5
    # A swap moving d = a - b from the heavy GPU to the light one leaves the pair's max at
    # high - half_gap + |d - half_gap|: minimise |d - half_gap|, valid when < half_gap.
    score = heavy_load.unsqueeze(1) - light_load.unsqueeze(0)
    score.sub_(half_gap).abs_()
    best, choice = score.view(k * k, pairs).min(0)
    i, j = choice // k, choice % k
    moving_out = heavy_expert.gather(0, i.unsqueeze(0))
    moving_in = light_expert.gather(0, j.unsqueeze(0))
    duplicate = (light_expert == moving_out).any(0) | (heavy_expert == moving_in).any(0)
    ok = (best < half_gap - eps.repeat_interleave(half)) & ~duplicate
    ok = ok.view(num_rows, half) & active.unsqueeze(-1)
    ok &= gpu_load.gather(-1, heavy) > above.unsqueeze(-1)
    if swaps_allowed is not None:
        ok &= ok.to(torch.int64).cumsum(-1) <= swaps_allowed.unsqueeze(-1)
    first = heavy * k + i.view(num_rows, half)
    second = light * k + j.view(num_rows, half)
    _swap(experts, loads, first, second, ok)
    return ok.sum(-1)


def peak_step(
    experts: torch.Tensor,
    loads: torch.Tensor,
    gpu_load: torch.Tensor,
    active: torch.Tensor,
    eps: torch.Tensor,
) -> torch.Tensor:
    """For the heaviest GPU of each active row, the best swap with any replica on any
    other GPU (the one that leaves the lower max of the two GPUs), made if it lowers the
    heaviest GPU and creates no duplicate expert on a GPU. Returns [rows] bool: swapped.
    """
    num_rows, num_gpus = gpu_load.shape
    num_slots = loads.size(1)
    k = num_slots // num_gpus
    high, heaviest = gpu_load.max(dim=-1)
    own_slots = heaviest.unsqueeze(-1) * k + torch.arange(k)
    own_load = loads.gather(-1, own_slots).t().contiguous()  # [k, rows]
    own_expert = experts.gather(-1, own_slots).t().contiguous()
    all_expert = experts.t().contiguous()  # [S, rows]
    half_gap = (high - gpu_load.t().repeat_interleave(k, dim=0)) * 0.5  # [S, rows]
    # New max of the two GPUs minus the old one: -half_gap + |d - half_gap| (< 0 helps).
    score = own_load.unsqueeze(1) - loads.t().contiguous().unsqueeze(0)  # [k, S, rows]
    score.sub_(half_gap).abs_().sub_(half_gap)
    # No swap may bring an expert to a GPU that already holds it, in either direction.
    on_heaviest = torch.zeros(num_rows, num_experts_bound(experts), dtype=torch.bool)
    on_heaviest.scatter_(-1, own_expert.t(), True)
    already_here = on_heaviest.gather(-1, experts).t()  # [S, rows]
    already_there = (
        (own_expert.unsqueeze(1) == all_expert.unsqueeze(0))
        .view(k, num_gpus, k, num_rows)
        .any(2, keepdim=True)
    )  # [k, P, 1, rows]: our expert i is already on that GPU
    score.view(k, num_gpus, k, num_rows).masked_fill_(already_there, _EXCLUDED)
    score.masked_fill_(already_here.unsqueeze(0), _EXCLUDED)
    best, choice = score.view(k * num_slots, num_rows).min(0)
    ok = (best < -eps) & active
    first = (heaviest * k + choice // num_slots).unsqueeze(-1)
    second = (choice % num_slots).unsqueeze(-1)
    _swap(experts, loads, first, second, ok.unsqueeze(-1))
    return ok


def num_experts_bound(experts: torch.Tensor) -> int:
    """One more than the largest expert id present (sizes per-expert scratch tensors)."""
    return int(experts.max()) + 1 if experts.numel() else 1


def improve(
    experts: torch.Tensor,
    loads: torch.Tensor,
    num_gpus: int,
    *,
    stop_at: torch.Tensor,
    above: torch.Tensor | None = None,
    budget: torch.Tensor | None = None,
    max_iterations: int = 12,
    patience: int = 1,
) -> torch.Tensor:
    """Local search that lowers each row's peak GPU load by swapping replicas.

    A row starts with ``pair_step``s; once a pair step swaps nothing, or the peak has not
    dropped for ``patience`` iterations, it gets a ``peak_step``, and after a pair step
    that swapped nothing it keeps to peak steps. A row stops when a peak step finds no
    swap, its peak is <= ``stop_at``, or its ``budget`` of expert transfers (2 per swap)
    is spent. Pairs only move when their heavy GPU is above ``above`` (default:
    ``stop_at``). Works in place on the rows that are still searching; returns the
    transfers made per row.
    """
    num_rows = loads.size(0)
    transfers = torch.zeros(num_rows, dtype=torch.int64)
    if num_rows == 0 or num_gpus < 2:
        return transfers
    above = stop_at if above is None else above
    limited = budget is not None
    unlimited = torch.iinfo(torch.int64).max // 4
    budget = torch.full((num_rows,), unlimited) if budget is None else budget.clone()
    eps = 1e-5 * loads.sum(-1) / num_gpus
    peak = gpu_loads(loads, num_gpus).amax(-1)
    stale = torch.zeros(num_rows, dtype=torch.int64)
    pairing = torch.ones(num_rows, dtype=torch.bool)
    active = (peak > stop_at) & (budget >= 2)
    for iteration in range(max_iterations):
        pair_rows = (active & pairing).nonzero().squeeze(-1)
        if pair_rows.numel():
            swaps = _on_rows(
                pair_rows,
                experts,
                loads,
                num_gpus,
                pair_step,
                iteration,
                torch.ones(pair_rows.numel(), dtype=torch.bool),
                above[pair_rows],
                budget[pair_rows] // 2 if limited else None,
                eps[pair_rows],
            )
            transfers[pair_rows] += 2 * swaps
            budget[pair_rows] -= 2 * swaps
            new_peak = gpu_loads(loads[pair_rows], num_gpus).amax(-1)
            improved = new_peak < peak[pair_rows] - eps[pair_rows]
            stale[pair_rows] = torch.where(improved, 0, stale[pair_rows] + 1)
            pairing[pair_rows] = swaps > 0
            peak[pair_rows] = new_peak
        peak_rows = (active & (~pairing | (stale >= patience)) & (budget >= 2)).nonzero()
        peak_rows = peak_rows.squeeze(-1)
        if peak_rows.numel():
            swapped = _on_rows(
                peak_rows,
                experts,
                loads,
                num_gpus,
                peak_step,
                torch.ones(peak_rows.numel(), dtype=torch.bool),
                eps[peak_rows],
            )
            transfers[peak_rows] += 2 * swapped
            budget[peak_rows] -= 2 * swapped
            stale[peak_rows] = torch.where(swapped, 0, stale[peak_rows])
            active[peak_rows] &= swapped
            peak[peak_rows] = gpu_loads(loads[peak_rows], num_gpus).amax(-1)
        active &= (peak > stop_at) & (budget >= 2)
        if not bool(active.any()):
            break
    return transfers


def _on_rows(rows, experts, loads, num_gpus, step, *args):
    """``step(experts, loads, gpu_load, *args)`` on the given rows only, written back."""
    if rows.numel() == experts.size(0):
        return step(experts, loads, gpu_loads(loads, num_gpus), *args)
    row_experts, row_loads = experts[rows], loads[rows]
    result = step(row_experts, row_loads, gpu_loads(row_loads, num_gpus), *args)
    experts[rows], loads[rows] = row_experts, row_loads
    return result


def search_placement(
    weight: torch.Tensor, num_slots: int, num_gpus: int, *, max_iterations: int = 12
) -> torch.Tensor:
    """The flashlb search for each row of ``weight`` [rows, n]: returns the GPU-major
    expert of every slot, [rows, num_slots] int64 (row-local expert ids).

    Tries every count candidate, packs each in rounds, keeps the one with the lowest
    peak per row and improves it by local search.
    """
    num_rows, num_experts = weight.shape
    if num_rows == 0:
        return torch.zeros(0, num_slots, dtype=torch.int64)
    loads = normalise(weight, num_gpus)
    candidates = COUNT_CANDIDATES if num_slots > num_experts else COUNT_CANDIDATES[:1]
    counts = candidate_counts(loads, num_slots, candidates)  # [rows, C, n]
    num_candidates = counts.size(1)
    flat_counts = counts.view(num_rows * num_candidates, num_experts)
    flat_loads = loads.repeat_interleave(num_candidates, dim=0)
    experts, pieces = pack_in_rounds(*sorted_pieces(flat_loads, flat_counts), num_gpus)
    peak = gpu_loads(pieces, num_gpus).amax(-1).view(num_rows, num_candidates)
    chosen = torch.arange(num_rows) * num_candidates + peak.argmin(-1)
    experts, pieces = experts[chosen], pieces[chosen]
    stop_at = _good_enough(pieces, num_gpus)
    improve(experts, pieces, num_gpus, stop_at=stop_at, max_iterations=max_iterations)
    return experts


GOOD_ENOUGH = 1.002  # a row's search stops within 0.2% of its mean GPU load


def _good_enough(pieces: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """Peak at which a row's search stops: ``GOOD_ENOUGH`` times the mean GPU load, or
    the bound this set of replicas cannot beat (heaviest replica + the k - 1 lightest)."""
    k = pieces.size(1) // num_gpus
    mean = pieces.sum(-1) / num_gpus
    ascending = torch.sort(pieces, dim=-1).values
    floor = ascending[:, -1] + ascending[:, : k - 1].sum(-1)
    return torch.maximum(mean * GOOD_ENOUGH, floor + 1e-6 * mean)
