"""Moving MoE tokens to the ranks that own their experts and the results back.

Two ways, chosen per batch by :func:`select_moe_comm`:

- **all-gather** (:class:`AllGatherMoEComm`): every rank gathers every rank's tokens, runs
  its local experts on the (token, choice) pairs routed to them, adds each result times its
  routing weight into a buffer of all tokens, and a reduce-scatter hands every rank the sum
  for its own tokens. One collective each way, but every rank receives all tokens.
- **all-to-all** (:class:`AllToAllMoEComm`): each (token, choice) pair goes only to the rank
  owning the chosen expert. The per-destination counts are exchanged first
  (``all_to_all_single`` of one integer per rank), then the rows with those split sizes;
  the expert outputs travel back the same way and the source rank adds them up with the
  routing weights. A rank receives about ``tokens * top_k * (ep_size - 1) / ep_size`` rows
  instead of ``tokens * (ep_size - 1)``, at the price of a count exchange and a host sync.

- **MC2** (:class:`MC2MoEComm`, npu only): torch_npu's fused exchange,
  ``npu_moe_distribute_dispatch_v2`` / ``npu_moe_distribute_combine_v2`` over a communicator
  of its own, for the batches its documented limits admit (at most 512 tokens per rank,
  hidden size 1024-7168, ...): fixed-shape outputs and no host sync, so it is also the one
  path an NPU graph can capture.

All return the same :class:`DispatchedTokens` (the rows this rank computes, grouped by
local expert) and take the experts' outputs back through ``combine``, so an MoE layer can
switch between them batch by batch. Where ranks hold one batch alike (tensor parallel, with
or without data parallel in front: a :class:`TokenGroup`), ``dispatch_shared`` /
``combine_shared`` of :class:`MoECommunication` split the batch among them, dispatch the
shares and gather the combined shares back, so every rank of the group ends with its whole
batch; ``dispatch_replicated`` is the case of one batch on every rank (vLLM's tensor parallel
+ expert parallel without data parallelism). Pure torch over ``torch.distributed``: any
backend with all-gather, reduce-scatter and all-to-all works (HCCL on an NPU, gloo on the
CPU), and torch_npu for MC2. No vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

ALL_GATHER = "allgather"
ALL_TO_ALL = "alltoall"
MC2 = "mc2"
MOE_COMM_METHODS = (ALL_GATHER, ALL_TO_ALL, MC2)

# What torch_npu's MC2 ops (the _v2 pair, Atlas A3) take, from their documentation pages:
# tokens per rank, hidden size (combine's bound), top-k, experts, EP ranks (combine's bound).
MC2_MAX_TOKENS_PER_RANK = 512
MC2_HIDDEN_SIZES = (1024, 7168)
MC2_MAX_TOP_K = 16
MC2_MAX_EXPERTS = 1024
MC2_EP_SIZES = (2, 384)

# Below this many tokens on the busiest rank, a batch goes through all-gather. Not measured
# on HCCL: small batches are bound by collective latency, where all-to-all's extra count
# exchange and host sync cost more than the rows it saves. VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS.
DEFAULT_ALL2ALL_MIN_TOKENS = 64


def select_moe_comm(
    num_tokens: int,
    ep_size: int,
    top_k: int,
    all2all_min_tokens: int = DEFAULT_ALL2ALL_MIN_TOKENS,
) -> str:
    """``"allgather"`` or ``"alltoall"`` for a batch.

    ``num_tokens`` must be the same number on every rank of the group (the most tokens any
    rank holds in this batch), or the ranks would pick different collectives and hang.

    - ``ep_size == 1``: all-gather, which then moves nothing.
    - ``top_k >= ep_size``: all-gather; all-to-all would send each token about ``top_k``
      times, at least as many rows as gathering it to every rank.
    - ``num_tokens < all2all_min_tokens``: all-gather (latency-bound batches).
    - otherwise all-to-all.
    """
    for name, value, least in (("num_tokens", num_tokens, 0), ("ep_size", ep_size, 1),
                               ("top_k", top_k, 1), ("all2all_min_tokens", all2all_min_tokens, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"select_moe_comm: {name}={value!r} is not allowed; expected an "
                             f"integer >= {least}.")
    if ep_size == 1 or top_k >= ep_size or num_tokens < all2all_min_tokens:
        return ALL_GATHER
    return ALL_TO_ALL


def _group_rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def all_gatherv(tensor: torch.Tensor, sizes: list[int],
                group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's rows of ``tensor`` along dim 0, rank after rank.

    Rank ``r`` contributes ``sizes[r]`` rows (any may be 0). The rows are padded to the
    largest count so that one ``all_gather_into_tensor`` moves them all.
    """
    rank, world_size = _group_rank_and_size(group)
    if len(sizes) != world_size or tensor.dim() == 0 or tensor.shape[0] != sizes[rank]:
        raise ValueError(f"all_gatherv: sizes {list(sizes)} must give one row count per rank "
                         f"({world_size}), with this rank's {tuple(tensor.shape)[:1]} rows at "
                         f"index {rank}.")
    if world_size == 1:
        return tensor
    most = max(sizes)
    padded = tensor.contiguous()
    if tensor.shape[0] != most:
        padded = tensor.new_zeros((most,) + tuple(tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
    out = tensor.new_empty((world_size * most,) + tuple(tensor.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    if all(size == most for size in sizes):
        return out
    return torch.cat([out[r * most: r * most + size] for r, size in enumerate(sizes)])


def reduce_scatterv(tensor: torch.Tensor, sizes: list[int],
                    group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of ``tensor`` over the ranks; rank ``r`` keeps its ``sizes[r]`` rows.

    ``tensor`` holds ``sum(sizes)`` rows, rank after rank; each rank's block is padded to
    the largest count for one ``reduce_scatter_tensor``.
    """
    rank, world_size = _group_rank_and_size(group)
    if len(sizes) != world_size or tensor.dim() == 0 or tensor.shape[0] != sum(sizes):
        raise ValueError(f"reduce_scatterv: the input has {tuple(tensor.shape)[:1]} rows; "
                         f"sizes {list(sizes)} must give one row count per rank "
                         f"({world_size}) adding up to it.")
    if world_size == 1:
        return tensor
    most = max(sizes)
    if all(size == most for size in sizes):
        padded = tensor.contiguous()
    else:
        padded = tensor.new_zeros((world_size * most,) + tuple(tensor.shape[1:]))
        start = 0
        for r, size in enumerate(sizes):
            padded[r * most: r * most + size] = tensor[start: start + size]
            start += size
    out = tensor.new_empty((most,) + tuple(tensor.shape[1:]))
    dist.reduce_scatter_tensor(out, padded, group=group)
    return out[: sizes[rank]]


@dataclass(frozen=True)
class ExpertPlacement:
    """Which rank holds each global expert, and at which local index.

    ``owner[e]`` is the rank serving global expert ``e``; ``local_index[e]`` its index among
    that rank's experts. Every expert has exactly one owner (with EPLB's redundant experts,
    the ids here are physical slots).
    """

    owner: torch.Tensor  # [num_experts] int64
    local_index: torch.Tensor  # [num_experts] int64
    ep_size: int

    def __post_init__(self) -> None:
        if self.owner.shape != self.local_index.shape or self.owner.dim() != 1:
            raise ValueError(f"ExpertPlacement: owner {tuple(self.owner.shape)} and local_index "
                             f"{tuple(self.local_index.shape)} must both be [num_experts].")
        if self.owner.numel() and (int(self.owner.min()) < 0
                                   or int(self.owner.max()) >= self.ep_size):
            raise ValueError(f"ExpertPlacement: owners must be ranks in [0, {self.ep_size}), "
                             f"got {self.owner.tolist()}.")

    @classmethod
    def linear(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """Contiguous blocks, the first ``num_experts % ep_size`` ranks one expert more
        (vLLM's ``expert_placement_strategy="linear"``)."""
        if num_experts < 1 or ep_size < 1:
            raise ValueError(f"ExpertPlacement.linear: num_experts={num_experts} and "
                             f"ep_size={ep_size} must both be >= 1.")
        base, extra = divmod(num_experts, ep_size)
        sizes = [base + (1 if rank < extra else 0) for rank in range(ep_size)]
        owner = torch.repeat_interleave(torch.arange(ep_size), torch.tensor(sizes))
        local_index = torch.cat([torch.arange(size) for size in sizes])
        return cls(owner, local_index, ep_size)

    @property
    def num_experts(self) -> int:
        return self.owner.numel()

    def num_local_experts(self, rank: int) -> int:
        return int((self.owner == rank).sum())

    def to(self, device: torch.device) -> ExpertPlacement:
        return ExpertPlacement(self.owner.to(device), self.local_index.to(device), self.ep_size)


@dataclass
class DispatchedTokens:
    """The (token, choice) rows one rank computes, grouped by local expert.

    ``hidden_states[i]`` goes through local expert ``local_expert_ids[i]``; rows of one
    expert are contiguous and ``tokens_per_expert`` counts them (a grouped matmul's group
    list). ``topk_weights[i]`` is the row's routing weight, ``expert_ids[i]`` its global
    expert. ``combine`` needs the rest.
    """

    hidden_states: torch.Tensor  # [N, H]
    local_expert_ids: torch.Tensor  # [N] int64
    expert_ids: torch.Tensor  # [N] int64, global ids
    topk_weights: torch.Tensor  # [N]
    tokens_per_expert: torch.Tensor  # [num_local_experts] int64
    method: str
    handle: Any = field(repr=False, default=None)
    # Set by MoECommunication.dispatch_shared: the ranks holding this batch alike, and each
    # one's share of its tokens.
    shares: list[int] | None = None
    token_group: TokenGroup | None = field(repr=False, default=None)


@dataclass(frozen=True)
class TokenGroup:
    """Ranks of the EP group that hold one batch alike: ``size`` consecutive EP ranks (the
    tensor-parallel ranks of one data-parallel rank), this one ``rank`` among them; ``group``
    their process group (None when ``size`` is 1)."""

    group: dist.ProcessGroup | None
    rank: int
    size: int


class _MoECommBase:
    """Shared set-up and input checks of the two methods."""

    method: str

    def __init__(self, group: dist.ProcessGroup | None, placement: ExpertPlacement,
                 *, validate: bool = True) -> None:
        self.group = group
        self.rank, self.world_size = _group_rank_and_size(group)
        if placement.ep_size != self.world_size:
            raise ValueError(f"{type(self).__name__}: the placement is for ep_size="
                             f"{placement.ep_size}, but the group has {self.world_size} ranks.")
        self.placement = placement
        self.num_local_experts = placement.num_local_experts(self.rank)
        self.validate = validate

    def _check_routing(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> None:
        name = type(self).__name__
        if hidden_states.dim() != 2:
            raise ValueError(f"{name}.dispatch: hidden_states must be [num_tokens, hidden], "
                             f"got shape {tuple(hidden_states.shape)}.")
        num_tokens = hidden_states.shape[0]
        if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
            raise ValueError(f"{name}.dispatch: topk_ids must be [num_tokens={num_tokens}, "
                             f"top_k], got shape {tuple(topk_ids.shape)}.")
        if topk_weights.shape != topk_ids.shape:
            raise ValueError(f"{name}.dispatch: topk_weights {tuple(topk_weights.shape)} must "
                             f"have the shape of topk_ids {tuple(topk_ids.shape)}.")
        if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
            raise ValueError(f"{name}.dispatch: topk_ids must be integers, got {topk_ids.dtype}.")
        if not topk_weights.dtype.is_floating_point:
            raise ValueError(f"{name}.dispatch: topk_weights must be floating point, got "
                             f"{topk_weights.dtype}.")
        if self.validate and topk_ids.numel():
            low, high = int(topk_ids.min()), int(topk_ids.max())
            if low < 0 or high >= self.placement.num_experts:
                bad = low if low < 0 else high
                raise ValueError(f"{name}.dispatch: expert id {bad} in topk_ids is outside the "
                                 f"global experts [0, {self.placement.num_experts}).")

    @staticmethod
    def _check_output(name: str, expert_output: torch.Tensor,
                      dispatched: DispatchedTokens) -> None:
        rows = dispatched.hidden_states.shape[0]
        if expert_output.dim() != 2 or expert_output.shape[0] != rows:
            raise ValueError(f"{name}.combine: expert_output must be [{rows}, hidden] (one row "
                             f"per dispatched row), got shape {tuple(expert_output.shape)}.")

    def _group_by_expert(self, local_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=self.num_local_experts)
        return order, counts


@dataclass
class GatheredTokens:
    """Every rank's tokens, rank after rank (``sizes[r]`` rows from rank ``r``)."""

    hidden_states: torch.Tensor  # [sum(sizes), H]
    topk_weights: torch.Tensor  # [sum(sizes), K]
    topk_ids: torch.Tensor  # [sum(sizes), K]
    sizes: list[int]
    extra: list[torch.Tensor] = field(default_factory=list)


class AllGatherMoEComm(_MoECommBase):
    """Tokens gathered to every rank; partial results reduce-scattered back."""

    method = ALL_GATHER

    def token_counts(self, num_tokens: int, device: torch.device) -> list[int]:
        """Every rank's token count (one small all-gather and a host sync)."""
        if self.world_size == 1:
            return [num_tokens]
        mine = torch.tensor([num_tokens], dtype=torch.int64, device=device)
        every = torch.empty(self.world_size, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(every, mine, group=self.group)
        return [int(n) for n in every.tolist()]

    def gather(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """All ranks' ``tensor`` rows concatenated; rank ``r`` gives ``sizes[r]`` rows."""
        return all_gatherv(tensor, sizes, self.group)

    def reduce_scatter(self, tensor: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Sum of ``tensor`` over the ranks, rank ``r`` keeping rows of its own tokens."""
        return reduce_scatterv(tensor, sizes, self.group)

    def gather_tokens(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, sizes: list[int] | None = None,
                      extra: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> GatheredTokens:
        """All ranks' tokens with their routing (and per-token ``extra`` tensors)."""
        self._check_routing(hidden_states, topk_weights, topk_ids)
        return self._gather_tokens(hidden_states, topk_weights, topk_ids, sizes, extra)

    def _gather_tokens(self, hidden_states, topk_weights, topk_ids, sizes, extra):
        num_tokens = hidden_states.shape[0]
        for i, tensor in enumerate(extra):
            if tensor.shape[:1] != (num_tokens,):
                raise ValueError(f"{type(self).__name__}: extra tensor {i} of shape "
                                 f"{tuple(tensor.shape)} must have one row per token "
                                 f"({num_tokens}).")
        if sizes is None:
            sizes = self.token_counts(num_tokens, hidden_states.device)
        return GatheredTokens(self.gather(hidden_states, sizes), self.gather(topk_weights, sizes),
                              self.gather(topk_ids, sizes), list(sizes),
                              [self.gather(tensor, sizes) for tensor in extra])

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, sizes: list[int] | None = None) -> DispatchedTokens:
        """Gather every rank's tokens; keep the (token, choice) rows of local experts."""
        self._check_routing(hidden_states, topk_weights, topk_ids)
        return self._dispatch(hidden_states, topk_weights, topk_ids, sizes)

    def _dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, sizes: list[int] | None) -> DispatchedTokens:
        gathered = self._gather_tokens(hidden_states, topk_weights, topk_ids, sizes, ())
        return self._keep_local(gathered, topk_ids.shape[1])

    def _keep_local(self, gathered: GatheredTokens, top_k: int) -> DispatchedTokens:
        """The (token, choice) rows of ``gathered`` that go to this rank's experts."""
        flat_ids = gathered.topk_ids.reshape(-1).long()
        owner = self.placement.owner.to(flat_ids.device)
        pairs = torch.nonzero(owner[flat_ids] == self.rank).reshape(-1)
        expert_ids = flat_ids[pairs]
        local_ids = self.placement.local_index.to(flat_ids.device)[expert_ids]
        order, counts = self._group_by_expert(local_ids)
        pairs = pairs[order]
        token_index = torch.div(pairs, top_k, rounding_mode="floor")
        return DispatchedTokens(
            hidden_states=gathered.hidden_states[token_index],
            local_expert_ids=local_ids[order],
            expert_ids=expert_ids[order],
            topk_weights=gathered.topk_weights.reshape(-1)[pairs],
            tokens_per_expert=counts,
            method=self.method,
            handle=(token_index, gathered.sizes),
        )

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchedTokens,
                apply_weights: bool = True) -> torch.Tensor:
        """This rank's tokens: the sum over their choices of weight * expert output."""
        _, sizes = dispatched.handle
        return self.reduce_scatter(self.partial_sums(expert_output, dispatched, apply_weights),
                                   sizes)

    def partial_sums(self, expert_output: torch.Tensor, dispatched: DispatchedTokens,
                     apply_weights: bool = True) -> torch.Tensor:
        """Every gathered token's sum over the choices this rank computed (zero rows for
        tokens none of whose experts are here), before the sum over the ranks."""
        self._check_output(type(self).__name__, expert_output, dispatched)
        token_index, sizes = dispatched.handle
        partial = torch.zeros((sum(sizes), expert_output.shape[1]), dtype=torch.float32,
                              device=expert_output.device)
        rows = expert_output.float()
        if apply_weights:
            rows = rows * dispatched.topk_weights.float().unsqueeze(1)
        partial.index_add_(0, token_index, rows)
        return partial.to(expert_output.dtype)


class AllToAllMoEComm(_MoECommBase):
    """Each (token, choice) row sent to its expert's owner and back."""

    method = ALL_TO_ALL

    def _exchange(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        out = tensor.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv,
                               input_split_sizes=send, group=self.group)
        return out

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor,
                 extra: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> DispatchedTokens:
        """Send each row to its expert's owner. ``extra`` per-token tensors travel along;
        they come back, permuted like the rows, in ``handle["extra"]``."""
        self._check_routing(hidden_states, topk_weights, topk_ids)
        return self._dispatch(hidden_states, topk_weights, topk_ids, extra)

    def _dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor,
                  extra: list[torch.Tensor] | tuple[torch.Tensor, ...] = ()) -> DispatchedTokens:
        for i, tensor in enumerate(extra):
            if tensor.shape[:1] != (hidden_states.shape[0],):
                raise ValueError(f"{type(self).__name__}: extra tensor {i} of shape "
                                 f"{tuple(tensor.shape)} must have one row per token "
                                 f"({hidden_states.shape[0]}).")
        num_tokens, top_k = topk_ids.shape
        device = hidden_states.device
        flat_ids = topk_ids.reshape(-1).long()
        owner = self.placement.owner.to(device)
        local_index = self.placement.local_index.to(device)
        destination = owner[flat_ids]
        # Rows in destination order, within a destination by the expert's local index.
        send_order = torch.argsort(destination * self.placement.num_experts
                                   + local_index[flat_ids], stable=True)
        send_counts = torch.bincount(destination, minlength=self.world_size)
        if self.world_size == 1:
            recv_counts = send_counts
        else:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send = [int(n) for n in send_counts.tolist()]
        recv = [int(n) for n in recv_counts.tolist()]
        token_index = torch.div(send_order, top_k, rounding_mode="floor")
        received_ids = self._exchange(flat_ids[send_order], send, recv)
        received_weights = self._exchange(topk_weights.reshape(-1)[send_order], send, recv)
        received = self._exchange(hidden_states[token_index], send, recv)
        received_extra = [self._exchange(tensor[token_index], send, recv) for tensor in extra]
        # Rows arrive source after source; group them by local expert for the experts.
        local_ids = local_index[received_ids]
        order, counts = self._group_by_expert(local_ids)
        return DispatchedTokens(
            hidden_states=received[order],
            local_expert_ids=local_ids[order],
            expert_ids=received_ids[order],
            topk_weights=received_weights[order],
            tokens_per_expert=counts,
            method=self.method,
            handle={"send_order": send_order, "order": order, "send": send, "recv": recv,
                    "num_tokens": num_tokens, "top_k": top_k,
                    "topk_weights": topk_weights,
                    "extra": [tensor[order] for tensor in received_extra]},
        )

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchedTokens,
                apply_weights: bool = True) -> torch.Tensor:
        """This rank's tokens: the sum over their choices of weight * expert output."""
        self._check_output(type(self).__name__, expert_output, dispatched)
        handle = dispatched.handle
        hidden = expert_output.shape[1]
        arrived = torch.empty_like(expert_output)
        arrived[handle["order"]] = expert_output
        returned = self._exchange(arrived, handle["recv"], handle["send"])
        num_tokens, top_k = handle["num_tokens"], handle["top_k"]
        per_choice = torch.empty((num_tokens * top_k, hidden), dtype=torch.float32,
                                 device=expert_output.device)
        per_choice[handle["send_order"]] = returned.float()
        per_choice = per_choice.view(num_tokens, top_k, hidden)
        if apply_weights:
            per_choice = per_choice * handle["topk_weights"].float().unsqueeze(2)
        return per_choice.sum(dim=1).to(expert_output.dtype)


def _capturing(device: torch.device) -> bool:
    """Whether an NPU graph is capturing on ``device``'s stream now."""
    if device.type != "npu":
        return False
    return bool(torch.npu.is_current_stream_capturing())


class MC2MoEComm(_MoECommBase):
    """torch_npu's MC2 dispatch / combine (``npu_moe_distribute_dispatch_v2`` /
    ``_combine_v2``) over the communicator named ``comm_name``, which no other op may use.

    The ops place ``num_experts / ep_size`` experts on each rank in order, so the placement
    must be that one (vLLM's linear placement with an even split, or EPLB's slots). Every
    rank passes the same ``batch_size`` (the most tokens any rank has): its tokens are padded
    to it and the padding masked out (``x_active_mask``), so every shape is fixed by
    ``batch_size`` alone. ``hidden_states`` of the result are all of the op's ``expand_x``
    rows (``batch_size * ep_size * min(local experts, top_k)``); the rows past
    ``tokens_per_expert.sum()`` are padding, given the last local expert so that an experts
    kernel reading every row stays in range, and combine ignores them.
    """

    method = MC2

    def __init__(self, group: dist.ProcessGroup | None, placement: ExpertPlacement,
                 comm_name: str, *, validate: bool = True) -> None:
        super().__init__(group, placement, validate=validate)
        self.comm_name = comm_name
        experts, ranks = placement.num_experts, self.world_size
        self.local = experts // ranks
        expected = ExpertPlacement.linear(experts, ranks) if experts % ranks == 0 else None
        self.placement_fits = expected is not None and (
            torch.equal(placement.owner.cpu(), expected.owner)
            and torch.equal(placement.local_index.cpu(), expected.local_index))

    def why_not(self, hidden_size: int, dtype: torch.dtype, top_k: int) -> str | None:
        """Why the ops cannot serve a layer of this shape (None when they can)."""
        import torch_npu

        low, high = MC2_HIDDEN_SIZES
        if not hasattr(torch_npu, "npu_moe_distribute_dispatch_v2"):
            return "this torch_npu has no npu_moe_distribute_dispatch_v2"
        if not MC2_EP_SIZES[0] <= self.world_size <= MC2_EP_SIZES[1]:
            return f"ep_size {self.world_size} is outside {list(MC2_EP_SIZES)}"
        if not low <= hidden_size <= high:
            return f"hidden size {hidden_size} is outside [{low}, {high}]"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"dtype {dtype} is not float16 or bfloat16"
        if not 1 <= top_k <= MC2_MAX_TOP_K:
            return f"top_k {top_k} is above {MC2_MAX_TOP_K}"
        if self.placement.num_experts > MC2_MAX_EXPERTS:
            return f"{self.placement.num_experts} experts are above {MC2_MAX_EXPERTS}"
        if not self.placement_fits:
            return (f"the experts are not {self.placement.num_experts // self.world_size} "
                    f"per rank in order (placement {self.placement.owner.tolist()})")
        return None

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, batch_size: int) -> DispatchedTokens:
        import torch_npu

        self._check_routing(hidden_states, topk_weights, topk_ids)
        num_tokens, top_k = topk_ids.shape
        if not num_tokens <= batch_size <= MC2_MAX_TOKENS_PER_RANK:
            raise ValueError(f"MC2MoEComm.dispatch: batch_size={batch_size} must hold this "
                             f"rank's {num_tokens} tokens and be at most "
                             f"{MC2_MAX_TOKENS_PER_RANK}.")
        pad = batch_size - num_tokens
        ids = topk_ids.to(torch.int32)
        x = hidden_states
        mask = None
        if pad:
            # Padding rows pick distinct experts, as the op requires of every row.
            filler = torch.arange(top_k, dtype=torch.int32, device=ids.device)
            ids = torch.cat([ids, filler.expand(pad, top_k)])
            x = torch.cat([x, x.new_zeros((pad, x.shape[1]))])
            mask = torch.arange(batch_size, device=x.device) < num_tokens
        expand_x, _, assist, counts, recv_counts, _, _ = \
            torch_npu.npu_moe_distribute_dispatch_v2(
                x, ids, self.comm_name, self.world_size, self.rank,
                self.placement.num_experts, x_active_mask=mask, expert_token_nums_type=1)
        rows = expand_x.shape[0]
        ends = torch.cumsum(counts, 0)
        local_ids = torch.searchsorted(ends, torch.arange(rows, device=ends.device),
                                       right=True).clamp(max=self.local - 1)
        weights = torch.ones(rows, dtype=topk_weights.dtype, device=topk_weights.device)
        return DispatchedTokens(
            hidden_states=expand_x, local_expert_ids=local_ids,
            expert_ids=local_ids + self.rank * self.local, topk_weights=weights,
            tokens_per_expert=counts, method=self.method,
            handle={"ids": ids, "assist": assist, "recv_counts": recv_counts, "mask": mask,
                    "num_tokens": num_tokens, "topk_weights": topk_weights})

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchedTokens,
                apply_weights: bool = True) -> torch.Tensor:
        import torch_npu

        self._check_output(type(self).__name__, expert_output, dispatched)
        handle = dispatched.handle
        ids = handle["ids"]
        scales = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
        if apply_weights:
            scales[: handle["num_tokens"]] = handle["topk_weights"].float()
        out = torch_npu.npu_moe_distribute_combine_v2(
            expert_output, ids, handle["assist"], handle["recv_counts"], scales,
            self.comm_name, self.world_size, self.rank, self.placement.num_experts,
            x_active_mask=handle["mask"])
        return out[: handle["num_tokens"]]


def make_moe_comm(method: str, group: dist.ProcessGroup | None, placement: ExpertPlacement,
                  **kwargs: Any) -> AllGatherMoEComm | AllToAllMoEComm:
    """The communication object for ``method`` (``"allgather"`` or ``"alltoall"``)."""
    if method == ALL_GATHER:
        return AllGatherMoEComm(group, placement, **kwargs)
    if method == ALL_TO_ALL:
        return AllToAllMoEComm(group, placement, **kwargs)
    raise ValueError(f"Unknown MoE communication method {method!r}; expected "
                     f"{ALL_GATHER} or {ALL_TO_ALL} (MC2 needs a communicator name: "
                     f"MoECommunication's mc2_comm_name).")


class MoECommunication:
    """Dispatch/combine that picks its path for each batch.

    Every rank must call ``dispatch`` for the same batch. Unless the caller passes
    ``max_tokens`` (the most tokens any rank holds, the same on every rank, e.g. from the
    data-parallel metadata), the ranks first all-gather their token counts, which the
    all-gather path reuses. ``combine`` follows the method its ``dispatch`` took.

    With ``mc2`` (npu: torch_npu's MC2 ops over a communicator of their own), the shared
    dispatch takes MC2 for every batch it serves (:meth:`select`), and an NPU graph being
    captured must be served by it.
    """

    def __init__(self, group: dist.ProcessGroup | None, placement: ExpertPlacement,
                 *, all2all_min_tokens: int | None = None, validate: bool = True,
                 mc2_comm_name: str | None = None) -> None:
        if all2all_min_tokens is None:
            from ascend_core import envs

            all2all_min_tokens = envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS
        self.all2all_min_tokens = all2all_min_tokens
        self.all_gather = AllGatherMoEComm(group, placement, validate=validate)
        self.all_to_all = AllToAllMoEComm(group, placement, validate=validate)
        self.mc2 = (MC2MoEComm(group, placement, mc2_comm_name, validate=validate)
                    if mc2_comm_name is not None else None)
        # mc2_why_not per layer shape: asked on every batch, fixed for a layer.
        self._mc2_why_not: dict[tuple[int, torch.dtype, int], str | None] = {}
        self.world_size = self.all_gather.world_size
        self.rank = self.all_gather.rank
        self.group = group
        # Batches dispatched per method, by this object (what a test or a log can read).
        self.counts = {method: 0 for method in MOE_COMM_METHODS}

    def mc2_why_not(self, hidden_size: int, dtype: torch.dtype, top_k: int) -> str | None:
        """Why MC2 cannot serve a layer of this shape here (None when it can)."""
        key = (hidden_size, dtype, top_k)
        if key not in self._mc2_why_not:
            self._mc2_why_not[key] = (
                "no MC2 communicator (not the npu target's EP group)" if self.mc2 is None
                else self.mc2.why_not(hidden_size, dtype, top_k))
        return self._mc2_why_not[key]

    def select(self, max_tokens: int, top_k: int,
               hidden_states: torch.Tensor | None = None,
               max_share: int | None = None) -> str:
        """The path of a batch whose busiest rank holds ``max_tokens`` tokens and sends
        ``max_share`` of them (default: all): MC2 when it serves the batch
        (``hidden_states``: any rank's rows, for their shape and dtype; at most 512 tokens
        sent per rank), else :func:`select_moe_comm`'s all-gather or all-to-all by
        ``max_tokens``. While an NPU graph captures, only MC2 will do (the other paths size
        their tensors on the host)."""
        if hidden_states is not None:
            sent = max_tokens if max_share is None else max_share
            why = self.mc2_why_not(hidden_states.shape[-1], hidden_states.dtype, top_k)
            if why is None and sent > MC2_MAX_TOKENS_PER_RANK:
                why = f"{sent} tokens sent by a rank are above {MC2_MAX_TOKENS_PER_RANK}"
            if why is None:
                return MC2
            if _capturing(hidden_states.device):
                raise RuntimeError(f"an NPU graph can capture the MoE token exchange only "
                                   f"through MC2, which cannot serve this batch: {why}.")
        return select_moe_comm(max_tokens, self.world_size, top_k, self.all2all_min_tokens)

    def dispatch(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, max_tokens: int | None = None) -> DispatchedTokens:
        # Checked before any collective, so a bad batch fails on its rank without a hang
        # in a collective the other ranks already entered.
        self.all_gather._check_routing(hidden_states, topk_weights, topk_ids)
        sizes = None
        if max_tokens is None:
            sizes = self.all_gather.token_counts(hidden_states.shape[0], hidden_states.device)
            max_tokens = max(sizes)
        if self.select(max_tokens, max(topk_ids.shape[1], 1)) == ALL_TO_ALL:
            self.counts[ALL_TO_ALL] += 1
            return self.all_to_all._dispatch(hidden_states, topk_weights, topk_ids)
        self.counts[ALL_GATHER] += 1
        return self.all_gather._dispatch(hidden_states, topk_weights, topk_ids, sizes)

    def combine(self, expert_output: torch.Tensor, dispatched: DispatchedTokens,
                apply_weights: bool = True) -> torch.Tensor:
        if dispatched.shares is not None:
            raise ValueError("MoECommunication.combine: these rows came from "
                             "dispatch_shared; combine them with combine_shared.")
        comm = self.all_to_all if dispatched.method == ALL_TO_ALL else self.all_gather
        return comm.combine(expert_output, dispatched, apply_weights)

    # --- tokens that several ranks hold alike -----------------------------------------------

    @staticmethod
    def even_shares(num_tokens: int, parts: int) -> list[int]:
        """An even split of ``num_tokens`` over ``parts``, the first parts one more."""
        base, extra = divmod(num_tokens, parts)
        return [base + (1 if part < extra else 0) for part in range(parts)]

    def shares(self, num_tokens: int) -> list[int]:
        """An even split of ``num_tokens`` over the ranks, the first ranks one more."""
        return self.even_shares(num_tokens, self.world_size)

    def whole_group(self) -> TokenGroup:
        """Every rank of the group as one token group (no data parallelism)."""
        return TokenGroup(self.group, self.rank, self.world_size)

    def dispatch_shared(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, *, token_group: TokenGroup,
                        tokens_per_group: list[int]) -> DispatchedTokens:
        """Dispatch a batch that the ``token_group.size`` ranks of this rank's token group
        hold alike; ``tokens_per_group``: the batch size of every token group, in EP rank
        order (the data-parallel ranks' token counts; the same list on every rank).

        Rank ``i`` of a token group takes the ``i``-th even share of its batch; the path is
        chosen from the largest batch (MC2's limit: from the largest share), the same choice
        everywhere without an exchange:

        - all-gather with one token group (every rank holds the whole batch): nothing moves,
          each rank keeps the (token, choice) rows of its experts;
        - otherwise each share travels by all-gather, all-to-all or MC2.

        :meth:`combine_shared` gives every rank its token group's whole batch back.
        """
        self.all_gather._check_routing(hidden_states, topk_weights, topk_ids)
        num_tokens, top_k = topk_ids.shape
        size = token_group.size
        groups = self.world_size // size if size >= 1 else 0
        block = self.rank // size if size >= 1 else 0
        if (size < 1 or self.world_size % size or len(tokens_per_group) != groups
                or not 0 <= token_group.rank < size or self.rank % size != token_group.rank
                or tokens_per_group[block] != num_tokens):
            raise ValueError(f"MoECommunication.dispatch_shared: EP rank {self.rank} of "
                             f"{self.world_size} with token groups of {size} rank(s) (this one "
                             f"rank {token_group.rank} of its group) needs one batch size per "
                             f"group ({groups}), this group's equal to its {num_tokens} tokens; "
                             f"got {list(tokens_per_group)}.")
        shares = self.even_shares(num_tokens, size)
        every_share = [share for tokens in tokens_per_group
                       for share in self.even_shares(tokens, size)]
        most = max(every_share)
        method = self.select(max(tokens_per_group), max(top_k, 1), hidden_states, most)
        self.counts[method] += 1
        if method == ALL_GATHER and size == self.world_size:
            gathered = GatheredTokens(hidden_states, topk_weights, topk_ids, [num_tokens])
            dispatched = self.all_gather._keep_local(gathered, top_k)
        else:
            start = sum(shares[: token_group.rank])
            mine = slice(start, start + shares[token_group.rank])
            rows = (hidden_states[mine], topk_weights[mine], topk_ids[mine])
            if method == MC2:
                dispatched = self.mc2.dispatch(*rows, batch_size=max(most, 1))
            elif method == ALL_TO_ALL:
                dispatched = self.all_to_all._dispatch(*rows)
            else:
                dispatched = self.all_gather._dispatch(*rows, every_share)
        dispatched.shares = shares
        dispatched.token_group = token_group
        return dispatched

    def combine_shared(self, expert_output: torch.Tensor, dispatched: DispatchedTokens,
                       apply_weights: bool = True) -> torch.Tensor:
        """Every token's sum over its choices of weight * expert output, the token group's
        whole batch on every rank of it: with one token group on the all-gather path, the
        partial sums all-reduced; otherwise each share combined on its rank and the shares
        gathered within the token group."""
        token_group = dispatched.token_group
        if dispatched.shares is None or token_group is None:
            raise ValueError("MoECommunication.combine_shared: these rows came from "
                             "dispatch, not dispatch_shared; combine them with combine.")
        if dispatched.method == ALL_GATHER and token_group.size == self.world_size:
            partial = self.all_gather.partial_sums(expert_output, dispatched, apply_weights)
            if self.world_size > 1:
                dist.all_reduce(partial, group=self.group)
            return partial
        comm = {ALL_GATHER: self.all_gather, ALL_TO_ALL: self.all_to_all,
                MC2: self.mc2}[dispatched.method]
        mine = comm.combine(expert_output, dispatched, apply_weights)
        if token_group.size == 1:
            return mine
        return all_gatherv(mine, dispatched.shares, token_group.group)

    def dispatch_replicated(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> DispatchedTokens:
        """:meth:`dispatch_shared` of a batch every rank holds in full and alike (tensor-
        parallel attention in front of expert-parallel MoE without data parallelism: vLLM's
        TP + EP)."""
        return self.dispatch_shared(hidden_states, topk_weights, topk_ids,
                                    token_group=self.whole_group(),
                                    tokens_per_group=[hidden_states.shape[0]])

    def combine_replicated(self, expert_output: torch.Tensor, dispatched: DispatchedTokens,
                           apply_weights: bool = True) -> torch.Tensor:
        """:meth:`combine_shared`: the whole batch's output on every rank."""
        return self.combine_shared(expert_output, dispatched, apply_weights)
