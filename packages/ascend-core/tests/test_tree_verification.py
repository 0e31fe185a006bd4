"""Medusa tree steps on vLLM's CPU attention (host target) and the npu backend's tree mask.

vLLM's own cache-write op (``cpu_attn_reshape_and_cache``, through its CPU attention
implementation) fills the caches; the tree path reads them back, recomputes node rows
against plain masked attention over the unpaged keys, and moves accepted paths.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends import cpu_attn
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

from ascend_core.attention import tree_verification as tv
from ascend_core.attention.npu_attention import tree_attention_mask

# A tree as the drafter's: root children [0] [1]; [0,0] [0,1] under [0]; [0,0,0].
PATHS = ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
PARENTS = (-1, -1, 0, 0, 2)


class Tree:
    depths = tuple(len(p) for p in PATHS)

    @staticmethod
    def ancestor_mask(m):
        mask = torch.zeros(m + 1, m + 1, dtype=torch.bool)
        mask[:, 0] = True
        for node in range(m):
            mask[node + 1, node + 1] = True
            if PARENTS[node] >= 0:
                mask[node + 1] |= mask[PARENTS[node] + 1]
        return mask


@pytest.fixture(autouse=True)
def model_dtype(monkeypatch):
    # vLLM's CPU attention impl reads the model's dtype from the current config.
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    monkeypatch.setattr(cpu_attn, "get_current_vllm_config", lambda: config)


ISAS = [("vec", torch.float32, 32), ("vec16", torch.float32, 16), ("vec", torch.bfloat16, 32),
        ("amx", torch.bfloat16, 32)]


class Cache:
    """A CPU cache of ``blocks`` blocks, written through vLLM's CPU attention impl."""

    def __init__(self, isa, dtype, block_size, kv_heads=2, head_size=64, heads=4, blocks=8,
                 seed=0):
        self.gen = torch.Generator().manual_seed(seed)
        self.dtype, self.block_size = dtype, block_size
        self.kv_heads, self.head_size, self.heads = kv_heads, head_size, heads
        self.kv_cache = torch.zeros(blocks, kv_heads, block_size, 2 * head_size, dtype=dtype)
        self.impl = CPUAttentionBackendImpl(heads, head_size, head_size ** -0.5, kv_heads,
                                            None, None, "auto")
        self.layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
        # Blocks in shuffled order, as vLLM's block table gives them.
        self.table = torch.randperm(blocks, generator=self.gen).to(torch.int32)

    def randn(self, *shape):
        return torch.randn(*shape, generator=self.gen).to(self.dtype)

    def slots(self, positions):
        size = self.block_size
        return torch.tensor([int(self.table[p // size]) * size + p % size for p in positions],
                            dtype=torch.long)

    def write(self, keys, values, positions):
        self.impl.do_kv_cache_update(self.layer, keys, values, self.kv_cache,
                                     self.slots(positions))


@pytest.mark.parametrize(("isa", "dtype", "block_size"), ISAS)
def test_the_probed_layout_reads_back_what_vllms_op_wrote(isa, dtype, block_size):
    cache = Cache(isa, dtype, block_size)
    tokens = 3 * block_size - 5
    keys = cache.randn(tokens, cache.kv_heads, cache.head_size)
    values = cache.randn(tokens, cache.kv_heads, cache.head_size)
    cache.write(keys, values, range(tokens))
    got_k, got_v = tv.read_context(cache.layer, cache.kv_cache, cache.table, tokens)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    # vLLM's vector kernels store keys transposed, values token-major (read through views);
    # AMX interleaves both in pairs (read through the probed indices).
    forms = tv._block_forms(isa, dtype, block_size, cache.head_size)
    if isa == "amx":
        assert all(isinstance(form, torch.Tensor) for form in forms)
    else:
        assert forms == ("dims", "tokens")
    # The keys are not stored token-major: a plain read would not do.
    plain_keys = cache.kv_cache[cache.table[0].long(), :, :, :cache.head_size].transpose(0, 1)
    assert not torch.equal(plain_keys[:4], keys[:4])


def masked_attention(query, keys, values, allowed, scale):
    group = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, 1)
    values = values.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize(("isa", "dtype", "block_size"), ISAS)
def test_node_rows_attend_to_the_context_and_their_ancestors(isa, dtype, block_size):
    cache = Cache(isa, dtype, block_size, seed=1)
    root, m = block_size + 3, 5  # the root's position; its nodes go in the next block
    keys = cache.randn(root + 1 + m, cache.kv_heads, cache.head_size)
    values = cache.randn(root + 1 + m, cache.kv_heads, cache.head_size)
    cache.write(keys, values, range(root + 1 + m))  # what vLLM does before attention
    # The step: one plain decode request (2 tokens), then the tree request.
    start = 2
    query = cache.randn(start + 1 + m, cache.heads, cache.head_size)
    step = tv.plan_step(Tree, [0, m], [0, start, start + 1 + m], [7, root])
    assert [(r.index, r.query_start, r.root_position) for r in step.requests] == [
        (1, start, root)]
    metadata = SimpleNamespace(block_table=torch.stack([cache.table, cache.table]),
                               slot_mapping=torch.cat([torch.zeros(start, dtype=torch.long),
                                                       cache.slots(range(root, root + 1 + m))]))
    output = torch.zeros(start + 1 + m, cache.heads * cache.head_size, dtype=dtype)
    tv.attend_nodes(step, cache.impl, cache.layer, query, cache.kv_cache, metadata, output)
    allowed = torch.cat([torch.ones(m, root, dtype=torch.bool), Tree.ancestor_mask(m)[1:]], 1)
    expected = masked_attention(query[start + 1:], keys, values, allowed, cache.impl.scale)
    got = output[start + 1:].view(m, cache.heads, cache.head_size).float()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert output[:start + 1].abs().sum() == 0  # the root and other requests: the kernel's
    # Node [0, 0, 0] does not see node [1] (a sibling branch): plain causal rows differ.
    causal = masked_attention(query[start + 1:], keys, values,
                              torch.ones(m, root + 1 + m).tril(root).bool(), cache.impl.scale)
    assert not torch.allclose(got, causal, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(("isa", "dtype", "block_size"), ISAS)
def test_requests_of_different_sizes_are_recomputed_together(isa, dtype, block_size):
    """Two tree requests (5 and 3 nodes, contexts of different lengths, their own blocks)
    around a plain decode request: one padded masked attention gives each node row what
    attention over its own request's keys gives."""
    cache = Cache(isa, dtype, block_size, seed=3, blocks=12)
    tables = torch.stack([cache.table, torch.roll(cache.table, -6), torch.roll(cache.table, 3)])
    roots, nodes = [block_size + 3, 0, 2 * block_size - 1], [5, 0, 3]
    starts = [0, 6, 8]  # query rows: request 0's root and 5 nodes, request 1's 2, request 2's
    query = cache.randn(12, cache.heads, cache.head_size)
    step_keys = cache.randn(12, cache.kv_heads, cache.head_size)
    step_values = cache.randn(12, cache.kv_heads, cache.head_size)
    contexts = {}
    slots = torch.zeros(12, dtype=torch.long)
    for r in (0, 2):
        cache.table = tables[r]
        root, m, start = roots[r], nodes[r], starts[r]
        keys = torch.cat([cache.randn(root, cache.kv_heads, cache.head_size),
                          step_keys[start:start + 1 + m]])
        values = torch.cat([cache.randn(root, cache.kv_heads, cache.head_size),
                            step_values[start:start + 1 + m]])
        cache.write(keys, values, range(root + 1 + m))  # what vLLM does before attention
        slots[start:start + 1 + m] = cache.slots(range(root, root + 1 + m))
        contexts[r] = keys, values
    step = tv.plan_step(Tree, nodes, starts + [12], roots)
    assert [r.index for r in step.requests] == [0, 2]
    metadata = SimpleNamespace(block_table=tables, slot_mapping=slots)
    output = torch.zeros(12, cache.heads * cache.head_size, dtype=dtype)
    tv.attend_nodes(step, cache.impl, cache.layer, query, cache.kv_cache, metadata, output)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for r in (0, 2):
        root, m, start = roots[r], nodes[r], starts[r]
        allowed = torch.cat([torch.ones(m, root, dtype=torch.bool),
                             Tree.ancestor_mask(m)[1:]], 1)
        expected = masked_attention(query[start + 1:start + 1 + m], *contexts[r], allowed,
                                    cache.impl.scale)
        got = output[start + 1:start + 1 + m].view(m, cache.heads, cache.head_size).float()
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    untouched = [0, 6, 7, 8]  # the roots and the plain request: the kernel's rows
    assert output[untouched].abs().sum() == 0


@pytest.mark.parametrize(("isa", "dtype", "block_size"), ISAS)
def test_compaction_moves_the_accepted_path_after_the_root(isa, dtype, block_size):
    cache = Cache(isa, dtype, block_size, seed=2)
    roots, m = [block_size - 3, 4], 5  # request 0's nodes cross a block boundary
    cache.table = torch.arange(8, dtype=torch.int32)  # request 1 gets blocks from 4
    tables = torch.stack([cache.table, torch.roll(cache.table, -4)])
    step = tv.plan_step(Tree, [m, m], [0, m + 1, 2 * (m + 1)], roots)
    keys, values, slots = [], [], []
    for r, root in enumerate(roots):
        k = cache.randn(m + 1, cache.kv_heads, cache.head_size)
        v = cache.randn(m + 1, cache.kv_heads, cache.head_size)
        keys.append(k)
        values.append(v)
        size = block_size
        slots.append(torch.tensor([int(tables[r, p // size]) * size + p % size
                                   for p in range(root, root + m + 1)]))
    step_keys, step_values, slot_mapping = torch.cat(keys), torch.cat(values), torch.cat(slots)
    cache.impl.do_kv_cache_update(cache.layer, step_keys, step_values, cache.kv_cache,
                                  slot_mapping)
    step.keep(cache.impl, cache.layer, cache.kv_cache, step_keys, step_values, slot_mapping)
    # Request 0 accepted [0] [0,0] [0,0,0] (nodes 0, 2, 4); request 1 only [1] (node 1).
    accepted = [[0, 2, 4], [1]]
    assert tv.compact(step, accepted) == 3  # nodes 2, 4 of request 0 and node 1 of request 1
    for r, (root, path) in enumerate(zip(roots, accepted, strict=True)):
        got_k, got_v = tv.read_context(cache.layer, cache.kv_cache, tables[r],
                                       root + 1 + len(path))
        rows = [0] + [node + 1 for node in path]  # the root, then the path's nodes
        assert torch.equal(got_k[root:], keys[r][rows])
        assert torch.equal(got_v[root:], values[r][rows])


def test_nodes_get_the_positions_of_their_depths():
    step = tv.plan_step(Tree, [5, 0, 2], [0, 6, 7, 10], [10, 3, 20])
    positions = torch.arange(10, dtype=torch.int64) + 100
    tv.tree_positions(step, Tree, positions)
    assert positions.tolist() == [100, 11, 11, 12, 12, 13, 106, 107, 21, 21]
    assert tv.plan_step(Tree, [0, 0], [0, 1, 2], [3, 4]) is None


def test_layers_the_host_path_does_not_reproduce_are_refused():
    plain = CPUAttentionBackendImpl(4, 64, 0.125, 2, None, None, "auto")
    tv.check_layer("model.layers.0.attn", plain)
    windowed = CPUAttentionBackendImpl(4, 64, 0.125, 2, None, 128, "auto")
    with pytest.raises(ValueError, match="layer model.layers.1.attn with a sliding window"):
        tv.check_layer("model.layers.1.attn", windowed)
    capped = CPUAttentionBackendImpl(4, 64, 0.125, 2, None, None, "auto", logits_soft_cap=30.0)
    with pytest.raises(ValueError,
                       match="a logit soft cap; remove medusa_tree_config to verify one"):
        tv.check_layer("x", capped)


def test_npu_tree_mask_is_causal_except_the_tree_block():
    step = tv.plan_step(Tree, [0, 3], [0, 2, 6], [5, 9])
    mask = tree_attention_mask(step, [2, 4], [7, 13], 16, "cpu")
    assert mask.shape == (2, 1, 4, 16) and mask.dtype == torch.bool
    visible = ~mask[:, 0]
    # Request 0: two query rows, right-down causal over 7 keys.
    assert visible[0, 0].nonzero().flatten().tolist() == list(range(6))
    assert visible[0, 1].nonzero().flatten().tolist() == list(range(7))
    # Request 1: root at 9, nodes [0] [1] [0,0] at 10 11 12.
    assert visible[1, 0].nonzero().flatten().tolist() == list(range(10))
    assert visible[1, 1].nonzero().flatten().tolist() == [*range(10), 10]
    assert visible[1, 2].nonzero().flatten().tolist() == [*range(10), 11]
    assert visible[1, 3].nonzero().flatten().tolist() == [*range(10), 10, 12]
