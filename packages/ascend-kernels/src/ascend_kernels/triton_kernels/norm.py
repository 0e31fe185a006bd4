"""Triton kernels of the norm ops: rms_norm (optionally fused with the residual add) and
l2norm.

A program covers ``BLOCK_ROWS`` whole rows (one for hidden sizes of 4096 and more), so a
row is read once, reduced in float32 registers and written once.

With a residual, the kernel stores ``x + residual`` first and, after the reduction, reads
that row back (still in cache: the inputs are loaded with ``evict_last``) instead of
keeping it in registers. The lighter register load lets more rows be in flight; on an
H200 this took add_rms_norm from 0.96 to 1.0 of torch.compile's speed at 32768 x 8192
(benchmarks/results/kernels_gpu.md). The normalised value is then the residual as stored
(rounded to the input dtype), as vLLM's fused_add_rms_norm computes it; the mean square is
taken before rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_kernels.triton_kernels import row_launch


@triton.jit
def _rms_norm_kernel(
    x_ptr, x_row_stride,
    res_ptr, res_row_stride,
    w_ptr,
    out_ptr, out_row_stride,
    res_out_ptr, res_out_row_stride,
    n_rows, n_cols, eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)

    res_out_offsets = rows64[:, None] * res_out_row_stride + cols[None, :]
    if HAS_RESIDUAL:
        x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask,
                    other=0.0, eviction_policy="evict_last").to(tl.float32)
        res = tl.load(res_ptr + rows64[:, None] * res_row_stride + cols[None, :], mask=mask,
                      other=0.0, eviction_policy="evict_last").to(tl.float32)
        x = x + res
        tl.store(res_out_ptr + res_out_offsets, x.to(res_out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask,
                    other=0.0).to(tl.float32)

    mean_square = tl.sum(x * x, axis=1) / n_cols
    rstd = tl.math.rsqrt(mean_square + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = tl.load(res_out_ptr + res_out_offsets, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
    y = x * rstd[:, None] * w[None, :]
    tl.store(out_ptr + rows64[:, None] * out_row_stride + cols[None, :],
             y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _l2norm_kernel(
    x_ptr, x_row_stride,
    out_ptr, out_row_stride,
    n_rows, n_cols, eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    rnorm = tl.math.rsqrt(tl.sum(x * x, axis=1) + eps)
    tl.store(out_ptr + rows64[:, None] * out_row_stride + cols[None, :],
             (x * rnorm[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``x`` and ``residual`` are ``[rows, hidden]`` with unit column stride.

    Returns ``(out, residual_out)``; ``residual_out`` (``x + residual`` in ``x``'s dtype)
    is None without a residual.
    """
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else None
    # Tuned on an H200: with a residual, 256 elements per warp (16 warps at 4096, 32 at
    # 8192); without one, 512 (8 and 16).
    launch = (row_launch(n_cols, elements_per_warp=256, max_warps=32) if residual is not None
              else row_launch(n_cols))
    _rms_norm_kernel[launch.grid(n_rows)](
        x, x.stride(0),
        residual if residual is not None else x,
        residual.stride(0) if residual is not None else 0,
        weight,
        out, out.stride(0),
        res_out if res_out is not None else out,
        res_out.stride(0) if res_out is not None else 0,
        n_rows, n_cols, float(eps),
        HAS_RESIDUAL=residual is not None,
        BLOCK_ROWS=launch.block_rows,
        BLOCK_COLS=launch.block_cols,
        num_warps=launch.num_warps,
    )
    return out, res_out


def l2norm(x: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=out_dtype, device=x.device)
    launch = row_launch(n_cols)
    _l2norm_kernel[launch.grid(n_rows)](
        x, x.stride(0), out, out.stride(0), n_rows, n_cols, float(eps),
        BLOCK_ROWS=launch.block_rows, BLOCK_COLS=launch.block_cols,
        num_warps=launch.num_warps,
    )
    return out
