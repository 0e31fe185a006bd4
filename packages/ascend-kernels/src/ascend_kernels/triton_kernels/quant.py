"""Triton kernels of the int8 ops: per-token dynamic quantization, add + RMSNorm + int8
quantization (static or per-token), and the scaled int8 matmul.

Each row is scaled by a reciprocal computed once per row (a division per element would
make these kernels compute-bound on a GPU), clamped to [-128, 127] and rounded to nearest
with ties to even, as ``torch.round``: adding and subtracting 1.5 * 2**23 leaves a float32
of magnitude below 2**22 rounded to an integer by the hardware's own rounding. That needs
a compiler that keeps float additions in order (no fast-math reassociation), which Triton
does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_kernels.triton_kernels import next_power_of_2, row_launch


@triton.jit
def _to_int8(x):
    """``clamp(round_half_even(x), -128, 127)`` as int8, for float32 ``x``."""
    x = tl.minimum(tl.maximum(x, -128.0), 127.0)
    x = (x + 12582912.0) - 12582912.0
    return x.to(tl.int8)


@triton.jit
def _inverse_row_scale(amax):
    """``127 / amax``; 0 for a row of zeros (scale 0), which then quantizes to zeros."""
    is_zero = amax == 0.0
    return tl.where(is_zero, 0.0, 127.0 / tl.where(is_zero, 1.0, amax))


@triton.jit
def _dynamic_quant_kernel(
    x_ptr, x_row_stride,
    q_ptr, q_row_stride,
    scale_ptr,
    n_rows, n_cols,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    mask = row_mask[:, None] & (cols < n_cols)[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    inv_scale = _inverse_row_scale(amax)
    q = _to_int8(x * inv_scale[:, None])
    tl.store(q_ptr + rows64[:, None] * q_row_stride + cols[None, :], q, mask=mask)
    tl.store(scale_ptr + rows, amax / 127.0, mask=row_mask)


@triton.jit
def _add_rms_norm_quant_kernel(
    x_ptr, x_row_stride,
    res_ptr, res_row_stride,
    w_ptr,
    q_ptr, q_row_stride,
    res_out_ptr, res_out_row_stride,
    scale_out_ptr,
    static_scale_ptr, offset_ptr,
    n_rows, n_cols, eps,
    STATIC: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_COLS)
    row_mask = rows < n_rows
    col_mask = cols < n_cols
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)

    x = tl.load(x_ptr + rows64[:, None] * x_row_stride + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)
    res = tl.load(res_ptr + rows64[:, None] * res_row_stride + cols[None, :], mask=mask,
                  other=0.0).to(tl.float32)
    x = x + res
    tl.store(res_out_ptr + rows64[:, None] * res_out_row_stride + cols[None, :],
             x.to(res_out_ptr.dtype.element_ty), mask=mask)

    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y = x * rstd[:, None] * w[None, :]

    if STATIC:
        inv_scale = 1.0 / tl.load(static_scale_ptr).to(tl.float32)
        q = y * inv_scale
        if HAS_OFFSET:
            # Round, then add the offset, as the reference does (the other order differs
            # on exact ties); the clamp keeps the rounding trick's range and saturates.
            q = (tl.minimum(tl.maximum(q, -256.0), 256.0) + 12582912.0) - 12582912.0
            q = q + tl.load(offset_ptr).to(tl.float32)
    else:
        amax = tl.max(tl.abs(y), axis=1)
        inv_scale = _inverse_row_scale(amax)
        q = y * inv_scale[:, None]
        tl.store(scale_out_ptr + rows, amax / 127.0, mask=row_mask)
    tl.store(q_ptr + rows64[:, None] * q_row_stride + cols[None, :], _to_int8(q), mask=mask)


@triton.jit
def _scaled_int8_mm_kernel(
    a_ptr, a_stride_m, a_stride_k,
    b_ptr, b_stride_k, b_stride_n,
    scale_a_ptr, scale_a_stride,
    scale_b_ptr, scale_b_stride,
    bias_ptr,
    out_ptr, out_stride_m,
    M, N, K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_mask = rm < M
    n_mask = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + rk
        k_mask = ks < K
        a = tl.load(a_ptr + rm64[:, None] * a_stride_m + ks[None, :] * a_stride_k,
                    mask=m_mask[:, None] & k_mask[None, :], other=0)
        b = tl.load(b_ptr + ks[:, None] * b_stride_k + rn64[None, :] * b_stride_n,
                    mask=k_mask[:, None] & n_mask[None, :], other=0)
        acc += tl.dot(a, b, out_dtype=tl.int32)

    scale_a = tl.load(scale_a_ptr + rm * scale_a_stride, mask=m_mask, other=0.0)
    scale_b = tl.load(scale_b_ptr + rn * scale_b_stride, mask=n_mask, other=0.0)
    out = acc.to(tl.float32) * scale_a[:, None] * scale_b[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rm64[:, None] * out_stride_m + rn64[None, :],
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def dynamic_per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[rows, hidden]`` with unit column stride -> (int8, float32 ``[rows]``)."""
    n_rows, n_cols = x.shape
    q = torch.empty((n_rows, n_cols), dtype=torch.int8, device=x.device)
    scales = torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    launch = row_launch(n_cols, elements_per_warp=1024, max_warps=8)
    _dynamic_quant_kernel[launch.grid(n_rows)](
        x, x.stride(0), q, q.stride(0), scales, n_rows, n_cols,
        BLOCK_ROWS=launch.block_rows, BLOCK_COLS=launch.block_cols,
        num_warps=launch.num_warps,
    )
    return q, scales


def add_rms_norm_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, scale: torch.Tensor | None, offset: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Rows ``[rows, hidden]``; ``scale`` (float32, one element) selects static
    quantization, None per-token. Returns (int8, per-row scales or None, x + residual)."""
    n_rows, n_cols = x.shape
    q = torch.empty((n_rows, n_cols), dtype=torch.int8, device=x.device)
    res_out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    static = scale is not None
    scales = None if static else torch.empty((n_rows,), dtype=torch.float32, device=x.device)
    launch = row_launch(n_cols, elements_per_warp=1024, max_warps=8)
    _add_rms_norm_quant_kernel[launch.grid(n_rows)](
        x, x.stride(0),
        residual, residual.stride(0),
        weight,
        q, q.stride(0),
        res_out, res_out.stride(0),
        scales if scales is not None else q,
        scale if static else q,
        offset if offset is not None else q,
        n_rows, n_cols, float(eps),
        STATIC=static, HAS_OFFSET=offset is not None,
        BLOCK_ROWS=launch.block_rows, BLOCK_COLS=launch.block_cols,
        num_warps=launch.num_warps,
    )
    return q, scales, res_out


def scaled_int8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``a`` int8 ``[M, K]``, ``b`` int8 ``[K, N]``; ``scale_a`` float32 ``[M]`` or
    ``[1]``, ``scale_b`` float32 ``[N]`` or ``[1]``, ``bias`` ``[N]`` or None."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    block_m = min(64, max(16, next_power_of_2(m)))
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(64, max(16, next_power_of_2(k)))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _scaled_int8_mm_kernel[grid](
        a, a.stride(0), a.stride(1),
        b, b.stride(0), b.stride(1),
        scale_a, 0 if scale_a.numel() == 1 else 1,
        scale_b, 0 if scale_b.numel() == 1 else 1,
        bias if bias is not None else scale_b,
        out, out.stride(0),
        m, n, k,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4,
    )
    return out
