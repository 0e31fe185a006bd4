"""Rotary embedding on torch_npu.

- neox style, whole head rotated, head size 64 or 128, with a key:
  ``npu_apply_rotary_pos_emb(query, key, cos, sin, layout="TND", rotary_mode="half")``
  rotates query and key in place in one launch (docs/context/
  torch_npu-npu_apply_rotary_pos_emb.md: on A2/A3 only "half" mode and D of 64 or 128).
- otherwise: ``npu_rotary_mul(input, r1, r2, rotary_mode=...)`` on the rotated part of
  query and of key ("half" for neox, "interleave" for gptj), the rest copied
  (torch_npu-npu_rotary_mul.md: D below 896 and even, N below 1000, r1/r2 as ``T1D``).

Both take cos and sin already expanded to the rotated width: for "half" mode
``cat(cos, cos)``, for "interleave" mode each value repeated twice, and of the input's
dtype.
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import torch_npu_module

_APPLY_HEAD_SIZES = (64, 128)
_ROTARY_MUL_MAX_D = 896
_ROTARY_MUL_MAX_HEADS = 1000


def rotary_embedding_problem(num_heads: int, rotary_dim: int) -> str | None:
    if rotary_dim >= _ROTARY_MUL_MAX_D:
        return f"npu_rotary_mul needs a rotated width below {_ROTARY_MUL_MAX_D}, got {rotary_dim}"
    if num_heads >= _ROTARY_MUL_MAX_HEADS:
        return f"npu_rotary_mul needs fewer than {_ROTARY_MUL_MAX_HEADS} heads, got {num_heads}"
    return None


def _expanded_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache.index_select(0, positions.reshape(-1)).chunk(2, dim=-1)
    if is_neox:
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    # [T, 1, rotary_dim]: the "T1D" layout, broadcast over heads.
    return cos.unsqueeze(1).to(dtype).contiguous(), sin.unsqueeze(1).to(dtype).contiguous()


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, is_neox: bool, inplace: bool
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``query`` ``[T, Hq, D]`` and ``key`` ``[T, Hk, D]`` (unit stride along D).

    Returns the rotated tensors: ``query``/``key`` themselves when ``inplace`` and they
    are contiguous, new tensors otherwise (the caller copies back).
    """
    torch_npu = torch_npu_module()
    head_size = query.shape[-1]
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = _expanded_cos_sin(positions, cos_sin_cache, is_neox, query.dtype)

    if (is_neox and key is not None and rotary_dim == head_size
            and head_size in _APPLY_HEAD_SIZES):
        q = query if inplace and query.is_contiguous() else query.contiguous().clone()
        k = key if inplace and key.is_contiguous() else key.contiguous().clone()
        q_out, k_out = torch_npu.npu_apply_rotary_pos_emb(q, k, cos, sin, layout="TND",
                                                          rotary_mode="half")
        return q_out, k_out

    mode = "half" if is_neox else "interleave"

    def rotate(x: torch.Tensor) -> torch.Tensor:
        rotated = torch_npu.npu_rotary_mul(x[..., :rotary_dim].contiguous(), cos, sin,
                                           rotary_mode=mode)
        if rotary_dim == head_size:
            return rotated
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)

    return rotate(query), None if key is None else rotate(key)


# --- multimodal RoPE: npu_mrope -------------------------------------------------------------

# The sections npu_mrope's tiling takes (docs/context/torch_npu-npu_mrope.md and the op's
# checks, aclnnRopeWithSinCosCache): Qwen2-VL's and Qwen2.5-VL's [16, 24, 24].
MROPE_SECTIONS = ((16, 24, 24),)


def mrope_problem(head_size: int, rotary_dim: int, num_heads: int,
                  mrope_section: tuple[int, int, int], is_neox: bool, interleaved: bool,
                  dtype: torch.dtype) -> str | None:
    """Why ``npu_mrope`` cannot take this multimodal rope (None when it can)."""
    if interleaved:
        return "npu_mrope (this binding) has no interleaved sections (no cache_mode)"
    if tuple(mrope_section) not in MROPE_SECTIONS:
        return (f"npu_mrope takes mrope_section {[list(s) for s in MROPE_SECTIONS]}, "
                f"got {list(mrope_section)}")
    align = 16 if dtype == torch.float32 else 32
    if head_size % align or rotary_dim % align:
        return (f"npu_mrope needs head_size ({head_size}) and rotary_dim ({rotary_dim}) "
                f"in multiples of {align} for {dtype}")
    return None


def mrope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
          cos_sin_cache: torch.Tensor, head_size: int, mrope_section: tuple[int, int, int],
          is_neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``npu_mrope`` on ``query`` / ``key`` as ``[T, H * D]`` (new tensors, shaped as
    given): int64 positions ``[3, T]``, the cache in the query's dtype."""
    torch_npu = torch_npu_module()
    num_tokens = positions.shape[-1]
    q_out, k_out = torch_npu.npu_mrope(
        positions.to(torch.int64).contiguous(), query.reshape(num_tokens, -1).contiguous(),
        key.reshape(num_tokens, -1).contiguous(),
        cos_sin_cache.to(query.dtype).contiguous(), head_size,
        mrope_section=list(mrope_section), rotary_mode="half" if is_neox else "interleave")
    return q_out.reshape(query.shape), k_out.reshape(key.shape)
