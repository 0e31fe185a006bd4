"""Triton kernel of the multi-LoRA ops: one matrix-vector product per token with its own
adapter's weights (BGMV: batched gather matrix-vector).

A 2-D grid of (token, block of output columns). Each program reads its token's slot on the
device; a token without an adapter (slot -1) writes zeros (shrink) or nothing (expand).
Otherwise it walks the reduction dimension in blocks, accumulating in float32, scales,
adds the output's old values when asked, and stores in the output's dtype. Shrink has few
output columns (the rank) and a long reduction (the hidden size); expand the reverse; the
block shapes follow from that.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_kernels.triton_kernels import next_power_of_2

# Reduction elements per step and output columns per program; at most this many weights
# held per program (BLOCK_N x BLOCK_K).
_MAX_BLOCK_K = 256
_MAX_BLOCK_N = 128
_MAX_TILE = 16384


@triton.jit
def _lora_gemv_kernel(
    x_ptr, x_row_stride,
    w_ptr, w_slot_stride, w_row_stride, w_col_stride,
    slot_ptr,
    out_ptr, out_row_stride, out_offset,
    n_cols, k_size, scale,
    ADD: tl.constexpr, ZERO_UNMAPPED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    out_ptrs = out_ptr + token * out_row_stride + out_offset + cols
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:
        if ZERO_UNMAPPED:
            tl.store(out_ptrs, tl.zeros([BLOCK_N], dtype=tl.float32).to(
                out_ptr.dtype.element_ty), mask=col_mask)
        return
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    w_rows = w_ptr + slot * w_slot_stride + cols[:, None] * w_row_stride
    for start in range(0, k_size, BLOCK_K):
        ks = start + tl.arange(0, BLOCK_K)
        k_mask = ks < k_size
        xv = tl.load(x_ptr + token * x_row_stride + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_rows + ks[None, :] * w_col_stride,
                    mask=col_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * xv[None, :], axis=1)
    acc = acc * scale
    if ADD:
        acc += tl.load(out_ptrs, mask=col_mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=col_mask)


def lora_gemv(x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
              token_lora: torch.Tensor, scale: float, offset: int, *, add: bool,
              zero_unmapped: bool) -> None:
    """``out[t, offset:offset+n] (+)= scale * x[t] @ weights[token_lora[t]].T`` for
    ``x`` ``[tokens, k]``, ``weights`` ``[slots, n, k]``, ``out`` ``[tokens, width]``."""
    tokens, k_size = x.shape
    n_cols = weights.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    if out.stride(1) != 1:
        raise ValueError(f"lora ops: out needs a unit column stride, got strides {out.stride()}")
    block_k = min(_MAX_BLOCK_K, next_power_of_2(k_size))
    block_n = min(_MAX_BLOCK_N, next_power_of_2(n_cols), max(1, _MAX_TILE // block_k))
    grid = (tokens, triton.cdiv(n_cols, block_n))
    _lora_gemv_kernel[grid](
        x, x.stride(0),
        weights, weights.stride(0), weights.stride(1), weights.stride(2),
        token_lora,
        out, out.stride(0), offset,
        n_cols, k_size, scale,
        ADD=add, ZERO_UNMAPPED=zero_unmapped, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )
