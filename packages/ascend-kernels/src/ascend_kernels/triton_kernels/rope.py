"""Triton kernel of the rotary embedding: query and key in one launch.

A program takes ``BLOCK_T`` tokens. It loads their positions and their cos/sin rows from
the cache once, then rotates every head of the query and then every head of the key
(``BLOCK_HQ`` / ``BLOCK_HK`` heads per step, all of them in one step for usual head
counts), holding a ``[BLOCK_T, BLOCK_H, BLOCK_R]`` tile of each rotated half. Head
elements beyond ``rotary_dim`` are copied when the output is a new tensor. The block sizes
come from ``ascend_kernels.rope.rope_launch_config`` (UB budget on npu) or its GPU
counterpart.

Multimodal RoPE (``MROPE`` 1: T/H/W sections one after another, 2: interleaved THWTHW...,
vLLM's ``MRotaryEmbedding``): positions are ``[3, T]`` and each rotated pair reads the
cos/sin row of its section's position, so a program loads a ``[BLOCK_T, BLOCK_R]`` tile of
positions instead of one per token; the rotation is the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    src_ptr, src_token_stride,
    dst_ptr, dst_token_stride,
    tokens, token_mask, cos, sin,
    num_heads,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    COPY_PASS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.arange(0, BLOCK_R)[None, None, :]
    if IS_NEOX:
        first = r
        second = r + ROT_HALF
    else:
        first = 2 * r
        second = 2 * r + 1
    src_tokens = src_ptr + (tokens * src_token_stride)[:, None, None]
    dst_tokens = dst_ptr + (tokens * dst_token_stride)[:, None, None]
    token_mask3 = token_mask[:, None, None]
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)[None, :, None]
        head_mask = token_mask3 & (heads < num_heads)
        mask = head_mask & (r < ROT_HALF)
        src = src_tokens + heads * HEAD_SIZE
        dst = dst_tokens + heads * HEAD_SIZE
        x1 = tl.load(src + first, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + second, mask=mask, other=0.0).to(tl.float32)
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
        tl.store(dst + first, out1.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + second, out2.to(dst_ptr.dtype.element_ty), mask=mask)
        if COPY_PASS:
            p = tl.arange(0, BLOCK_P)[None, None, :]
            pass_mask = head_mask & (p < HEAD_SIZE - 2 * ROT_HALF)
            kept = tl.load(src + 2 * ROT_HALF + p, mask=pass_mask)
            tl.store(dst + 2 * ROT_HALF + p, kept, mask=pass_mask)


@triton.jit
def _rope_kernel(
    positions_ptr,
    q_ptr, q_token_stride,
    k_ptr, k_token_stride,
    q_out_ptr, q_out_token_stride,
    k_out_ptr, k_out_token_stride,
    cache_ptr, cache_stride,
    num_tokens, num_heads_q, num_heads_k,
    positions_row_stride,
    HEAD_SIZE: tl.constexpr,
    ROT_HALF: tl.constexpr,
    IS_NEOX: tl.constexpr,
    HAS_KEY: tl.constexpr,
    COPY_PASS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    MROPE: tl.constexpr = 0,
    SECTION_T: tl.constexpr = 0,
    SECTION_H: tl.constexpr = 0,
    SECTION_W: tl.constexpr = 0,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_mask = tokens < num_tokens
    tokens = tokens.to(tl.int64)

    r = tl.arange(0, BLOCK_R)
    cs_mask = token_mask[:, None] & (r < ROT_HALF)[None, :]
    if MROPE == 0:
        positions = tl.load(positions_ptr + tokens, mask=token_mask, other=0).to(tl.int64)
        rows = positions[:, None]
    else:
        if MROPE == 1:  # sections T, H, W one after another
            section = (r >= SECTION_T).to(tl.int64) + (r >= SECTION_T + SECTION_H).to(tl.int64)
        else:  # interleaved: pair r takes H where r % 3 == 1, W where 2, within their counts
            height = ((r % 3) == 1) & (r < 3 * SECTION_H)
            width = ((r % 3) == 2) & (r < 3 * SECTION_W)
            section = tl.where(height, 1, tl.where(width, 2, 0)).to(tl.int64)
        rows = tl.load(positions_ptr + section[None, :] * positions_row_stride + tokens[:, None],
                       mask=cs_mask, other=0).to(tl.int64)
    cs_row = cache_ptr + rows * cache_stride + r[None, :]
    cos = tl.load(cs_row, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]
    sin = tl.load(cs_row + ROT_HALF, mask=cs_mask, other=0.0).to(tl.float32)[:, None, :]

    _rotate_heads(q_ptr, q_token_stride, q_out_ptr, q_out_token_stride,
                  tokens, token_mask, cos, sin, num_heads_q,
                  HEAD_SIZE, ROT_HALF, IS_NEOX, COPY_PASS, BLOCK_HQ, BLOCK_R, BLOCK_P)
    if HAS_KEY:
        _rotate_heads(k_ptr, k_token_stride, k_out_ptr, k_out_token_stride,
                      tokens, token_mask, cos, sin, num_heads_k,
                      HEAD_SIZE, ROT_HALF, IS_NEOX, COPY_PASS, BLOCK_HK, BLOCK_R, BLOCK_P)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, is_neox: bool,
                     query_out: torch.Tensor, key_out: torch.Tensor | None, config,
                     mrope_section: tuple[int, int, int] | None = None,
                     mrope_interleaved: bool = False) -> None:
    """Rotate ``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hk, D]`` into ``query_out`` /
    ``key_out`` (same shapes; may be the inputs themselves, for in-place).

    Heads must be dense within a token (head stride ``D``, unit element stride); the token
    stride is free. ``cos_sin_cache`` is ``[max_position, rotary_dim]`` with unit column
    stride; ``config`` a ``RopeLaunchConfig``. With ``mrope_section`` (T, H, W pair counts)
    ``positions`` is ``[3, T]`` with unit token stride.
    """
    num_tokens, num_heads_q, head_size = query.shape
    rotary_dim = cos_sin_cache.shape[-1]
    copy_pass = rotary_dim < head_size and query_out.data_ptr() != query.data_ptr()
    has_key = key is not None
    grid = (triton.cdiv(num_tokens, config.tokens_per_program),)
    mrope = {}
    if mrope_section is not None:
        mrope = {"MROPE": 2 if mrope_interleaved else 1, "SECTION_T": mrope_section[0],
                 "SECTION_H": mrope_section[1], "SECTION_W": mrope_section[2]}
    _rope_kernel[grid](
        positions,
        query, query.stride(0),
        key if has_key else query, key.stride(0) if has_key else 0,
        query_out, query_out.stride(0),
        key_out if has_key else query_out, key_out.stride(0) if has_key else 0,
        cos_sin_cache, cos_sin_cache.stride(0),
        num_tokens, num_heads_q, key.shape[1] if has_key else 0,
        positions.stride(0) if mrope else 0,
        HEAD_SIZE=head_size,
        ROT_HALF=rotary_dim // 2,
        IS_NEOX=is_neox,
        HAS_KEY=has_key,
        COPY_PASS=copy_pass,
        BLOCK_T=config.tokens_per_program,
        BLOCK_HQ=config.block_heads_q,
        BLOCK_HK=config.block_heads_k,
        BLOCK_R=config.block_rot,
        BLOCK_P=config.block_pass,
        num_warps=config.num_warps,
        **mrope,
    )
