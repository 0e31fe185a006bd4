"""Tree verification steps (Medusa's candidate trees) for both model runners, and the host
target's attention path for tree masks, which vLLM's CPU attention kernel does not have.

In a tree step a request scores its last accepted token (the root) and ``m`` draft nodes in
one query. The runner gives each node the position ``root + depth`` (``tree_positions``);
the KV cache slots stay consecutive, so node ``j`` is stored at slot position
``root + 1 + j``. A wrapper around each attention layer keeps the nodes' keys and values;
on the host, where vLLM's kernel writes the cache and attends causally, it also recomputes
the node rows in torch, each over the context, its ancestors and itself, every tree request
of the step in one padded masked attention per layer (the npu backend applies the tree
mask in its fused op). After verification, ``compact`` writes the
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


@dataclass
class _LayerNodes:
    """One attention layer's nodes of a step, kept for ``compact``: the layer, its cache,
    and, for every node of the step's tree requests (``TreeStep.node_rows`` order), its
    slot (positions root + 1 .. root + m of its request) and its key and value
    ``[kv_heads, head]`` as written there."""

    impl: Any
    layer: Any
    kv_cache: torch.Tensor
    slots: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


@dataclass
class TreeStep:
    requests: list[TreeRequest]
    layers: list[_LayerNodes] = field(default_factory=list)
    # Per (attention metadata, block size): the host recompute's gather indices and mask,
    # the same for every layer that shares them.
    plans: dict[tuple[int, int], _NodePlan] = field(default_factory=dict)

    @functools.cached_property
    def node_rows(self) -> torch.Tensor:
        """The step's query rows of every tree request's nodes, request by request."""
        return torch.cat([torch.arange(r.query_start + 1, r.query_start + 1 + r.num_nodes)
                          for r in self.requests])

    def keep(self, impl: Any, layer: Any, kv_cache: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Copy one layer's node keys, values and slots (the layer's tensors are not kept:
        buffers may be reused once the layer is done)."""
        rows = self.node_rows.to(key.device)
        self.layers.append(_LayerNodes(impl, layer, kv_cache,
                                       slot_mapping.index_select(0, rows.to(slot_mapping.device)),
                                       key.index_select(0, rows), value.index_select(0, rows)))


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


def gather_tokens(layer: Any, kv_cache: torch.Tensor, table: torch.Tensor,
                  index: torch.Tensor, dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[kv_heads, *index.shape, head]`` (in ``dtype``, the cache's by
    default) of the cache's blocks ``table`` taken as one run of tokens (block ``table[i]``
    holds tokens ``i * block_size`` onwards), at ``index``: the blocks in one gather, each
    part put head-major and token-major in one copy (through views where its layout is
    token- or dimension-major), then the tokens."""
    num_blocks, kv_heads, block_size, double_head = kv_cache.shape
    head_size = double_head // 2
    region = kv_cache.view(num_blocks, kv_heads, 2, block_size * head_size)[table]
    parts = []
    for part, form in enumerate(_block_forms(layer.isa, kv_cache.dtype, block_size,
                                             head_size)):
        stored = region[:, :, part]
        if isinstance(form, torch.Tensor):  # any other order (AMX's pairs): one gather
            stored = stored[:, :, form.to(stored.device)]
        if isinstance(form, str) and form == "dims":
            blocks = stored.view(-1, kv_heads, head_size, block_size).permute(1, 0, 3, 2)
        else:
            blocks = stored.view(-1, kv_heads, block_size, head_size).transpose(0, 1)
        tokens = torch.empty(blocks.shape, dtype=dtype or kv_cache.dtype,
                             device=kv_cache.device).copy_(blocks)
        parts.append(tokens.view(kv_heads, -1, head_size)[:, index])
    return parts[0], parts[1]


def read_context(layer: Any, kv_cache: torch.Tensor, block_row: torch.Tensor,
                 num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[num_tokens, kv_heads, head]`` of one request's first tokens."""
    table = block_row[:-(-num_tokens // kv_cache.shape[2])].long()
    keys, values = gather_tokens(layer, kv_cache, table,
                                 torch.arange(num_tokens, device=block_row.device))
    return keys.transpose(0, 1), values.transpose(0, 1)


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
                step.keep(_impl, layer, kv_cache, key, value, attn_metadata.slot_mapping)
                if recompute:
                    attend_nodes(step, _impl, layer, query, kv_cache, attn_metadata, output)
            return result

        impl.forward = forward
        impl._tree_wrapped = True
        wrapped += 1
    return wrapped


@dataclass
class _NodePlan:
    """How the host recompute reads a step's tree requests: ``R`` requests, each padded to
    ``M`` nodes and ``L`` keys (its context, root and nodes, all in the cache once vLLM's
    kernel has written the step)."""

    table: torch.Tensor  # [blocks] every request's blocks, one request after another
    keys: torch.Tensor  # [R, L] each key's token in them (padding repeats the last key)
    queries: torch.Tensor  # [R, M] the query row of each node (padding repeats the last)
    mask: torch.Tensor  # [R, 1, M, L] 0 on the keys each node attends to, -inf elsewhere
    real: torch.Tensor  # [nodes] the real (not padding) entries of the flattened [R, M]
    rows: torch.Tensor  # [nodes] their query rows

    @classmethod
    def build(cls, step: TreeStep, block_table: torch.Tensor, block_size: int) -> _NodePlan:
        requests = step.requests
        length = max(r.root_position + 1 + r.num_nodes for r in requests)
        width = max(r.num_nodes for r in requests)
        tables, keys, queries = [], [], []
        allowed = torch.zeros((len(requests), width, length), dtype=torch.bool)
        first = 0  # the request's first token in the blocks gathered
        for i, r in enumerate(requests):
            m, root = r.num_nodes, r.root_position
            used = -(-(root + m + 1) // block_size)
            tables.append(block_table[r.index, :used])
            keys.append(first + torch.arange(length).clamp(max=root + m))
            queries.append(r.query_start + 1 + torch.arange(width).clamp(max=m - 1))
            allowed[i, :m, :root] = True  # the context
            allowed[i, :m, root:root + m + 1] = r.mask[1:]  # the root, ancestors, itself
            allowed[i, m:] = allowed[i, m - 1]
            first += used * block_size
        real = torch.cat([i * width + torch.arange(r.num_nodes)
                          for i, r in enumerate(requests)])
        queries = torch.stack(queries)
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        return cls(torch.cat(tables).long(), torch.stack(keys), queries, mask.unsqueeze(1),
                   real, queries.flatten()[real])


def attend_nodes(step: TreeStep, impl: Any, layer: Any, query: torch.Tensor,
                 kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor) -> None:
    """Recompute the node rows of every tree request in ``output`` (vLLM's CPU attention
    and cache layout), in float32, as the kernel accumulates: all requests in one masked
    attention, over keys and values read back from the cache, where vLLM's kernel has
    just written the step's."""
    heads, head_size = query.shape[1], query.shape[2]
    block_size = kv_cache.shape[2]
    where = (id(attn_metadata), block_size)
    plan = step.plans.get(where)
    if plan is None:
        plan = step.plans[where] = _NodePlan.build(step, attn_metadata.block_table, block_size)
    keys, values = (part.transpose(0, 1)  # [R, kv_heads, L, head]
                    for part in gather_tokens(layer, kv_cache, plan.table, plan.keys,
                                              torch.float32))
    queries = query[plan.queries].float().transpose(1, 2)  # [R, heads, M, head]
    attended = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=plan.mask, scale=impl.scale,
        enable_gqa=heads != keys.shape[1])
    nodes = attended.transpose(1, 2).reshape(-1, heads, head_size)[plan.real]
    output.view(output.shape[0], heads, head_size)[plan.rows] = nodes.to(output.dtype)


def compact(step: TreeStep, accepted: Sequence[Sequence[int]]) -> int:
    """Move each request's accepted path (``accepted[request.index]``: its nodes, root
    first) to the slots right after its root (those the step gave its first nodes), in
    every layer's cache, through the layer's own cache write. Returns the tokens moved
    per layer."""
    sources, targets, first = [], [], 0
    for request in step.requests:
        for depth, node in enumerate(accepted[request.index], start=1):
            if node != depth - 1:  # node `depth - 1` is in place already
                sources.append(first + node)
                targets.append(first + depth - 1)
        first += request.num_nodes
    if not sources:
        return 0
    source, target = torch.tensor(sources), torch.tensor(targets)
    for kept in step.layers:
        rows = source.to(kept.keys.device)
        kept.impl.do_kv_cache_update(kept.layer, kept.keys.index_select(0, rows),
                                     kept.values.index_select(0, rows), kept.kv_cache,
                                     kept.slots.index_select(0, target.to(kept.slots.device)))
    return len(sources)
