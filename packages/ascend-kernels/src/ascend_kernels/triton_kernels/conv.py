"""Triton kernel of the causal depthwise conv1d with per-sequence state (``ascend_kernels.conv``).

One program per (sequence, block of up to ``MAX_BLOCK_D`` channels). For each of the
sequence's tokens it reads the window of ``W`` inputs ending there as a ``[block, W]`` tile:
positions from the sequence's start come from ``x``, earlier ones from the slot's conv state
(zeros for a sequence without one); the output is the tile's weighted row sums plus bias,
SiLU applied. Then it reads the sequence's last ``W - 1`` inputs the same way and writes them
as the new state (all reads of the old state come before that write). A decode step is a
sequence of one token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Channels per program: 1024 (on an H100, decode batches of 256+ sequences: 0.56-0.77 of
# copy bandwidth, where 128 reached 0.2; benchmarks/results/kernels_gpu_conv.md).
MAX_BLOCK_D = 1024


@triton.jit
def _inputs_at(x_ptr, state_base, position, valid, start, has_initial, channels,
               channel_mask, x_row_stride, state_col_stride, WIDTH: tl.constexpr):
    """The ``[BLOCK, BLOCK_W]`` inputs at ``position`` (float32): from ``x`` from the
    sequence's start on, before it from the conv state (zeros without one)."""
    in_x = (position >= start) & valid
    in_state = (position < start) & valid & has_initial
    from_x = tl.load(x_ptr + position[None, :] * x_row_stride + channels[:, None],
                     mask=channel_mask[:, None] & in_x[None, :], other=0.0)
    column = (WIDTH - 1) - (start - position)
    from_state = tl.load(state_base + column[None, :] * state_col_stride,
                         mask=channel_mask[:, None] & in_state[None, :], other=0.0)
    return tl.where(in_x[None, :], from_x.to(tl.float32), from_state.to(tl.float32))


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, weight_ptr, bias_ptr, state_ptr, cu_ptr, index_ptr, initial_ptr, out_ptr,
    x_row_stride, state_slot_stride, state_dim_stride, state_col_stride,
    DIM: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
):
    seq = tl.program_id(0)
    channels = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    taps = tl.arange(0, BLOCK_W)
    channel_mask = channels < DIM
    tap_mask = taps < WIDTH

    start = tl.load(cu_ptr + seq).to(tl.int64)
    end = tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(index_ptr + seq).to(tl.int64)
    # As a vector over the taps: a scalar flag in a mask breaks Triton's interpreter.
    has_initial = (taps * 0 + tl.load(initial_ptr + seq).to(tl.int32)) != 0

    weight = tl.load(weight_ptr + channels[:, None] * WIDTH + taps[None, :],
                     mask=channel_mask[:, None] & tap_mask[None, :], other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + channels, mask=channel_mask, other=0.0).to(tl.float32)
    state_base = state_ptr + slot * state_slot_stride + channels[:, None] * state_dim_stride

    for t in range(start, end):
        # Window position j holds input t - (W - 1) + j.
        window = _inputs_at(x_ptr, state_base, t - (WIDTH - 1) + taps, tap_mask, start,
                            has_initial, channels, channel_mask, x_row_stride,
                            state_col_stride, WIDTH)
        acc = tl.sum(window * weight, 1)
        if HAS_BIAS:
            acc = acc + bias
        if SILU:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + t * DIM + channels, acc.to(out_ptr.dtype.element_ty),
                 mask=channel_mask)

    # The new state: the last W - 1 inputs, state column j holding input end - (W - 1) + j.
    keep = taps < WIDTH - 1
    new_state = _inputs_at(x_ptr, state_base, end - (WIDTH - 1) + taps, keep, start,
                           has_initial, channels, channel_mask, x_row_stride,
                           state_col_stride, WIDTH)
    tl.store(state_base + taps[None, :] * state_col_stride,
             new_state.to(state_ptr.dtype.element_ty),
             mask=channel_mask[:, None] & keep[None, :])


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                  state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  silu: bool, out: torch.Tensor) -> None:
    """``x`` ``[T, dim]`` (unit channel stride), ``weight`` ``[dim, W]`` contiguous, states
    ``[slots, dim, W - 1]`` (any strides), ``out`` ``[T, dim]`` contiguous."""
    sequences = cu_seqlens.numel() - 1
    dim, width = weight.shape
    if sequences == 0:
        return
    block = min(MAX_BLOCK_D, triton.next_power_of_2(dim))
    grid = (sequences, triton.cdiv(dim, block))
    _causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_states, cu_seqlens,
        state_indices, has_initial_state, out,
        x.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        DIM=dim, WIDTH=width, BLOCK_W=triton.next_power_of_2(width), BLOCK=block,
        HAS_BIAS=bias is not None, SILU=silu)
