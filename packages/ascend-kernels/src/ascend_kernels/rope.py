"""Rotary position embedding: ``rotary_embedding`` and the Triton launch configuration.

Follows vLLM's ``RotaryEmbedding.forward_native(positions, query, key)``: ``query`` is
``[T, Hq * D]`` (or ``[T, Hq, D]``), ``key`` ``[T, Hk * D]`` (or None), ``positions``
``[T]`` indexes ``cos_sin_cache`` ``[max_position, rotary_dim]`` whose first half of each
row holds cos and second half sin. The first ``rotary_dim`` elements of every head are
rotated, neox style (first half against second half) or gptj style (even against odd
elements); the rest of the head (partial rotary) is kept.

Backends: the reference; Triton (query and key in one launch); torch_npu
``npu_apply_rotary_pos_emb`` (neox style rotating whole heads of 64 or 128, with a key)
or else ``npu_rotary_mul``.

UB size on npu (``VLLM_ASCEND_ROPE_UB_SIZE_KB``)
-----------------------------------------------
On Ascend the Triton kernel's tile lives in a vector core's Unified Buffer (UB), which it
must not overflow. ``rope_launch_config`` sizes the tile (tokens per program, heads per
step) from ``ub_size_kb``: 0 means auto, which reads the UB size from triton-ascend's
device properties when they report it and otherwise assumes 192 KB (an Atlas A2/A3 vector
core). ascend-kernels does not import ascend-core, so it never reads the environment:
the caller (ascend-core's custom op) passes the value of ``VLLM_ASCEND_ROPE_UB_SIZE_KB``
as ``rotary_embedding(..., ub_size_kb=...)``. Half of the UB is budgeted, leaving the
other half for the compiler's double buffering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from ascend_kernels.dispatch import (
    NPU,
    REFERENCE,
    TRITON,
    require_float,
    require_same_device,
    resolve_backend,
    triton_module,
)

DEFAULT_UB_SIZE_KB = 192
# Programs the planner keeps for parallelism: the vector cores of an Atlas A2 (40), and two
# per SM of an H200 (132 SMs) for the GPU plan.
NPU_MIN_PROGRAMS = 40
GPU_MIN_PROGRAMS = 264
# On a GPU the tile lives in registers; with this budget (same cost model) a program takes
# one Llama-size token in steps of 16 query heads x 64 pairs at 4 warps, the fastest tiling
# measured on an H200 at 4096 and 32768 tokens (more tokens or heads per step were slower).
GPU_TILE_BUDGET_BYTES = 32 * 1024
MAX_TOKENS_PER_PROGRAM = 64


@dataclass(frozen=True)
class RopeLaunchConfig:
    """Block sizes of the Triton RoPE kernel (all powers of two)."""

    tokens_per_program: int
    block_heads_q: int      # query heads per step
    block_heads_k: int      # key heads per step
    block_rot: int          # >= rotary_dim // 2: pairs rotated per head
    block_pass: int         # >= head_size - rotary_dim: elements copied per head (min 1)
    num_programs: int
    num_warps: int          # used by GPUs; triton-ascend ignores it
    ub_size_kb: int         # the UB size planned for (0 for the GPU plan)
    budget_bytes: int       # bytes the tile may use
    tile_bytes: int         # bytes the chosen tile uses (cost model below)


def _next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _floor_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n.bit_length() - 1)


def _tile_bytes(tokens: int, heads: int, block_rot: int, block_pass: int, partial: bool,
                elem: int) -> int:
    """UB bytes of one step: per rotated pair the two loaded values, their float32 copies,
    the two float32 results, the two stored casts and a mask byte; per head the copied
    tail (value and mask); per token cos and sin (as loaded and as float32) and the
    position."""
    pair = 4 * elem + 16 + 1
    tail = block_pass * (elem + 1) if partial else 0
    per_token = heads * (block_rot * pair + tail) + block_rot * 2 * 8 + 8
    return tokens * per_token


@lru_cache(maxsize=512)
def _plan(num_tokens: int, num_heads_q: int, num_heads_k: int, head_size: int,
          rotary_dim: int, dtype: torch.dtype, budget_bytes: int, min_programs: int,
          ub_size_kb: int) -> RopeLaunchConfig:
    elem = dtype.itemsize
    partial = rotary_dim < head_size
    block_rot = _next_power_of_2(rotary_dim // 2)
    block_pass = _next_power_of_2(head_size - rotary_dim) if partial else 1
    block_q = _next_power_of_2(num_heads_q)
    block_k = _next_power_of_2(max(num_heads_k, 1))

    def tile(tokens: int) -> int:
        return _tile_bytes(tokens, max(block_q, block_k), block_rot, block_pass, partial, elem)

    # Heads first: split the larger head block until one token fits.
    while tile(1) > budget_bytes and max(block_q, block_k) > 1:
        if block_q >= block_k:
            block_q //= 2
        else:
            block_k //= 2
    if tile(1) > budget_bytes:
        raise ValueError(
            f"rope_launch_config: one head of {head_size} elements (rotary_dim {rotary_dim}, "
            f"{dtype}) needs {tile(1)} bytes, more than the {budget_bytes}-byte budget; "
            "raise the UB size"
        )
    most_tokens = min(MAX_TOKENS_PER_PROGRAM,
                      _floor_power_of_2(max(1, num_tokens // max(min_programs, 1))))
    tokens = 1
    while tokens * 2 <= most_tokens and tile(tokens * 2) <= budget_bytes:
        tokens *= 2
    elements = tokens * max(block_q, block_k) * block_rot
    return RopeLaunchConfig(
        tokens_per_program=tokens,
        block_heads_q=block_q,
        block_heads_k=block_k,
        block_rot=block_rot,
        block_pass=block_pass,
        num_programs=math.ceil(num_tokens / tokens) if num_tokens else 0,
        num_warps=min(8, max(2, elements // 256)),
        ub_size_kb=ub_size_kb,
        budget_bytes=budget_bytes,
        tile_bytes=tile(tokens),
    )


@lru_cache(maxsize=1)
def device_ub_size_kb() -> int | None:
    """The UB size triton-ascend reports for the npu, in KB, or None when nothing does.

    triton-ascend's driver exposes ``get_device_properties("npu")``; a UB entry there is
    used when present (``ub_size_kb``/``ub_size_in_kbytes`` in KB, ``ub_size`` in bytes).
    """
    triton = triton_module()
    if triton is None:
        return None
    try:
        properties = triton.runtime.driver.active.utils.get_device_properties("npu")
    except Exception:  # no active driver (CPU), or a GPU driver that wants an index
        return None
    if not isinstance(properties, dict):
        return None
    for key in ("ub_size_kb", "ub_size_in_kbytes"):
        if isinstance(properties.get(key), int) and properties[key] > 0:
            return properties[key]
    if isinstance(properties.get("ub_size"), int) and properties["ub_size"] > 0:
        return properties["ub_size"] // 1024
    return None


def _check_count(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"rope_launch_config: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"rope_launch_config: {name}={value} must be at least {minimum}")


def rope_launch_config(num_tokens: int, num_heads_q: int, num_heads_k: int, head_size: int,
                       rotary_dim: int, dtype: torch.dtype, ub_size_kb: int = 0
                       ) -> RopeLaunchConfig:
    """Block sizes and tokens per program of the Triton RoPE kernel on an Ascend NPU.

    ``ub_size_kb`` is ``VLLM_ASCEND_ROPE_UB_SIZE_KB``'s value: 0 means auto (the device's
    UB size when triton-ascend reports it, else 192 KB). Half of the UB is the budget; the
    tile (``tile_bytes``) never exceeds it, heads are split into steps only when one token
    of all heads does not fit, and the rest goes to more tokens per program (at most 64,
    and few enough to keep 40 programs busy).
    """
    _check_count("num_tokens", num_tokens, 0)
    _check_count("num_heads_q", num_heads_q, 1)
    _check_count("num_heads_k", num_heads_k, 0)
    _check_count("head_size", head_size, 2)
    _check_count("rotary_dim", rotary_dim, 2)
    _check_count("ub_size_kb", ub_size_kb, 0)
    if rotary_dim % 2 or rotary_dim > head_size:
        raise ValueError(
            f"rope_launch_config: rotary_dim={rotary_dim} must be even and at most "
            f"head_size={head_size}"
        )
    if ub_size_kb == 0:
        ub_size_kb = device_ub_size_kb() or DEFAULT_UB_SIZE_KB
    return _plan(num_tokens, num_heads_q, num_heads_k, head_size, rotary_dim, dtype,
                 ub_size_kb * 1024 // 2, NPU_MIN_PROGRAMS, ub_size_kb)


def gpu_rope_launch_config(num_tokens: int, num_heads_q: int, num_heads_k: int,
                           head_size: int, rotary_dim: int, dtype: torch.dtype
                           ) -> RopeLaunchConfig:
    """The same planner with a register budget instead of a UB, for CUDA GPUs."""
    return _plan(num_tokens, num_heads_q, num_heads_k, head_size, rotary_dim, dtype,
                 GPU_TILE_BUDGET_BYTES, GPU_MIN_PROGRAMS, 0)


# --- the op ---------------------------------------------------------------------------------


def rotary_embedding_reference(positions: torch.Tensor, query: torch.Tensor,
                               key: torch.Tensor | None, cos_sin_cache: torch.Tensor,
                               head_size: int, is_neox_style: bool = True
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New tensors shaped like ``query`` and ``key``; computed in float32."""
    num_tokens = positions.numel()
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache.index_select(0, positions.reshape(-1)).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        if num_tokens == 0:
            return x.clone()
        heads = x.reshape(num_tokens, -1, head_size).float()
        rot, kept = heads[..., :rotary_dim], heads[..., rotary_dim:]
        if is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            rotated = rotated.flatten(-2)
        return torch.cat((rotated, kept), dim=-1).to(x.dtype).reshape(x.shape)

    return rotate(query), None if key is None else rotate(key)


def _check_rope_inputs(positions, query, key, cos_sin_cache, head_size) -> None:
    op = "rotary_embedding"
    if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int32,
                                                                           torch.int64):
        got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions)
        raise TypeError(f"{op}: positions must be an int64 or int32 tensor, got {got}")
    require_float(op, "query", query)
    require_float(op, "cos_sin_cache", cos_sin_cache)
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size < 2:
        raise ValueError(f"{op}: head_size must be an int of at least 2, got {head_size!r}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"{op}: cos_sin_cache must be [max_position, rotary_dim], got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_size:
        raise ValueError(f"{op}: rotary_dim (cos_sin_cache's last dim) is {rotary_dim}; it "
                         f"must be even and between 2 and head_size={head_size}")
    tensors = {"query": query} if key is None else {"query": query, "key": key}
    for name, x in tensors.items():
        if x.dim() < 1 or x.shape[-1] % head_size:
            raise ValueError(f"{op}: {name}'s last dim ({x.shape[-1] if x.dim() else None}) "
                             f"must be a multiple of head_size={head_size} ([T, H * D] or "
                             "[T, H, D])")
        if tuple(x.shape[:positions.dim()]) != tuple(positions.shape) or x.dim() <= (
                positions.dim()):
            raise ValueError(f"{op}: {name} of shape {tuple(x.shape)} does not start with "
                             f"positions' shape {tuple(positions.shape)} (one row of heads "
                             "per position)")
    if key is not None:
        if key.dtype != query.dtype:
            raise TypeError(f"{op}: key has dtype {key.dtype} but query has {query.dtype}; "
                            "they must match")
    require_same_device(op, positions=positions, query=query, key=key,
                        cos_sin_cache=cos_sin_cache)


def _heads_view(x: torch.Tensor, num_tokens: int, head_size: int) -> torch.Tensor:
    """``x`` as ``[T, H, D]`` with dense heads, a view when the strides allow it."""
    try:
        heads = x.view(num_tokens, -1, head_size)
    except RuntimeError:
        heads = x.reshape(num_tokens, -1, head_size)
    if heads.stride(2) != 1 or (heads.shape[1] > 1 and heads.stride(1) != head_size):
        heads = heads.contiguous()
    return heads


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, head_size: int,
                     is_neox_style: bool = True, *, inplace: bool = False,
                     ub_size_kb: int = 0, backend: str | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotate ``query`` and ``key`` by the cos/sin of ``positions``.

    Returns ``(query, key)`` rotated, shaped as given (``key`` may be None). With
    ``inplace=True`` the given tensors are overwritten and returned. ``ub_size_kb`` sizes
    the Triton launch on npu (pass ``VLLM_ASCEND_ROPE_UB_SIZE_KB``; 0 = auto). Positions
    must lie in ``[0, max_position)``; the Triton backend does not check them (that would
    synchronise with the device).
    """
    _check_rope_inputs(positions, query, key, cos_sin_cache, head_size)
    num_tokens = positions.numel()
    rotary_dim = cos_sin_cache.shape[-1]
    per_token = max(num_tokens * head_size, 1)
    num_heads = max(query.numel() // per_token, 0 if key is None else key.numel() // per_token)
    from ascend_kernels.npu_ops.rope import rotary_embedding_problem

    chosen = resolve_backend("rotary_embedding", query, (REFERENCE, TRITON, NPU), backend,
                             {NPU: rotary_embedding_problem(num_heads, rotary_dim)})
    if chosen == REFERENCE or num_tokens == 0:
        q_out, k_out = rotary_embedding_reference(positions, query, key, cos_sin_cache,
                                                  head_size, is_neox_style)
    elif chosen == NPU:
        from ascend_kernels.npu_ops import rope as npu_rope

        q3 = _heads_view(query, num_tokens, head_size)
        k3 = None if key is None else _heads_view(key, num_tokens, head_size)
        q_out, k_out = npu_rope.rotary_embedding(positions, q3, k3, cos_sin_cache,
                                                 is_neox_style, inplace)
        q_out = q_out.reshape(query.shape)
        k_out = None if k_out is None else k_out.reshape(key.shape)
    else:
        q_out, k_out = _triton_rotary_embedding(positions, query, key, cos_sin_cache,
                                                head_size, is_neox_style, inplace, ub_size_kb)
    if not inplace:
        return q_out, k_out
    # Identity, not data pointers: torch.compile (vLLM's default) cannot trace the latter.
    if q_out is not query:
        query.copy_(q_out)
    if key is not None and k_out is not key:
        key.copy_(k_out)
    return query, key


def _triton_rotary_embedding(positions, query, key, cos_sin_cache, head_size, is_neox_style,
                             inplace, ub_size_kb, config: RopeLaunchConfig | None = None,
                             mrope_section: tuple[int, int, int] | None = None,
                             mrope_interleaved: bool = False):
    from ascend_kernels.triton_kernels import rope as triton_rope

    num_tokens = positions.shape[-1]
    q3 = _heads_view(query, num_tokens, head_size)
    k3 = None if key is None else _heads_view(key, num_tokens, head_size)
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    if config is None:
        planner_args = (num_tokens, q3.shape[1], 0 if k3 is None else k3.shape[1], head_size,
                        cache.shape[-1], query.dtype)
        if query.device.type == "cuda":
            config = gpu_rope_launch_config(*planner_args)
        else:
            config = rope_launch_config(*planner_args, ub_size_kb=ub_size_kb)
    # In place only where the heads view is the caller's memory; otherwise new tensors.
    q_out = q3 if inplace and q3.data_ptr() == query.data_ptr() else torch.empty_like(
        q3, memory_format=torch.contiguous_format)
    k_out = None
    if k3 is not None:
        k_out = k3 if inplace and k3.data_ptr() == key.data_ptr() else torch.empty_like(
            k3, memory_format=torch.contiguous_format)
    flat = positions.contiguous() if mrope_section else positions.reshape(-1).contiguous()
    triton_rope.rotary_embedding(flat, q3, k3, cache, is_neox_style, q_out, k_out, config,
                                 mrope_section, mrope_interleaved)
    return _as_given(q_out, query), None if key is None else _as_given(k_out, key)


def _as_given(out: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """``out`` shaped as ``given``; ``given`` itself when ``out`` is a view of it."""
    if out.data_ptr() == given.data_ptr() and out.numel() == given.numel():
        return given
    return out.reshape(given.shape)


# --- multimodal RoPE -------------------------------------------------------------------------


def mrope_cos_sin(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  mrope_section: tuple[int, int, int] | list[int],
                  interleaved: bool = False) -> torch.Tensor:
    """Each token's ``[cos | sin]`` row ``[T, rotary_dim]`` for ``positions`` ``[3, T]``
    (temporal, height, width): rotated pair ``i`` takes the row of its section's position,
    the T / H / W sections one after another, or interleaved (pair ``i`` is H where
    ``i % 3 == 1`` and ``i < 3 * H``, W where ``i % 3 == 2`` and ``i < 3 * W``, else T), as
    vLLM's ``MRotaryEmbedding.forward_native`` selects them."""
    half = cos_sin_cache.shape[-1] // 2
    pairs = torch.arange(half, device=positions.device)
    if interleaved:
        section = torch.where((pairs % 3 == 1) & (pairs < 3 * mrope_section[1]), 1, 0)
        section = torch.where((pairs % 3 == 2) & (pairs < 3 * mrope_section[2]), 2, section)
    else:
        section = (pairs >= mrope_section[0]).long() + (
            pairs >= mrope_section[0] + mrope_section[1]).long()
    rows = positions.long()[section]  # [half, T]: the position each pair reads
    columns = torch.cat((pairs, pairs + half))
    return cos_sin_cache[torch.cat((rows, rows)).t(), columns]


def mrope_reference(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    cos_sin_cache: torch.Tensor, head_size: int,
                    mrope_section: tuple[int, int, int] | list[int],
                    is_neox_style: bool = True, interleaved: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """New tensors: each token's selected ``[cos | sin]`` row (:func:`mrope_cos_sin`), then
    :func:`rotary_embedding_reference`; float32 inside."""
    per_token = mrope_cos_sin(positions, cos_sin_cache, mrope_section, interleaved)
    steps = torch.arange(positions.shape[-1], device=positions.device)
    return rotary_embedding_reference(steps, query, key, per_token, head_size, is_neox_style)


def _check_mrope(positions, query, key, cos_sin_cache, head_size, mrope_section) -> None:
    op = "mrope"
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or (
            positions.shape[0] != 3):
        got = tuple(positions.shape) if isinstance(positions, torch.Tensor) else positions
        raise ValueError(f"{op}: positions must be [3, num_tokens] (temporal, height, width), "
                         f"got {got}; pass 1-D positions to rotary_embedding")
    if key is None:
        raise ValueError(f"{op}: key is required (vLLM's MRotaryEmbedding rotates both)")
    if (not isinstance(mrope_section, (list, tuple)) or len(mrope_section) != 3
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 0
                   for n in mrope_section)):
        raise ValueError(f"{op}: mrope_section must be three non-negative ints (T, H, W pairs), "
                         f"got {mrope_section!r}")
    rotary_dim = cos_sin_cache.shape[-1] if isinstance(cos_sin_cache, torch.Tensor) else None
    if rotary_dim is not None and sum(mrope_section) * 2 != rotary_dim:
        raise ValueError(f"{op}: mrope_section {list(mrope_section)} covers "
                         f"{sum(mrope_section)} pairs but the cache rotates {rotary_dim // 2} "
                         f"(rotary_dim {rotary_dim}); the sections must add up to rotary_dim / 2")
    _check_rope_inputs(positions[0], query, key, cos_sin_cache, head_size)


def mrope(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
          cos_sin_cache: torch.Tensor, head_size: int,
          mrope_section: tuple[int, int, int] | list[int], is_neox_style: bool = True,
          interleaved: bool = False, *, inplace: bool = False, ub_size_kb: int = 0,
          backend: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary embedding (Qwen2-VL / Qwen2.5-VL / Qwen3-VL): ``positions``
    ``[3, T]``, each rotated pair by the cos/sin of its section's position
    (:func:`mrope_cos_sin`), otherwise as :func:`rotary_embedding` (partial rotary, neox or
    gptj, ``inplace``).

    Backends: the reference (the selected rows, then :func:`rotary_embedding_reference`);
    Triton (one launch, each pair reading its section's position); torch_npu
    (``npu_mrope`` where its page serves the shape, see ``npu_ops.rope.mrope_problem``).
    """
    _check_mrope(positions, query, key, cos_sin_cache, head_size, mrope_section)
    section = tuple(int(n) for n in mrope_section)
    num_tokens = positions.shape[-1]
    rotary_dim = cos_sin_cache.shape[-1]
    from ascend_kernels.npu_ops.rope import mrope_problem

    num_heads = query.numel() // max(num_tokens * head_size, 1)
    chosen = resolve_backend("mrope", query, (REFERENCE, TRITON, NPU), backend,
                             {NPU: mrope_problem(head_size, rotary_dim, num_heads, section,
                                                 is_neox_style, interleaved, query.dtype)})
    if chosen == REFERENCE or num_tokens == 0:
        q_out, k_out = mrope_reference(positions, query, key, cos_sin_cache, head_size,
                                       section, is_neox_style, interleaved)
    elif chosen == NPU:
        from ascend_kernels.npu_ops import rope as npu_rope

        q_out, k_out = npu_rope.mrope(positions, query, key, cos_sin_cache, head_size,
                                      section, is_neox_style)
    else:
        q_out, k_out = _triton_rotary_embedding(positions, query, key, cos_sin_cache,
                                                head_size, is_neox_style, inplace, ub_size_kb,
                                                mrope_section=section,
                                                mrope_interleaved=interleaved)
    if not inplace:
        return q_out, k_out
    if q_out is not query:
        query.copy_(q_out)
    if k_out is not key:
        key.copy_(k_out)
    return query, key
