"""Routing and top-k / top-p on torch_npu: ``npu_moe_gating_top_k_softmax``,
``npu_moe_gating_top_k`` and ``npu_top_k_top_p``.

The gating ops return weights in their input's dtype, so the logits go in as float32
(they are ``[tokens, experts]``, small): the weights then carry float32 precision like the
reference's. ``npu_top_k_top_p`` likewise gets float32 logits and ``p``: it wants ``p`` in
the logits' dtype, and a bfloat16 ``p`` would move the top-p cut.
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import torch_npu_module

# Documented limits (Ascend/op-plugin docs/context/torch_npu-<op>.md).
GATING_SOFTMAX_MAX_K = 1024
GATING_MAX_EXPERTS = 2048
TOP_K_TOP_P_MAX_K = 1024


def topk_softmax_problem(topk: int) -> str | None:
    if topk > GATING_SOFTMAX_MAX_K:
        return f"npu_moe_gating_top_k_softmax takes k <= {GATING_SOFTMAX_MAX_K}, got {topk}"
    return None


def topk_softmax_npu(gating_logits: torch.Tensor, topk: int,
                     renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx, row_idx)``:
    softmax over the last dim, then its top ``k``; renormalising is left to us."""
    y, expert_idx, _row_idx = torch_npu_module().npu_moe_gating_top_k_softmax(
        gating_logits.float().contiguous(), finished=None, k=topk)
    weights = y.float()
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, expert_idx.to(torch.int32)


def grouped_topk_problem(num_experts: int, num_expert_group: int) -> str | None:
    group_size = num_experts // num_expert_group
    if num_experts > GATING_MAX_EXPERTS:
        return (f"npu_moe_gating_top_k takes at most {GATING_MAX_EXPERTS} experts, got "
                f"{num_experts}")
    if group_size <= 2:
        return f"npu_moe_gating_top_k needs more than 2 experts per group, got {group_size}"
    aligned = -(-group_size // 32) * 32
    if aligned * num_expert_group > GATING_MAX_EXPERTS:
        return (f"npu_moe_gating_top_k needs (experts per group rounded up to 32) x groups "
                f"<= {GATING_MAX_EXPERTS}, got {aligned} x {num_expert_group}")
    return None


def grouped_topk_npu(gating_logits: torch.Tensor, topk: int, renormalize: bool,
                     num_expert_group: int, topk_group: int, scoring_func: str,
                     e_score_correction_bias: torch.Tensor | None,
                     routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_moe_gating_top_k(x, k, *, bias, k_group, group_count, group_select_mode,
    renorm, norm_type, out_flag, routed_scaling_factor, eps)``.

    vLLM scores a group by its best expert without a bias and by its best two with one:
    ``group_select_mode`` 0 and 1. The op's own weights (``yOut``) are the chosen scores
    divided by their sum for sigmoid (``norm_type=1``) and left as they are for softmax
    (``norm_type=0``; ``renorm=0`` is the only mode torch_npu documents); every other
    combination takes the weights from the scores it returns (``out_flag=True``).
    """
    use_sigmoid = scoring_func == "sigmoid"
    op_weights_fit = use_sigmoid == bool(renormalize)
    bias = None if e_score_correction_bias is None else e_score_correction_bias.float()
    y, expert_idx, norm_out = torch_npu_module().npu_moe_gating_top_k(
        gating_logits.float(), topk, bias=bias, k_group=topk_group,
        group_count=num_expert_group,
        group_select_mode=0 if e_score_correction_bias is None else 1, renorm=0,
        norm_type=1 if use_sigmoid else 0, out_flag=not op_weights_fit,
        routed_scaling_factor=routed_scaling_factor if op_weights_fit else 1.0)
    ids = expert_idx.to(torch.int32)
    if op_weights_fit:
        return y.float(), ids
    weights = norm_out.float().gather(1, expert_idx.long())
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * routed_scaling_factor, ids


def top_k_top_p_problem(k: torch.Tensor | None, p: torch.Tensor | None) -> str | None:
    """Reads ``k.max()`` back (one sync): vLLM sets k = V for rows without top-k."""
    if k is None or p is None:
        return "npu_top_k_top_p takes both k and p; this call has only one"
    if k.numel() and int(k.max()) > TOP_K_TOP_P_MAX_K:
        return f"npu_top_k_top_p takes k <= {TOP_K_TOP_P_MAX_K}, got {int(k.max())}"
    return None


def top_k_top_p_npu(logits: torch.Tensor, k: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``npu_top_k_top_p(logits, p, k)``: the same stable-sort definition as the
    reference; ``p`` in the logits' dtype, ``k`` int32."""
    masked = torch_npu_module().npu_top_k_top_p(logits.float(), p.float(), k.to(torch.int32))
    return masked.to(logits.dtype)
