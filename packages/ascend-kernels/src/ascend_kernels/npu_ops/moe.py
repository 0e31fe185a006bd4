"""MoE experts on torch_npu: ``npu_grouped_matmul`` and ``npu_swiglu``.

``npu_grouped_matmul`` (Ascend/op-plugin ``docs/context/torch_npu-npu_grouped_matmul.md``)
in its single-single-single form: one ``x`` ``[M, K]`` whose rows are sorted by group, one
weight ``[E, K, N]``, ``group_list`` the int64 cumsum of the rows per group
(``group_list_type=0``, ``group_type=0``: grouping along M), one output (``split_item=2``).
Groups with no rows are allowed (equal consecutive cumsum entries).
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import torch_npu_module
from ascend_kernels.moe import combine, sort_by_expert


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, cumsum: torch.Tensor
                   ) -> torch.Tensor:
    """Rows ``cumsum[e-1]:cumsum[e]`` of ``x`` times ``weight[e]`` (float16/bfloat16)."""
    (out,) = torch_npu_module().npu_grouped_matmul(
        [x.contiguous()], [weight], group_list=cumsum, split_item=2, group_type=0,
        group_list_type=0)
    return out


def moe_experts_npu(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    tokens, gates, counts = sort_by_expert(topk_ids, topk_weights, w13.shape[0])
    if tokens.numel() == 0:  # no token routed to a local expert: nothing to launch
        return torch.zeros(x.shape[0], w2.shape[2], dtype=x.dtype, device=x.device)
    cumsum = torch.cumsum(counts, dim=0)
    h = grouped_matmul(x[tokens], w13, cumsum)
    a = torch_npu_module().npu_swiglu(h, dim=-1)
    rows = grouped_matmul(a, w2, cumsum)
    return combine(rows, tokens, gates, x.shape[0], x.dtype)
