"""Triton kernels of the multi-LoRA ops: each token's product with its own adapter's
weights, for small batches one token per program, for large ones a tile of tokens per
program.

- ``_lora_gemv_kernel`` (BGMV: batched gather matrix-vector), for decode-sized batches: a
  2-D grid of (token, block of output columns). Each program reads its token's slot on the
  device; a token without an adapter (slot -1) writes zeros (shrink) or nothing (expand).
  Otherwise it walks the reduction dimension in blocks, accumulating in float32.
- ``_lora_tiled_kernel``, for prefill-sized batches, where one program per token reads the
  adapter weights once per token: a 2-D grid of (tile of tokens, block of output columns),
  16 tokens a tile for shrink (one column block) and 64 for expand.
  A program multiplies its tile by each slot's weights with the tokens of other slots
  masked to zero, on the matrix units (``tl.dot`` in tf32, which holds bfloat16 and float16
  weights exactly; ieee for float32 ones), skipping slots none of its tokens use;
  each token's result is thus its own slot's, from one read of each used slot's weights
  per tile.

Both scale, add the output's old values when asked, and store in the output's dtype. Shrink
has few output columns (the rank) and a long reduction (the hidden size); expand the
reverse; the block shapes follow from that.
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


@triton.jit
def _lora_tiled_kernel(
    x_ptr, x_row_stride,
    w_ptr, w_slot_stride, w_row_stride, w_col_stride,
    slot_ptr, num_slots,
    out_ptr, out_row_stride, out_offset,
    n_tokens, n_cols, k_size, scale,
    ADD: tl.constexpr, ZERO_UNMAPPED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < n_tokens
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    slots = tl.load(slot_ptr + rows, mask=row_mask, other=-1).to(tl.int32)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    for slot in range(0, num_slots):
        mine = row_mask & (slots == slot)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            w_cols = w_ptr + slot * w_slot_stride + cols[None, :] * w_row_stride
            for start in range(0, k_size, BLOCK_K):
                ks = start + tl.arange(0, BLOCK_K)
                k_mask = ks < k_size
                xv = tl.load(x_rows + ks[None, :], mask=mine[:, None] & k_mask[None, :],
                             other=0.0)
                w = tl.load(w_cols + ks[:, None] * w_col_stride,
                            mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                acc += tl.dot(xv.to(tl.float32), w.to(tl.float32),
                              input_precision=PRECISION)
    acc = acc * scale
    out_ptrs = (out_ptr + rows.to(tl.int64)[:, None] * out_row_stride + out_offset
                + cols[None, :])
    store_rows = row_mask if ZERO_UNMAPPED else row_mask & (slots >= 0)
    mask = store_rows[:, None] & col_mask[None, :]
    if ADD:
        acc += tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# Batches of at least this many tokens take the tiled kernel.
TILED_MIN_TOKENS = 128


def _tile_tokens(n_cols: int) -> int:
    """Tokens per program: few output columns (shrink: the rank) leave one column block, so
    small tiles keep enough programs for the device's cores."""
    return 16 if n_cols <= 64 else 64


def lora_matmul(x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
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
    if tokens >= TILED_MIN_TOKENS:
        # tl.dot takes blocks of at least 16 in every dimension.
        block_k = max(16, min(64, next_power_of_2(k_size)))
        block_n = max(16, min(128, next_power_of_2(n_cols)))
        tile = _tile_tokens(n_cols)
        grid = (triton.cdiv(tokens, tile), triton.cdiv(n_cols, block_n))
        _lora_tiled_kernel[grid](
            x, x.stride(0),
            weights, weights.stride(0), weights.stride(1), weights.stride(2),
            token_lora, weights.shape[0],
            out, out.stride(0), offset,
            tokens, n_cols, k_size, scale,
            ADD=add, ZERO_UNMAPPED=zero_unmapped,
            # tf32 holds bfloat16 and float16 values exactly; float32 weights need ieee.
            PRECISION="ieee" if weights.dtype == torch.float32 else "tf32",
            BLOCK_T=tile, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
        return
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
