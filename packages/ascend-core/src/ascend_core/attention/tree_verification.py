"""Tree verification steps (Medusa's candidate trees) for both model runners, and the host
target's attention path for tree masks, which vLLM's CPU attention kernel does not have.

In a tree step a request scores its last accepted token (the root) and ``m`` draft nodes in
one query. The runner gives each node the position ``root + depth`` (``tree_positions``);
the KV cache slots stay consecutive, so node ``j`` is stored at slot position
``root + 1 + j``. A wrapper around each attention layer keeps the nodes' keys and values;
on the host, where vLLM's kernel writes the cache and attends causally, it also recomputes
the node rows in torch, each over the context, its ancestors and itself (the npu backend
applies the tree mask in its fused op). After verification, ``compact`` writes the
accepted path's keys and values to the slots after the root through the layer's own cache
write, so no rejected branch survives into the next step: the scheduler keeps the tokens
up to the accepted path and later steps overwrite the rest.

The context is read back from vLLM's CPU cache, whose per-block layout depends on the
kernel ISA (keys transposed for the vector kernels, pair-interleaved for AMX). The layout
is not hard-coded: :func:`cache_layout` probes it once per (ISA, dtype, block size, head
size) by writing known values through vLLM's cache-write op.

The drafter's tree is duck-typed (``depths``, ``ancestor_mask(m)``), so this module needs
nothing of ascend-specdec.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class TreeRequest:
    index: int  # the request's row in the batch (and in the block table)
    query_start: int  # its root token's row among the step's tokens
    root_position: int  # the root's position: context tokens before it
    mask: torch.Tensor  # [m + 1, m + 1] bool: the root and nodes each row may attend to

    @property
    def num_nodes(self) -> int:
        return self.mask.shape[0] - 1

    @functools.cached_property
    def allowed(self) -> torch.Tensor:
        """``[m, root + m + 1]``: the keys each node row attends to (context, ancestors,
        itself)."""
        context = torch.ones((self.num_nodes, self.root_position), dtype=torch.bool)
        return torch.cat([context, self.mask[1:]], dim=1)


@dataclass
class _LayerNodes:
    """One attention layer's nodes of a step, kept for ``compact``."""

    impl: Any
    layer: Any
    kv_cache: torch.Tensor
    # Per tree request: the slots of positions root + 1 .. root + m, and the nodes' keys
    # and values [m, kv_heads, head] as written there.
    slots: list[torch.Tensor] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    def keep(self, request: TreeRequest, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
        nodes = slice(request.query_start + 1, request.query_start + 1 + request.num_nodes)
        self.slots.append(slot_mapping[nodes].clone())
        self.keys.append(key[nodes].clone())
        self.values.append(value[nodes].clone())


@dataclass
class TreeStep:
    requests: list[TreeRequest]
    layers: list[_LayerNodes] = field(default_factory=list)


_current: TreeStep | None = None


def current_step() -> TreeStep | None:
    return _current


def set_step(step: TreeStep | None) -> None:
    global _current
    _current = step


def plan_step(tree: Any, num_draft_tokens: Sequence[int], query_start_loc: Sequence[int],
              num_computed_tokens: Sequence[int]) -> TreeStep | None:
    """The step's tree requests (those with drafts), or None when no request has any."""
    requests = [
        TreeRequest(index=r, query_start=int(query_start_loc[r]),
                    root_position=int(num_computed_tokens[r]), mask=tree.ancestor_mask(m))
        for r, m in enumerate(num_draft_tokens) if m > 0
    ]
    return TreeStep(requests) if requests else None


def tree_positions(step: TreeStep, tree: Any, positions: torch.Tensor) -> None:
    """Give each node the position of its depth below the root, in place."""
    for request in step.requests:
        m = request.num_nodes
        start = request.query_start + 1
        depths = torch.tensor(tree.depths[:m], dtype=positions.dtype)
        positions[start:start + m] = request.root_position + depths.to(positions.device)


# --------------------------------------------------------------------------- cache layout


def _split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU cache ``[blocks, kv_heads, block, 2 * head]`` as its key and value parts,
    the way vLLM's CPU attention splits it."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    view = kv_cache.view(blocks, kv_heads, 2 * block_size, -1)
    key_cache, value_cache = view.chunk(2, dim=2)
    return key_cache, value_cache


@functools.lru_cache(maxsize=16)
def cache_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's cache-write op puts token ``t``'s element ``d`` of one (block, kv head):
    for keys and for values, ``[block_size * head_size]`` indices into that block-head's
    ``block_size * head_size`` elements, in ``(t, d)`` order. Probed by writing ``t`` and
    then ``d`` as values (exact in every float dtype up to 256)."""
    if block_size > 256 or head_size > 256:
        raise ValueError(f"tree verification reads caches of blocks and heads up to 256, got "
                         f"block_size={block_size}, head_size={head_size}")
    from vllm import _custom_ops as ops

    slots = torch.arange(block_size, dtype=torch.long)
    token = torch.arange(block_size, dtype=torch.float32)[:, None, None].expand(
        block_size, 1, head_size)
    dim = torch.arange(head_size, dtype=torch.float32)[None, None, :].expand(
        block_size, 1, head_size)
    found = []
    for values in (token, dim):
        cache = torch.zeros((1, 1, block_size, 2 * head_size), dtype=dtype)
        key_cache, value_cache = _split_cache(cache)
        written = values.to(dtype).contiguous()
        ops.cpu_attn_reshape_and_cache(written, written, key_cache, value_cache, slots, isa,
                                       k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        found.append(cache.view(2, block_size * head_size).float().round().long())
    layouts = []
    for part in (0, 1):
        plain = found[0][part] * head_size + found[1][part]
        where = torch.empty_like(plain)
        where[plain] = torch.arange(plain.numel())
        if not torch.equal(plain[where], torch.arange(plain.numel())):
            raise RuntimeError(f"vLLM's CPU cache layout for isa={isa!r} ({dtype}, block "
                               f"{block_size}, head {head_size}) is not a permutation of "
                               "the tokens' elements; tree verification cannot read it")
        layouts.append(where)
    return layouts[0], layouts[1]


@functools.lru_cache(maxsize=16)
def _block_forms(isa: str, dtype: torch.dtype, block_size: int, head_size: int
                 ) -> tuple[str | torch.Tensor, str | torch.Tensor]:
    """For keys and values: "tokens" for blocks stored token-major (``[block, head]``),
    "dims" for dimension-major (``[head, block]``), else ``cache_layout``'s indices."""
    tokens = torch.arange(block_size).view(-1, 1)
    dims = torch.arange(head_size).view(1, -1)
    forms = {"tokens": (tokens * head_size + dims).flatten(),
             "dims": (dims * block_size + tokens).flatten()}
    found = cache_layout(isa, dtype, block_size, head_size)
    return tuple(next((name for name, where in forms.items() if torch.equal(layout, where)),
                      layout) for layout in found)


def read_contexts(layer: Any, kv_cache: torch.Tensor,
                  requests: Sequence[tuple[torch.Tensor, int]]
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys and values ``[n, kv_heads, head]`` of each request's first ``n`` tokens, for
    ``(block table row, n)`` pairs: one gather of every block they use, one reordering."""
    blocks, kv_heads, block_size, double_head = kv_cache.shape
    head_size = double_head // 2
    key_form, value_form = _block_forms(layer.isa, kv_cache.dtype, block_size, head_size)
    used = [-(-n // block_size) for _, n in requests]
    table = torch.cat([row[:count] for (row, _), count in zip(requests, used, strict=True)])
    region = kv_cache.view(blocks, kv_heads, 2, block_size * head_size)[table.long()]

    def plain(part: int, form: str | torch.Tensor) -> list[torch.Tensor]:
        stored = region[:, :, part]
        if isinstance(form, torch.Tensor):  # any other order (AMX's pairs): one gather
            rows = stored.reshape(-1, block_size * head_size)[:, form]
            rows = rows.view(-1, kv_heads, block_size, head_size)
        elif form == "tokens":
            rows = stored.view(-1, kv_heads, block_size, head_size)
        else:
            rows = stored.view(-1, kv_heads, head_size, block_size).transpose(2, 3)
        rows = rows.permute(0, 2, 1, 3).reshape(-1, kv_heads, head_size)
        split = rows.split([count * block_size for count in used])
        return [tokens[:n] for tokens, (_, n) in zip(split, requests, strict=True)]

    return list(zip(plain(0, key_form), plain(1, value_form), strict=True))


def read_context(layer: Any, kv_cache: torch.Tensor, block_row: torch.Tensor,
                 num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[num_tokens, kv_heads, head]`` of one request's first tokens."""
    return read_contexts(layer, kv_cache, [(block_row, num_tokens)])[0]


# --------------------------------------------------------------------------- attention


def check_layer(name: str, impl: Any) -> None:
    """Refuse a layer whose attention the tree path does not reproduce."""
    unsupported = [what for what, present in (
        ("a sliding window", getattr(impl, "sliding_window", None) not in (None, -1)
         and getattr(impl, "sliding_window", None) != (-1, -1)),
        ("ALiBi slopes", getattr(impl, "alibi_slopes", None) is not None),
        ("a logit soft cap", bool(getattr(impl, "logits_soft_cap", 0) or 0)),
        ("attention sinks", getattr(impl, "sinks", None) is not None),
        (f"a quantized KV cache ({getattr(impl, 'kv_cache_dtype', '')})",
         getattr(impl, "kv_cache_dtype", "auto") not in ("auto", None)),
    ) if present]
    if unsupported:
        raise ValueError(f"Medusa tree verification (medusa_tree_config) does not serve "
                         f"attention layer {name} with {', '.join(unsupported)}; remove "
                         "medusa_tree_config to verify one chain")


def install(attention_layers: dict[str, Any], *, recompute: bool,
            check: Callable[[str, Any], None] = check_layer) -> int:
    """Wrap the forward of every attention layer's implementation so that tree steps keep
    their nodes' keys and values for ``compact`` and, with ``recompute`` (vLLM's CPU
    attention, which has no tree mask), recompute their node rows. ``check`` refuses a
    layer the target's tree path does not serve. Returns the number of layers wrapped."""
    wrapped = 0
    for name, layer in attention_layers.items():
        impl = getattr(layer, "impl", None)
        if impl is None or getattr(impl, "_tree_wrapped", False):
            continue
        check(name, impl)
        original = impl.forward

        def forward(layer, query, key, value, kv_cache, attn_metadata, output, *args,
                    _original=original, _impl=impl, **kwargs):
            result = _original(layer, query, key, value, kv_cache, attn_metadata, output,
                               *args, **kwargs)
            step = _current
            if step is not None and attn_metadata is not None:
                kept = _LayerNodes(_impl, layer, kv_cache)
                for request in step.requests:
                    kept.keep(request, key, value, attn_metadata.slot_mapping)
                step.layers.append(kept)
                if recompute:
                    attend_nodes(step, _impl, layer, query, key, value, kv_cache,
                                 attn_metadata, output)
            return result

        impl.forward = forward
        impl._tree_wrapped = True
        wrapped += 1
    return wrapped


def attend_nodes(step: TreeStep, impl: Any, layer: Any, query: torch.Tensor,
                 key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 attn_metadata: Any, output: torch.Tensor) -> None:
    """Recompute the node rows of every tree request in ``output`` (vLLM's CPU attention
    and cache layout), in float32, as the kernel accumulates."""
    heads, head_size = query.shape[1], query.shape[2]
    rows_out = output.view(output.shape[0], heads, head_size)
    contexts = read_contexts(layer, kv_cache, [
        (attn_metadata.block_table[request.index], request.root_position)
        for request in step.requests])
    for request, (context_k, context_v) in zip(step.requests, contexts, strict=True):
        m, start = request.num_nodes, request.query_start
        nodes = slice(start + 1, start + 1 + m)
        keys = torch.cat([context_k, key[start:start + 1 + m]]).float().transpose(0, 1)
        values = torch.cat([context_v, value[start:start + 1 + m]]).float().transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            query[nodes].float().transpose(0, 1).unsqueeze(0), keys.unsqueeze(0),
            values.unsqueeze(0), attn_mask=request.allowed, scale=impl.scale,
            enable_gqa=heads != keys.shape[0])
        rows_out[nodes] = attended.squeeze(0).transpose(0, 1).to(rows_out.dtype)


def compact(step: TreeStep, accepted: Sequence[Sequence[int]]) -> int:
    """Move each request's accepted path (``accepted[request.index]``: its nodes, root
    first) to the slots right after its root (those the step gave its first nodes), in
    every layer's cache, through the layer's own cache write. Returns the tokens moved
    per layer."""
    moved = 0
    for kept in step.layers:
        keys, values, slots = [], [], []
        for request, node_slots, node_keys, node_values in zip(
                step.requests, kept.slots, kept.keys, kept.values, strict=True):
            for depth, node in enumerate(accepted[request.index], start=1):
                if node != depth - 1:  # node `depth - 1` is in place already
                    slots.append(node_slots[depth - 1])
                    keys.append(node_keys[node])
                    values.append(node_values[node])
        if slots:
            kept.impl.do_kv_cache_update(kept.layer, torch.stack(keys), torch.stack(values),
                                         kept.kv_cache, torch.stack(slots))
        moved = len(slots)
    return moved
