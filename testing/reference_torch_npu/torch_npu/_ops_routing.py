"""Fused MoE gating and top-k / top-p ops of torch_npu, computed with plain torch on CPU.

Same rules as ``torch_npu._ops``: each function follows its Ascend/op-plugin documentation
page (argument names, shapes, dtypes, value ranges), raises ``RuntimeError`` on what the
page rules out and ``NotImplementedError`` on what the reference does not model (the
errors of ``torch_npu._ops``). Arithmetic is float32, results are cast once to the
documented output dtype.

Where a page leaves the order of equal scores open, the reference puts the lower index
first (a stable sort); the real kernels may order such ties differently.
"""

from __future__ import annotations

import torch

from torch_npu._ops import _require_float_dtype, _require_tensor
from torch_npu._unmodelled import unmodelled_argument

_MAX_EXPERTS = 2048
_GATING_SOFTMAX_MAX_K = 1024
_TOP_K_TOP_P_MAX_K = 1024


def _require_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    return value


def _require_not_empty(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        raise RuntimeError(f"{name} is empty (shape {tuple(tensor.shape)}); empty tensors are "
                           "not supported.")


def _descending_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ordered, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[..., :k], order[..., :k]


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """``torch_npu.npu_moe_gating_top_k_softmax(x, finished=None, k=1) -> (y, expert_idx,
    row_idx)``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_moe_gating_top_k_softmax.md``:

    - ``x``: float16, bfloat16 or float32, ``[rows, experts]``. The page also allows 3-D
      ``x``, but its ``row_idx`` formula is written for 2-D; the reference models 2-D only.
    - ``finished``: optional bool ``[rows]``, the rows that take no part: their
      ``expert_idx`` is ``experts`` (x's last dim, an index past every expert), as
      aclnnMoeGatingTopKSoftmax's page says; ``y`` and ``row_idx`` are computed as for any
      row (the real op's test golden).
    - ``k``: ``0 < k <= experts`` and ``k <= 1024``.

    Returns ``y = topk(softmax(x, -1), k)``: the softmax computed in float32 and cast to
    ``x``'s dtype, then ranked largest first, the lower expert first among equal values
    (the real op's test golden); ``expert_idx`` their int32 indices; ``row_idx`` int32 with
    ``row_idx[i, j] = j * rows + i`` (the page's ``arange(rows * k).reshape(k,
    rows).transpose(1, 0)``).
    """
    _require_tensor("x", x)
    _require_float_dtype("x", x)
    if x.dim() == 3:
        raise NotImplementedError(
            "x is 3-D; the reference models 2-D x only (the documentation's row_idx formula "
            "is written for 2-D)."
        )
    if x.dim() != 2:
        raise RuntimeError(f"x must be 2-D or 3-D, got {x.dim()} dims.")
    _require_not_empty("x", x)
    if finished is not None:
        _require_tensor("finished", finished)
        if finished.dtype != torch.bool or tuple(finished.shape) != tuple(x.shape[:-1]):
            raise RuntimeError(f"finished must be a bool tensor of x's shape without its last "
                               f"dim {tuple(x.shape[:-1])}, got {finished.dtype} "
                               f"{tuple(finished.shape)}.")
    k = _require_int("k", k)
    experts = x.shape[-1]
    if not 0 < k <= min(experts, _GATING_SOFTMAX_MAX_K):
        raise RuntimeError(f"k={k} is out of range; it must satisfy 0 < k <= {experts} (x's "
                           f"last dim) and k <= {_GATING_SOFTMAX_MAX_K}.")
    # The real op's test golden ranks the softmax after casting it to x's dtype, the lower
    # expert first among equal scores, and compares expert_idx exactly: in float16 many
    # experts round to equal scores, so ranking the float32 softmax picks other experts.
    y, expert_idx = _descending_top_k(x.float().softmax(dim=-1).to(x.dtype), k)
    if finished is not None:
        expert_idx = torch.where(finished.to(expert_idx.device).unsqueeze(-1),
                                 torch.full_like(expert_idx, experts), expert_idx)
    rows = x.shape[0]
    row_idx = torch.arange(rows * k, dtype=torch.int32).reshape(k, rows).transpose(0, 1)
    return y, expert_idx.to(torch.int32), row_idx.contiguous()


def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0,
                         renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
                         eps=1e-20):
    """``torch_npu.npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1,
    group_select_mode=0, renorm=0, norm_type=0, out_flag=False, routed_scaling_factor=1.0,
    eps=1e-20) -> (yOut, expertIdxOut, normOut)``.

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_moe_gating_top_k.md`` and, for the
    formulas that page shows only as images, the kernel page it calls
    (``aclnnMoeGatingTopK.md``):

    - ``x``: float16, bfloat16 or float32, 2-D ``[tokens, experts]``, experts <= 2048, not
      empty (non-contiguous is allowed).
    - ``bias``: None or 1-D ``[experts]`` of ``x``'s dtype.
    - ``group_count > 0`` dividing the experts into groups of more than 2, with (group size
      rounded up to 32) * group_count <= 2048; ``1 <= k_group <= group_count``;
      ``1 <= k <= experts / group_count * k_group``.
    - ``group_select_mode``: 0 scores a group by its maximum, 1 by the sum of its top two.
    - ``renorm``: only 0 is documented ("norm first, then top-k"); others raise.
    - ``norm_type``: 0 softmax, 1 sigmoid.

    Computes ``normOut = softmax(x)`` or ``sigmoid(x)`` (float32); selection values
    ``normOut + bias``; when ``group_count > 1`` the ``k_group`` best groups stay; the top
    ``k`` selection values give ``expertIdxOut``; ``yOut`` takes ``normOut`` at those
    experts, divided by ``(sum + eps)`` for ``norm_type=1`` (left as is for
    ``norm_type=0``, ``renorm=0``), times ``routed_scaling_factor``, in ``x``'s dtype.
    ``normOut`` is returned when ``out_flag`` is True; otherwise the third output is an
    empty float32 tensor (the page only says it is not output).
    """
    _require_tensor("x", x)
    _require_float_dtype("x", x)
    if x.dim() != 2:
        raise RuntimeError(f"x must be 2-D, got {x.dim()} dims.")
    _require_not_empty("x", x)
    experts = x.shape[1]
    if experts > _MAX_EXPERTS:
        raise RuntimeError(f"x has {experts} experts; at most {_MAX_EXPERTS} are supported.")
    k = _require_int("k", k)
    k_group = _require_int("k_group", k_group)
    group_count = _require_int("group_count", group_count)
    group_select_mode = _require_int("group_select_mode", group_select_mode)
    renorm = _require_int("renorm", renorm)
    norm_type = _require_int("norm_type", norm_type)
    if not isinstance(out_flag, bool):
        raise TypeError(f"out_flag must be a bool, got {type(out_flag).__name__}.")
    for name, value in (("routed_scaling_factor", routed_scaling_factor), ("eps", eps)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a float, got {type(value).__name__}.")
    if group_count <= 0 or experts % group_count:
        raise RuntimeError(f"group_count={group_count} must be > 0 and divide x's {experts} "
                           "experts.")
    group_size = experts // group_count
    if group_size <= 2:
        raise RuntimeError(f"experts / group_count = {group_size}; it must be greater than 2.")
    aligned = -(-group_size // 32) * 32
    if aligned * group_count > _MAX_EXPERTS:
        raise RuntimeError(f"the group size rounded up to 32 ({aligned}) times group_count "
                           f"({group_count}) is {aligned * group_count}; it must be <= "
                           f"{_MAX_EXPERTS}.")
    if not 1 <= k_group <= group_count:
        raise RuntimeError(f"k_group={k_group} must be in [1, group_count={group_count}].")
    if not 1 <= k <= group_size * k_group:
        raise RuntimeError(f"k={k} must be in [1, experts / group_count * k_group = "
                           f"{group_size * k_group}].")
    if group_select_mode not in (0, 1):
        raise RuntimeError(f"group_select_mode={group_select_mode}; use 0 (group maximum) or 1 "
                           "(sum of the group's top two).")
    if norm_type not in (0, 1):
        raise RuntimeError(f"norm_type={norm_type}; use 0 (softmax) or 1 (sigmoid).")
    if renorm != 0:
        raise NotImplementedError(f"renorm={renorm}: torch_npu documents only renorm=0.")
    if bias is not None:
        _require_tensor("bias", bias)
        if bias.dtype != x.dtype:
            raise RuntimeError(f"bias has dtype {bias.dtype} but x has {x.dtype}; they must match.")
        if tuple(bias.shape) != (experts,):
            raise RuntimeError(f"bias has shape {tuple(bias.shape)}; it must be ({experts},).")

    logits = x.float()
    norm_out = logits.sigmoid() if norm_type == 1 else logits.softmax(dim=-1)
    selection = norm_out if bias is None else norm_out + bias.float()
    if group_count > 1:
        grouped = selection.view(x.shape[0], group_count, group_size)
        if group_select_mode == 1:
            best_two = grouped.topk(2, dim=-1).values
            group_scores = best_two[..., 0] + best_two[..., 1]
        else:
            group_scores = grouped.max(dim=-1).values
        _, groups = _descending_top_k(group_scores, k_group)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        selection = selection.masked_fill(~kept.repeat_interleave(group_size, dim=1),
                                          float("-inf"))
    _, expert_idx = _descending_top_k(selection, k)
    y = norm_out.gather(1, expert_idx)
    if norm_type == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    third = norm_out if out_flag else torch.empty(0, dtype=torch.float32)
    return y.to(x.dtype), expert_idx.to(torch.int32), third


def npu_top_k_top_p(logits, p=None, k=None):
    """``torch_npu.npu_top_k_top_p(logits, p=None, k=None) -> Tensor`` (op-plugin's schema:
    either filter may be left out).

    Follows Ascend/op-plugin ``docs/context/torch_npu-npu_top_k_top_p.md``:

    - ``logits``: float32, float16 or bfloat16, 2-D ``[batch, vocab]`` (non-contiguous is
      allowed).
    - ``p``: 1-D ``[batch]`` of ``logits``' dtype, values in [0, 1].
    - ``k``: 1-D ``[batch]`` int32, values in [1, 1024] and at most ``vocab``.

    The page's formula: sort each row ascending (stable); mask to -inf the values below
    the k-th largest; softmax what is left, accumulate from the smallest, mask where the
    running sum is <= 1 - p, always keeping the last (largest); restore the original
    order. The result has ``logits``' dtype and shape. Without ``k`` the top-k step is
    skipped, without ``p`` the top-p step; with neither (left open) it raises.
    """
    _require_tensor("logits", logits)
    _require_float_dtype("logits", logits)
    if logits.dim() != 2:
        raise RuntimeError(f"logits must be 2-D, got {logits.dim()} dims.")
    _require_not_empty("logits", logits)
    batch, vocab = logits.shape
    if p is None and k is None:
        raise unmodelled_argument("npu_top_k_top_p", "p and k", None)
    if p is not None:
        _require_tensor("p", p)
        if p.dtype != logits.dtype:
            raise RuntimeError(f"p has dtype {p.dtype} but logits has {logits.dtype}; they "
                               "must match.")
    if k is not None:
        _require_tensor("k", k)
        if k.dtype != torch.int32:
            raise RuntimeError(f"k has dtype {k.dtype}; it must be int32.")
    for name, tensor in (("p", p), ("k", k)):
        if tensor is not None and tuple(tensor.shape) != (batch,):
            raise RuntimeError(f"{name} has shape {tuple(tensor.shape)}; it must be "
                               f"({batch},), logits' first dim.")
    if p is not None and ((p < 0) | (p > 1)).any():
        raise RuntimeError(f"p holds {p[(p < 0) | (p > 1)][0].item()}; values must be in "
                           "[0, 1].")
    top = min(_TOP_K_TOP_P_MAX_K, vocab)
    if k is not None and ((k < 1) | (k > top)).any():
        raise RuntimeError(f"k holds {k[(k < 1) | (k > top)][0].item()}; values must be in "
                           f"[1, {_TOP_K_TOP_P_MAX_K}] and at most logits.size(1) = {vocab}.")

    ranked, order = logits.float().sort(dim=-1, stable=True)
    if k is not None:
        kth_largest = ranked.gather(1, (vocab - k.long()).unsqueeze(1))
        ranked = ranked.masked_fill(ranked < kth_largest, float("-inf"))
    if p is not None:
        running = ranked.softmax(dim=-1).cumsum(dim=-1)
        dropped = running <= (1 - p.float()).unsqueeze(1)
        dropped[:, -1] = False
        ranked = ranked.masked_fill(dropped, float("-inf"))
    return torch.empty_like(ranked).scatter_(1, order, ranked).to(logits.dtype)
