"""``ascend_core.ops.traced_ops`` on the reference torch_npu: Dynamo traces a block of our
kernels on npu tensors into one graph (fullgraph, as vLLM's compilation needs) whose nodes
are the ``torch.ops.ascend`` ops, and the traced graph computes what the kernels compute
eagerly; an NPU graph records each op as one step."""

from __future__ import annotations

import importlib

import pytest
import torch

from npu_reference import reference_on_path

FORGET = ("torch_npu", "ascend_core.ops.traced_ops")


@pytest.fixture(scope="module")
def ops():
    with reference_on_path(forget=FORGET):
        importlib.import_module("torch_npu")
        yield importlib.import_module("ascend_core.ops.traced_ops")


def _block(ops, x, residual, weight, positions, cos_sin_cache, gate_up):
    normed = ops.rms_norm(x, weight, 1e-6)
    added_normed, added = ops.add_rms_norm(x, residual, weight, 1e-6)
    query, key = normed.clone(), added_normed.clone()
    ops.rotary_embedding_(positions, query, key, cos_sin_cache, 32, True, 0)
    return query, key, added, ops.silu_and_mul(gate_up)


def _inputs():
    torch.manual_seed(0)
    tokens, hidden = 4, 64
    cos_sin = torch.randn(16, 32)
    host = (torch.randn(tokens, hidden), torch.randn(tokens, hidden),
            torch.rand(hidden) + 0.5, torch.tensor([0, 3, 5, 7]), cos_sin,
            torch.randn(tokens, 2 * hidden))
    return tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in host)


def test_dynamo_traces_the_kernels_as_one_graph_of_ascend_ops(ops):
    import ascend_kernels

    traced = []

    def backend(gm, example_inputs):
        traced.append(gm)
        return gm  # run as traced, as vLLM's eager backend does

    args = tuple(t.npu() for t in _inputs())
    compiled = torch.compile(lambda *a: _block(ops, *a), backend=backend, fullgraph=True)
    got = compiled(*args)
    (graph,) = traced
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert {"ascend.rms_norm.default", "ascend.add_rms_norm.default",
            "ascend.rotary_embedding_.default", "ascend.silu_and_mul.default"} <= set(targets)

    x, residual, weight, positions, cos_sin_cache, gate_up = args
    query = ascend_kernels.rms_norm(x, weight, 1e-6)
    key, added = ascend_kernels.add_rms_norm(x, residual, weight, 1e-6)
    query, key = ascend_kernels.rotary_embedding(positions, query.clone(), key.clone(),
                                                 cos_sin_cache, 32, True)
    expected = (query, key, added, ascend_kernels.silu_and_mul(gate_up))
    for ours, theirs in zip(got, expected, strict=True):
        assert ours.device.type == "npu"
        torch.testing.assert_close(ours.cpu(), theirs.cpu())


def test_an_npu_graph_records_each_op_as_one_step_and_replays_it(ops):
    x, residual, weight, positions, cos_sin_cache, gate_up = (t.npu() for t in _inputs())
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = ops.silu_and_mul(gate_up)
        ops.rotary_embedding_(positions, x, residual, cos_sin_cache, 32, True, 0)
    assert graph.step_names() == ["ascend.silu_and_mul.default",
                                  "ascend.rotary_embedding_.default"]
    fresh = torch.randn(gate_up.shape).to(torch.bfloat16)
    gate_up.copy_(fresh)
    before = x.clone()
    graph.replay()
    torch.testing.assert_close(out.cpu(), ops.silu_and_mul(fresh.npu()).cpu())
    # Replayed once: the in-place rotation applied to x once more (not twice).
    query = before.clone()
    ops.rotary_embedding_(positions, query, None, cos_sin_cache, 32, True, 0)
    torch.testing.assert_close(x.cpu(), query.cpu())
