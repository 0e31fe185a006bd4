"""MoE routing: the experts each token goes to, and with which weight.

Shapes: ``gating_logits`` is ``[T, E]`` (tokens x experts, the router's output). Both ops
return ``(weights [T, k] float32, ids [T, k] int32)``, best expert first.

Semantics are vLLM's (``vllm/model_executor/layers/fused_moe/router``), computed in
float32 whatever the input dtype, as vLLM's fused kernels and its CPU router do. Where
vLLM leaves an order open (``torch.topk`` among equal scores) these ops fix one: the
lower expert (or group) id wins a tie, so every backend returns the same ids.

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| topk_softmax | yes | yes | ``npu_moe_gating_top_k_softmax`` |
| grouped_topk | yes | yes | ``npu_moe_gating_top_k`` |
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import NPU, REFERENCE, TRITON, require_float, resolve_backend
from ascend_kernels.npu_ops.routing import grouped_topk_problem, topk_softmax_problem

SCORING_FUNCS = ("softmax", "sigmoid")


def _top_k_lowest_index_first(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest entries of each row, largest first; equal values keep index order."""
    values, order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], order[:, :k]


def _check_gating_logits(op: str, gating_logits: torch.Tensor) -> None:
    require_float(op, "gating_logits", gating_logits)
    if gating_logits.dim() != 2:
        raise ValueError(
            f"{op}: gating_logits must be 2-D [tokens, experts], got shape "
            f"{tuple(gating_logits.shape)}"
        )
    if gating_logits.shape[1] == 0:
        raise ValueError(f"{op}: gating_logits has no experts (shape "
                         f"{tuple(gating_logits.shape)}); it needs at least one column")


def _check_count(op: str, name: str, value: object, low: int, high: int, high_says: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{op}: {name}={value} is out of range; it must be in "
                         f"[{low}, {high}] ({high_says})")


def _triton_row_problem(num_experts: int) -> str | None:
    from ascend_kernels.triton_kernels import row_block_problem  # does not import triton

    return row_block_problem(num_experts)


def _empty_result(tokens: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(tokens, k, dtype=torch.float32, device=device),
            torch.empty(tokens, k, dtype=torch.int32, device=device))


# --- topk_softmax -------------------------------------------------------------------------


def topk_softmax_reference(gating_logits: torch.Tensor, topk: int,
                           renormalize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    probs = gating_logits.float().softmax(dim=-1)
    weights, ids = _top_k_lowest_index_first(probs, topk)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def topk_softmax(gating_logits: torch.Tensor, topk: int, renormalize: bool = False, *,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, then the ``topk`` most probable ones (vLLM's
    ``fused_topk`` with ``scoring_func="softmax"``).

    ``renormalize`` rescales each token's ``topk`` weights to sum to one.
    Returns ``(weights [T, topk] float32, ids [T, topk] int32)``, largest weight first.
    """
    op = "topk_softmax"
    _check_gating_logits(op, gating_logits)
    num_experts = gating_logits.shape[1]
    _check_count(op, "topk", topk, 1, num_experts, "the number of experts")
    unsupported = {NPU: topk_softmax_problem(topk),
                   TRITON: _triton_row_problem(num_experts)}
    chosen = resolve_backend(op, gating_logits, (REFERENCE, TRITON, NPU), backend, unsupported)
    if gating_logits.shape[0] == 0:
        return _empty_result(0, topk, gating_logits.device)
    if chosen == TRITON:
        from ascend_kernels.triton_kernels.routing import topk_softmax_triton

        return topk_softmax_triton(gating_logits, topk, renormalize)
    if chosen == NPU:
        from ascend_kernels.npu_ops.routing import topk_softmax_npu

        return topk_softmax_npu(gating_logits, topk, renormalize)
    return topk_softmax_reference(gating_logits, topk, renormalize)


# --- grouped_topk -------------------------------------------------------------------------


def grouped_topk_reference(gating_logits: torch.Tensor, topk: int, renormalize: bool,
                           num_expert_group: int, topk_group: int,
                           scoring_func: str = "softmax",
                           e_score_correction_bias: torch.Tensor | None = None,
                           routed_scaling_factor: float = 1.0,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, num_experts = gating_logits.shape
    logits = gating_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()
    # The bias steers which experts are chosen; the weights stay the unbiased scores.
    if e_score_correction_bias is not None:
        selection = scores + e_score_correction_bias.float().unsqueeze(0)
    else:
        selection = scores
    grouped = selection.view(tokens, num_expert_group, num_experts // num_expert_group)
    if e_score_correction_bias is not None:
        top_two = grouped.topk(2, dim=-1).values
        group_scores = top_two[..., 0] + top_two[..., 1]
    else:
        group_scores = grouped.max(dim=-1).values
    _, group_ids = _top_k_lowest_index_first(group_scores, topk_group)
    group_kept = torch.zeros(tokens, num_expert_group, dtype=torch.bool, device=logits.device)
    group_kept.scatter_(1, group_ids, True)
    expert_kept = group_kept.repeat_interleave(num_experts // num_expert_group, dim=1)
    _, ids = _top_k_lowest_index_first(selection.masked_fill(~expert_kept, float("-inf")), topk)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights.contiguous(), ids.to(torch.int32).contiguous()


def _check_grouped_args(gating_logits: torch.Tensor, topk: int, num_expert_group: int,
                        topk_group: int, scoring_func: str,
                        e_score_correction_bias: torch.Tensor | None,
                        routed_scaling_factor: float) -> None:
    op = "grouped_topk"
    _check_gating_logits(op, gating_logits)
    num_experts = gating_logits.shape[1]
    if scoring_func not in SCORING_FUNCS:
        raise ValueError(f"{op}: unknown scoring_func {scoring_func!r}; use one of "
                         f"{SCORING_FUNCS}")
    _check_count(op, "num_expert_group", num_expert_group, 1, num_experts,
                 "the number of experts")
    if num_experts % num_expert_group:
        raise ValueError(f"{op}: {num_experts} experts do not split into "
                         f"num_expert_group={num_expert_group} equal groups; use a divisor "
                         f"of {num_experts}")
    _check_count(op, "topk_group", topk_group, 1, num_expert_group, "num_expert_group")
    group_size = num_experts // num_expert_group
    _check_count(op, "topk", topk, 1, topk_group * group_size,
                 "topk_group * experts per group")
    if isinstance(routed_scaling_factor, bool) or not isinstance(routed_scaling_factor,
                                                                 (int, float)):
        raise TypeError(f"{op}: routed_scaling_factor must be a float, got "
                        f"{type(routed_scaling_factor).__name__}")
    if e_score_correction_bias is not None:
        require_float(op, "e_score_correction_bias", e_score_correction_bias)
        if tuple(e_score_correction_bias.shape) != (num_experts,):
            raise ValueError(f"{op}: e_score_correction_bias has shape "
                             f"{tuple(e_score_correction_bias.shape)}; it must be "
                             f"({num_experts},), one value per expert")
        if e_score_correction_bias.device != gating_logits.device:
            raise ValueError(f"{op}: e_score_correction_bias is on "
                             f"{e_score_correction_bias.device} but gating_logits on "
                             f"{gating_logits.device}; put them on one device")
        if group_size < 2:
            raise ValueError(f"{op}: with e_score_correction_bias a group is scored by its "
                             f"two best experts, but num_expert_group={num_expert_group} "
                             f"leaves {group_size} expert per group; use fewer groups")


def grouped_topk(gating_logits: torch.Tensor, topk: int, renormalize: bool,
                 num_expert_group: int, topk_group: int, scoring_func: str = "softmax",
                 e_score_correction_bias: torch.Tensor | None = None,
                 routed_scaling_factor: float = 1.0, *,
                 backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2/V3 grouped routing (vLLM's ``grouped_topk``).

    1. scores = softmax or sigmoid of the logits (``scoring_func``);
    2. selection scores = scores + ``e_score_correction_bias`` (when given);
    3. the experts split into ``num_expert_group`` equal groups; a group scores its best
       selection score, or the sum of its best two when a bias is given;
    4. the ``topk_group`` best groups stay, and the ``topk`` best experts by selection
       score among them are chosen;
    5. weights are the chosen experts' unbiased scores, divided by their sum when
       ``renormalize``, then multiplied by ``routed_scaling_factor``.

    Returns ``(weights [T, topk] float32, ids [T, topk] int32)``, best selection first.
    """
    _check_grouped_args(gating_logits, topk, num_expert_group, topk_group, scoring_func,
                        e_score_correction_bias, routed_scaling_factor)
    num_experts = gating_logits.shape[1]
    unsupported = {NPU: grouped_topk_problem(num_experts, num_expert_group),
                   TRITON: _triton_row_problem(num_experts)}
    chosen = resolve_backend("grouped_topk", gating_logits, (REFERENCE, TRITON, NPU), backend,
                             unsupported)
    if gating_logits.shape[0] == 0:
        return _empty_result(0, topk, gating_logits.device)
    args = (gating_logits, topk, renormalize, num_expert_group, topk_group, scoring_func,
            e_score_correction_bias, float(routed_scaling_factor))
    if chosen == TRITON:
        from ascend_kernels.triton_kernels.routing import grouped_topk_triton

        return grouped_topk_triton(*args)
    if chosen == NPU:
        from ascend_kernels.npu_ops.routing import grouped_topk_npu

        return grouped_topk_npu(*args)
    return grouped_topk_reference(*args)
