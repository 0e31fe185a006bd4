"""Triton kernel of the gated delta rule (``ascend_kernels.gdn``).

One program per (sequence, value head, block of ``BLOCK_V`` value rows): it loads its
``[BLOCK_V, K]`` block of the sequence's state once, steps through the sequence's tokens
(decay, delta-rule correction, rank-1 update, output row block), and writes the block back
to the state slot. The key dimension is held whole (``BLOCK_K`` >= K): the correction and
the output each reduce over it. The verification form (``VERIFY``) starts from the slot of
the sequence's last accepted token (``index[seq, accepted[seq] - 1]``) and writes the state
after its ``t``-th token to ``index[seq, t]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, cu_ptr, index_ptr, accepted_ptr, out_ptr,
    scale, eps, slot_stride, index_stride,
    HEADS: tl.constexpr,
    VALUE_HEADS: tl.constexpr,
    KEY_DIM: tl.constexpr,
    VALUE_DIM: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
    VERIFY: tl.constexpr,
):
    seq = tl.program_id(0)
    value_head = tl.program_id(1)
    head = value_head // (VALUE_HEADS // HEADS)
    rows = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = tl.arange(0, BLOCK_K)
    row_mask = rows < VALUE_DIM
    col_mask = cols < KEY_DIM
    block_mask = row_mask[:, None] & col_mask[None, :]

    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    first = 0
    if VERIFY:
        first = tl.load(accepted_ptr + seq).to(tl.int64) - 1
    slot = tl.load(index_ptr + seq * index_stride + first).to(tl.int64)
    in_slot = value_head * VALUE_DIM * KEY_DIM + rows[:, None] * KEY_DIM + cols[None, :]
    state_block = state_ptr + slot * slot_stride + in_slot
    s = tl.load(state_block, mask=block_mask, other=0.0).to(tl.float32)

    for t in range(start, end):
        qk_row = (t * HEADS + head) * KEY_DIM + cols
        q = tl.load(q_ptr + qk_row, mask=col_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_row, mask=col_mask, other=0.0).to(tl.float32)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q) + eps)
            k = k / tl.sqrt(tl.sum(k * k) + eps)
        gate = tl.load(g_ptr + t * VALUE_HEADS + value_head).to(tl.float32)
        beta = tl.load(beta_ptr + t * VALUE_HEADS + value_head).to(tl.float32)
        v_row = (t * VALUE_HEADS + value_head) * VALUE_DIM + rows
        v = tl.load(v_ptr + v_row, mask=row_mask, other=0.0).to(tl.float32)
        s = s * tl.exp(gate)
        u = (v - tl.sum(s * k[None, :], 1)) * beta
        s = s + u[:, None] * k[None, :]
        o = tl.sum(s * (q * scale)[None, :], 1)
        tl.store(out_ptr + v_row, o.to(out_ptr.dtype.element_ty), mask=row_mask)
        if VERIFY:
            after = tl.load(index_ptr + seq * index_stride + (t - start)).to(tl.int64)
            tl.store(state_ptr + after * slot_stride + in_slot,
                     s.to(state_ptr.dtype.element_ty), mask=block_mask)

    if not VERIFY:
        tl.store(state_block, s.to(state_ptr.dtype.element_ty), mask=block_mask)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                     state_indices: torch.Tensor, out: torch.Tensor, scale: float,
                     use_qk_l2norm: bool, eps: float,
                     num_accepted_tokens: torch.Tensor | None = None) -> None:
    """Contiguous ``q`` / ``k`` ``[T, H, K]``, ``v`` / ``out`` ``[T, HV, V]``, ``g`` / ``beta``
    ``[T, HV]``, ``state`` ``[slots, HV, V, K]`` (each slot contiguous; slots may be
    padded apart, as in vLLM's hybrid cache), updated in place. With
    ``num_accepted_tokens``: the verification form, ``state_indices`` ``[sequences,
    columns]``."""
    if not state[0].is_contiguous():
        raise ValueError("gated_delta_rule (Triton): each state slot must be contiguous")
    sequences = cu_seqlens.numel() - 1
    _, heads, key_dim = q.shape
    value_heads, value_dim = v.shape[1], v.shape[2]
    block_k = triton.next_power_of_2(key_dim)
    # Keep the state block near 8K float32 values: registers on a GPU, UB on an NPU.
    block_v = max(1, min(triton.next_power_of_2(value_dim), 8192 // block_k))
    grid = (sequences, value_heads, triton.cdiv(value_dim, block_v))
    if sequences == 0:
        return
    verify = num_accepted_tokens is not None
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state, cu_seqlens, state_indices,
        num_accepted_tokens if verify else state_indices, out, float(scale), float(eps),
        state.stride(0), state_indices.stride(0) if verify else 1,
        HEADS=heads, VALUE_HEADS=value_heads, KEY_DIM=key_dim, VALUE_DIM=value_dim,
        BLOCK_K=block_k, BLOCK_V=block_v, L2NORM=use_qk_l2norm, VERIFY=verify)
