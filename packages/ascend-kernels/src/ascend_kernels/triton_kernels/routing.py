"""Triton kernels for MoE routing: one program per token, the whole expert row in a block.

Expert counts are small (tens to a few hundred), so a token's logits fit one block and
the top-k is ``k`` rounds of argmax-and-remove; ``tl.argmax`` returns the first maximum,
which gives the lower-id-first tie rule of the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_kernels.triton_kernels import next_power_of_2


@triton.jit
def _topk_softmax_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, row_stride,
                         TOPK: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + row * row_stride + experts, mask=valid,
                other=float("-inf")).to(tl.float32)
    shifted = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
    probs = shifted / tl.sum(shifted, axis=0)
    # Probabilities are >= 0, so -1 marks padding and experts already taken.
    remaining = tl.where(valid, probs, -1.0)

    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in range(TOPK):
        best = tl.argmax(remaining, axis=0)
        weights = tl.where(slots == slot, tl.max(remaining, axis=0), weights)
        ids = tl.where(slots == slot, best.to(tl.int32), ids)
        remaining = tl.where(experts == best, -1.0, remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(slots < TOPK, weights, 0.0), axis=0)
    tl.store(weights_ptr + row * TOPK + slots, weights, mask=slots < TOPK)
    tl.store(ids_ptr + row * TOPK + slots, ids, mask=slots < TOPK)


@triton.jit
def _grouped_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, num_experts, row_stride,
                         group_size, routed_scaling_factor,
                         NUM_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                         TOPK: tl.constexpr, USE_SIGMOID: tl.constexpr,
                         HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    x = tl.load(logits_ptr + row * row_stride + experts, mask=valid,
                other=float("-inf")).to(tl.float32)
    if USE_SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:
        shifted = tl.where(valid, tl.exp(x - tl.max(x, axis=0)), 0.0)
        scores = shifted / tl.sum(shifted, axis=0)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
        selection = scores + bias
    else:
        selection = scores
    selection = tl.where(valid, selection, float("-inf"))

    # Padding experts sit past the last group, so no group below NUM_GROUPS holds them.
    group_of = experts // group_size
    groups = tl.arange(0, BLOCK_G)
    group_scores = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for group in range(NUM_GROUPS):
        members = tl.where(group_of == group, selection, float("-inf"))
        best = tl.max(members, axis=0)
        if HAS_BIAS:
            best_at = tl.argmax(members, axis=0)
            runner_up = tl.max(tl.where(experts == best_at, float("-inf"), members), axis=0)
            best = best + runner_up
        group_scores = tl.where(groups == group, best, group_scores)

    kept = tl.zeros([BLOCK_E], dtype=tl.int32)
    for _ in range(TOPK_GROUP):
        best_group = tl.argmax(group_scores, axis=0)
        kept = tl.where(group_of == best_group, 1, kept)
        group_scores = tl.where(groups == best_group, float("-inf"), group_scores)

    remaining = tl.where((kept != 0) & valid, selection, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for slot in range(TOPK):
        best = tl.argmax(remaining, axis=0)
        weight = tl.sum(tl.where(experts == best, scores, 0.0), axis=0)
        weights = tl.where(slots == slot, weight, weights)
        ids = tl.where(slots == slot, best.to(tl.int32), ids)
        remaining = tl.where(experts == best, float("-inf"), remaining)
    if RENORMALIZE:
        weights = weights / tl.sum(tl.where(slots < TOPK, weights, 0.0), axis=0)
    weights = weights * routed_scaling_factor
    tl.store(weights_ptr + row * TOPK + slots, weights, mask=slots < TOPK)
    tl.store(ids_ptr + row * TOPK + slots, ids, mask=slots < TOPK)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def topk_softmax_triton(gating_logits: torch.Tensor, topk: int,
                        renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _unit_stride_rows(gating_logits)
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, topk, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, topk, dtype=torch.int32, device=logits.device)
    _topk_softmax_kernel[(tokens,)](
        logits, weights, ids, num_experts, logits.stride(0),
        TOPK=topk, RENORMALIZE=bool(renormalize),
        BLOCK_E=next_power_of_2(num_experts), BLOCK_K=next_power_of_2(topk),
    )
    return weights, ids


def grouped_topk_triton(gating_logits: torch.Tensor, topk: int, renormalize: bool,
                        num_expert_group: int, topk_group: int, scoring_func: str,
                        e_score_correction_bias: torch.Tensor | None,
                        routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = _unit_stride_rows(gating_logits)
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, topk, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, topk, dtype=torch.int32, device=logits.device)
    bias = (e_score_correction_bias.contiguous() if e_score_correction_bias is not None
            else logits)  # never read without HAS_BIAS
    _grouped_topk_kernel[(tokens,)](
        logits, bias, weights, ids, num_experts, logits.stride(0),
        num_experts // num_expert_group, routed_scaling_factor,
        NUM_GROUPS=num_expert_group, TOPK_GROUP=topk_group, TOPK=topk,
        USE_SIGMOID=scoring_func == "sigmoid", HAS_BIAS=e_score_correction_bias is not None,
        RENORMALIZE=bool(renormalize), BLOCK_E=next_power_of_2(num_experts),
        BLOCK_G=next_power_of_2(num_expert_group), BLOCK_K=next_power_of_2(topk),
    )
    return weights, ids
