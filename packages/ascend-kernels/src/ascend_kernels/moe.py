"""MoE experts: every token through its top-k experts' SwiGLU MLPs, summed with its
routing weights.

Shapes: ``x`` ``[T, H]``; expert weights in the layout grouped matmuls read, ``w13``
``[E, H, 2I]`` (gate columns first, then up) and ``w2`` ``[E, I, H]``; ``topk_ids`` /
``topk_weights`` ``[T, k]`` from a router (ascend-kernels' ``topk_softmax`` or
``grouped_topk``). An id outside ``[0, E)`` (another rank's expert under expert parallelism,
marked -1) contributes nothing. Output ``[T, H]`` in ``x``'s dtype.

Both backends do the same steps: the ``T * k`` (token, expert) pairs are sorted by expert
(``sort_by_expert``), the tokens gathered in that order, each expert's rows multiplied by
its weights (``x @ w13`` rounded to ``x``'s dtype, SwiGLU, ``@ w2`` rounded again), and
the rows scattered back onto their tokens, weighted, summed in float32.

| op | reference | npu (torch_npu) |
|---|---|---|
| moe_experts | per expert, torch | ``npu_grouped_matmul`` (cumsum) + ``npu_swiglu`` |
"""

from __future__ import annotations

import torch

from ascend_kernels.activation import silu_and_mul
from ascend_kernels.dispatch import NPU, REFERENCE, require_float, resolve_backend

HALF = (torch.float16, torch.bfloat16)
#: npu_grouped_matmul: at most this many groups (experts) per call, K and N below 65536.
GMM_MAX_GROUPS = 1024
GMM_MAX_INNER = 65535


def sort_by_expert(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs with a local expert, sorted by expert (stable: tokens in
    order within an expert).

    Returns ``(tokens [P] int64, gates [P] float32, counts [E] int64)``: the token of each
    pair, its routing weight, and how many pairs each expert got (zero for experts with
    no tokens).
    """
    tokens = torch.arange(topk_ids.shape[0], device=topk_ids.device)
    tokens = tokens.repeat_interleave(topk_ids.shape[1])
    ids = topk_ids.reshape(-1).long()
    gates = topk_weights.reshape(-1).float()
    local = (ids >= 0) & (ids < num_experts)
    ids, tokens, gates = ids[local], tokens[local], gates[local]
    order = torch.argsort(ids, stable=True)
    ids, tokens, gates = ids[order], tokens[order], gates[order]
    counts = torch.bincount(ids, minlength=num_experts).to(torch.int64)
    return tokens, gates, counts


def combine(rows: torch.Tensor, tokens: torch.Tensor, gates: torch.Tensor,
            num_tokens: int, dtype: torch.dtype) -> torch.Tensor:
    """``out[t] = sum over pairs p of token t: gates[p] * rows[p]``, summed in float32."""
    out = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    out.index_add_(0, tokens, rows.float() * gates.unsqueeze(-1))
    return out.to(dtype)


def _check(op: str, x, w13, w2, topk_weights, topk_ids) -> None:
    require_float(op, "x", x)
    for name, w in (("w13", w13), ("w2", w2)):
        require_float(op, name, w)
        if w.dtype != x.dtype:
            raise TypeError(f"{op}: {name} has dtype {w.dtype} but x {x.dtype}; they must "
                            "match")
        if w.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D [experts, K, N], got shape "
                             f"{tuple(w.shape)}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    experts, hidden, two_inter = w13.shape
    if hidden != x.shape[1] or two_inter % 2:
        raise ValueError(f"{op}: w13 must be [experts, hidden={x.shape[1]}, 2 * intermediate],"
                         f" got {tuple(w13.shape)}")
    if tuple(w2.shape) != (experts, two_inter // 2, hidden):
        raise ValueError(f"{op}: w2 must be [experts={experts}, intermediate="
                         f"{two_inter // 2}, hidden={hidden}], got {tuple(w2.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape \
            or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: topk_ids and topk_weights must both be [tokens={x.shape[0]},"
                         f" k], got {tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype == torch.bool:
        raise TypeError(f"{op}: topk_ids must be an integer tensor, got {topk_ids.dtype}")


def _npu_problem(x: torch.Tensor, w13: torch.Tensor) -> str | None:
    if x.dtype not in HALF:
        return f"npu_grouped_matmul takes float16/bfloat16 activations, got {x.dtype}"
    if w13.shape[0] > GMM_MAX_GROUPS:
        return f"npu_grouped_matmul takes at most {GMM_MAX_GROUPS} experts, got {w13.shape[0]}"
    if max(w13.shape[1], w13.shape[2]) > GMM_MAX_INNER:
        return f"npu_grouped_matmul takes K and N below {GMM_MAX_INNER + 1}"
    return None


def moe_experts_reference(x, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    tokens, gates, counts = sort_by_expert(topk_ids, topk_weights, w13.shape[0])
    rows = torch.empty(tokens.shape[0], w2.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count:
            part = x[tokens[start:start + count]].float()
            h = (part @ w13[expert].float()).to(x.dtype)
            a = silu_and_mul(h, backend=REFERENCE)
            rows[start:start + count] = (a.float() @ w2[expert].float()).to(x.dtype)
        start += count
    return combine(rows, tokens, gates, x.shape[0], x.dtype)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                backend: str | None = None) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * (silu(x[t] @ w13[e, :, :I]) * (x[t] @ w13[e, :, I:])) @
    w2[e]`` with ``e = topk_ids[t, k]``; see the module docstring for shapes."""
    op = "moe_experts"
    _check(op, x, w13, w2, topk_weights, topk_ids)
    chosen = resolve_backend(op, x, (REFERENCE, NPU), backend, {NPU: _npu_problem(x, w13)})
    if chosen == NPU:
        from ascend_kernels.npu_ops.moe import moe_experts_npu

        return moe_experts_npu(x, w13, w2, topk_weights, topk_ids)
    return moe_experts_reference(x, w13, w2, topk_weights, topk_ids)


__all__ = ["combine", "moe_experts", "moe_experts_reference", "sort_by_expert"]
