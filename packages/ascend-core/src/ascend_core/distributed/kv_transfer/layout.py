"""Where each KV block of each layer lives in memory, and which bytes a pull copies.

A layer's cache tensor has one dimension of size ``num_blocks``; a block's data is
every element with that index fixed. That data is one or more contiguous runs of
bytes (two for a ``[2, num_blocks, ...]`` K/V tensor, one for MLA's latent cache).
Each (layer, run) pair is a *plane*: a base address, the byte stride between
consecutive blocks and the run's length. A pull then copies, per plane and block,
``run_bytes`` from the remote plane to the local one; consecutive block ids on both
sides merge into one copy.

When the prefill node runs ``k`` times the decode node's tensor-parallel size, each of
the ``k`` prefill ranks a decode rank reads from holds 1/k of its KV heads: where a
block's run is head-major (heads its outermost axis, as in vLLM's CPU cache
``[blocks, heads, 2 * block_size, head_size]``), prefill rank ``j``'s whole run is the
``j``-th contiguous 1/k of the local run. Planes of equal size on both sides (MLA's
latent cache, replicated across ranks) are read from the first of the ``k`` ranks.

Torch only: no vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch


class KVLayoutError(ValueError):
    """A cache the connector cannot describe, or two instances whose caches differ."""


@dataclass(frozen=True)
class Plane:
    layer: str
    base: int  # address of block 0's run
    block_stride: int  # bytes from block i's run to block i+1's
    run_bytes: int  # contiguous bytes of one block in this plane
    head_major: bool = False  # the run's outermost axis is the KV heads


@dataclass(frozen=True)
class KVLayout:
    """One instance's (one rank's) cache description, as sent over the side channel."""

    block_size: int  # tokens per block
    num_blocks: int
    dtype: str
    planes: tuple[Plane, ...]

    def to_wire(self) -> dict:
        return {"block_size": self.block_size, "num_blocks": self.num_blocks,
                "dtype": self.dtype, "planes": [asdict(p) for p in self.planes]}

    @classmethod
    def from_wire(cls, data: Mapping) -> KVLayout:
        return cls(block_size=int(data["block_size"]), num_blocks=int(data["num_blocks"]),
                   dtype=str(data["dtype"]),
                   planes=tuple(Plane(**plane) for plane in data["planes"]))


def _blocks_view(tensor: torch.Tensor, num_blocks: int, layer: str) -> tuple[torch.Tensor, int]:
    """The tensor (regrouped if needed) and its block dimension. vLLM's per-layer views put
    blocks first; kernel blocks smaller than the manager's make dim 0 a multiple of
    ``num_blocks``, regrouped here so that one block is one manager block."""
    if tensor.dim() and tensor.shape[0] == num_blocks:
        return tensor, 0
    dims = [d for d, size in enumerate(tensor.shape) if size == num_blocks]
    if len(dims) == 1:
        return tensor, dims[0]
    if not dims and tensor.dim() and tensor.shape[0] % num_blocks == 0:
        return tensor.unflatten(0, (num_blocks, -1)), 0
    raise KVLayoutError(
        f"KV cache of layer {layer!r} has shape {tuple(tensor.shape)}: expected blocks "
        f"(num_blocks={num_blocks}) in dimension 0 or in exactly one dimension")


def layer_planes(layer: str, tensor: torch.Tensor, num_blocks: int,
                 num_kv_heads: int | None = None) -> list[Plane]:
    """The planes of one layer's cache tensor (any dimension order, views allowed)."""
    tensor, block_dim = _blocks_view(tensor, num_blocks, layer)
    item = tensor.element_size()
    others = sorted((d for d in range(tensor.dim()) if d != block_dim),
                    key=lambda d: tensor.stride(d))
    # The innermost dimensions whose strides chain up form one contiguous run.
    run = 1
    outer = []
    outermost_in_run = None
    for d in others:
        if tensor.shape[d] == 1:
            continue
        if not outer and tensor.stride(d) == run:
            run *= tensor.shape[d]
            outermost_in_run = d
        else:
            outer.append(d)
    head_major = (num_kv_heads is not None and outermost_in_run is not None
                  and tensor.shape[outermost_in_run] == num_kv_heads)
    offsets = [0]
    for d in outer:
        offsets = [o + i * tensor.stride(d) for o in offsets for i in range(tensor.shape[d])]
    base = tensor.data_ptr()
    block_stride = tensor.stride(block_dim) * item
    return [Plane(layer=layer, base=base + o * item, block_stride=block_stride,
                  run_bytes=run * item, head_major=head_major) for o in sorted(offsets)]


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                       num_blocks: int, block_size: int,
                       num_kv_heads: int | None = None) -> KVLayout:
    """The layout of vLLM's ``register_kv_caches`` argument (a tensor, or a tuple of
    tensors such as MLA's latent and rope caches, per layer); ``num_kv_heads`` (this
    rank's) marks head-major planes."""
    planes: list[Plane] = []
    dtypes = set()
    for layer in sorted(kv_caches):
        value = kv_caches[layer]
        tensors = [value] if isinstance(value, torch.Tensor) else list(value)
        for index, tensor in enumerate(tensors):
            name = layer if len(tensors) == 1 else f"{layer}[{index}]"
            planes.extend(layer_planes(name, tensor, num_blocks, num_kv_heads))
            dtypes.add(str(tensor.dtype).removeprefix("torch."))
    if not planes:
        raise KVLayoutError("no KV cache tensors to register")
    return KVLayout(block_size=block_size, num_blocks=num_blocks,
                    dtype="/".join(sorted(dtypes)), planes=tuple(planes))


def memory_regions(kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]]
                   ) -> list[tuple[int, int]]:
    """(address, length) of the memory behind the caches, overlaps merged: what the
    transfer engine registers."""
    spans = []
    for value in kv_caches.values():
        for tensor in [value] if isinstance(value, torch.Tensor) else value:
            last = sum((size - 1) * stride for size, stride in zip(tensor.shape,
                                                                     tensor.stride(),
                                                                     strict=True))
            spans.append((tensor.data_ptr(), (last + 1) * tensor.element_size()))
    merged: list[list[int]] = []
    for start, length in sorted(spans):
        if merged and start <= merged[-1][0] + merged[-1][1]:
            end = max(merged[-1][0] + merged[-1][1], start + length)
            merged[-1][1] = end - merged[-1][0]
        else:
            merged.append([start, length])
    return [(start, length) for start, length in merged]


def _plane_pairs_fit(local: KVLayout, remote: KVLayout, tp_ratio: int) -> bool:
    if [p.layer for p in local.planes] != [p.layer for p in remote.planes]:
        return False
    return all(mine.run_bytes == theirs.run_bytes
               or (tp_ratio > 1 and mine.head_major
                   and mine.run_bytes == tp_ratio * theirs.run_bytes)
               for mine, theirs in zip(local.planes, remote.planes, strict=True))


def check_compatible(local: KVLayout, remote: KVLayout, where: str, tp_ratio: int = 1) -> None:
    """Raise a one-line KVLayoutError unless blocks can be copied from ``remote`` (one of
    ``tp_ratio`` prefill ranks per decode rank)."""
    if local.block_size != remote.block_size:
        raise KVLayoutError(
            f"the prefill node at {where} uses block_size {remote.block_size}, this decode "
            f"node {local.block_size}: serve both with the same --block-size")
    if local.dtype != remote.dtype:
        raise KVLayoutError(
            f"the prefill node at {where} keeps its KV cache in {remote.dtype}, this decode "
            f"node in {local.dtype}: serve both with the same --dtype / --kv-cache-dtype")
    if not _plane_pairs_fit(local, remote, tp_ratio):
        mine = {(p.layer, p.run_bytes) for p in local.planes}
        theirs = {(p.layer, p.run_bytes) for p in remote.planes}
        differing = sorted(mine ^ theirs)[:2]
        raise KVLayoutError(
            f"the prefill node at {where} serves a different model: its KV cache has "
            f"{len(remote.planes)} planes, this node's {len(local.planes)} (first "
            f"differences (layer, bytes per block): {differing}, prefill/decode TP ratio "
            f"{tp_ratio}); serve the same model on both")


def check_block_ids(block_ids: Sequence[int], num_blocks: int, what: str) -> None:
    bad = [b for b in block_ids if not isinstance(b, int) or isinstance(b, bool)
           or not 0 <= b < num_blocks]
    if bad:
        raise KVLayoutError(
            f"{what} holds block id {bad[0]!r}, outside the cache's {num_blocks} blocks "
            f"(ids 0 to {num_blocks - 1})")


def _runs(local_ids: Sequence[int], remote_ids: Sequence[int]):
    """(local start, remote start, length) for runs consecutive on both sides."""
    pairs = list(zip(local_ids, remote_ids, strict=True))
    start = 0
    for i in range(1, len(pairs) + 1):
        if (i == len(pairs) or pairs[i][0] != pairs[i - 1][0] + 1
                or pairs[i][1] != pairs[i - 1][1] + 1):
            yield pairs[start][0], pairs[start][1], i - start
            start = i


def read_plan(local: KVLayout, remote: KVLayout, local_ids: Sequence[int],
              remote_ids: Sequence[int], tp_ratio: int = 1, remote_index: int = 0
              ) -> tuple[list[int], list[int], list[int]]:
    """(local addresses, remote addresses, lengths) that copy ``remote_ids``' blocks of
    every plane into ``local_ids``' (paired in order) from prefill rank ``remote_index``
    of the ``tp_ratio`` this decode rank reads; the layouts must be compatible."""
    if len(local_ids) != len(remote_ids):
        raise KVLayoutError(f"{len(local_ids)} local blocks for {len(remote_ids)} remote ones")
    local_addrs, remote_addrs, lengths = [], [], []
    for mine, theirs in zip(local.planes, remote.planes, strict=True):
        if mine.run_bytes == theirs.run_bytes:
            if remote_index:
                continue  # replicated across prefill ranks: the first one's copy suffices
            offset = 0
        else:  # one prefill rank's share of the heads
            offset = remote_index * theirs.run_bytes
        contiguous = (offset == 0 and mine.run_bytes == theirs.run_bytes
                      and mine.block_stride == mine.run_bytes
                      and theirs.block_stride == theirs.run_bytes)
        runs = (_runs(local_ids, remote_ids) if contiguous
                else ((lb, rb, 1) for lb, rb in zip(local_ids, remote_ids, strict=True)))
        for lb, rb, count in runs:
            local_addrs.append(mine.base + lb * mine.block_stride + offset)
            remote_addrs.append(theirs.base + rb * theirs.block_stride)
            lengths.append(count * theirs.run_bytes)
    return local_addrs, remote_addrs, lengths


__all__ = ["KVLayout", "KVLayoutError", "Plane", "check_block_ids", "check_compatible",
           "describe_kv_caches", "layer_planes", "memory_regions", "read_plan"]
