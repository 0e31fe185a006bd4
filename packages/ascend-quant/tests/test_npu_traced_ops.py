"""``ascend_quant.traced_ops.linear`` on the reference torch_npu: for every scheme's npu form
the op equals the scheme's direct ``apply``, its fake implementation gives the real
output's shape and dtype without running a kernel, Dynamo traces a layer into one graph
whose quantized matmul is one ``ascend_quant.linear`` node (fullgraph, as vLLM's
compilation needs), and an NPU graph records the op as one step that replays new inputs."""

from __future__ import annotations

import pytest
import torch
from test_npu_schemes import processed, reference_torch_npu  # noqa: F401 - fixture
from test_schemes import CASES, N, case_id, gen
from torch._subclasses.fake_tensor import FakeTensorMode

from ascend_quant import traced_ops
from ascend_quant.schemes import COMPRESSED_TENSORS as CT

OP = "ascend_quant.linear.default"


def _layer(case, dtype=torch.bfloat16, name="model.layers.0.mlp.down_proj"):
    """(key, ordered runtime tensors, x, bias, scheme, runtime dict) of one npu-form layer."""
    layer_name, layout, opts = case
    weight = torch.randn(N, 128, generator=gen(30)) * 0.05
    bias = torch.randn(N, generator=gen(31)) * 0.1
    *_, on_npu, npu_w, _, _, _ = processed(layer_name, layout, opts, weight, bias)
    assert any(key.startswith("npu_") for key in npu_w)
    key = traced_ops.register_layer(name, on_npu, tuple(npu_w), N)
    x = torch.randn(3, 5, 128, generator=gen(32)).to(dtype)
    return key, list(npu_w.values()), x, bias.to(dtype), on_npu, npu_w


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_op_equals_the_scheme_and_its_fake_matches(case, reference_torch_npu):  # noqa: F811
    key, weights, x, bias, scheme, runtime = _layer(case)
    got = traced_ops.linear(x, weights, bias, key)
    want = scheme.apply(runtime, x, bias)
    assert torch.equal(got, want)

    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = torch.ops.ascend_quant.linear(
            mode.from_tensor(x), [mode.from_tensor(w) for w in weights],
            mode.from_tensor(bias), key)
    assert fake.shape == got.shape == (3, 5, N)
    assert fake.dtype == got.dtype == x.dtype


def test_layers_of_one_name_get_distinct_keys_and_unknown_keys_fail(reference_torch_npu):  # noqa: F811,E501
    first = _layer(CASES[4], name="model.layers.7.qkv_proj")[0]
    second = _layer(CASES[4], name="model.layers.7.qkv_proj")[0]
    assert first == "model.layers.7.qkv_proj" or first.startswith("model.layers.7.qkv_proj#")
    assert second != first and second.startswith("model.layers.7.qkv_proj#")
    with pytest.raises(KeyError, match="no layer registered as 'nowhere'"):
        traced_ops.linear(torch.zeros(1, 128, dtype=torch.bfloat16), [], None, "nowhere")
    with pytest.raises(ValueError, match="out_features must be a positive integer"):
        traced_ops.register_layer("bad", traced_ops.registered_layer(first).scheme, (), 0)


def test_op_refuses_weights_other_than_the_registered_ones(reference_torch_npu):  # noqa: F811
    key, weights, x, bias, *_ = _layer(CASES[4])
    with pytest.raises(ValueError, match="1 weight tensors"):
        traced_ops.linear(x, weights[:1], bias, key)


def _on_npu(tensors):
    return [t.to("npu") for t in tensors]


def test_dynamo_traces_a_layer_with_the_op_as_one_node(reference_torch_npu):  # noqa: F811
    """W8A8 dynamic on npu tensors (the e2e checkpoint's scheme): norm-free block of two
    quantized layers and a float op between them, traced fullgraph."""
    case = ("W8A8_DYNAMIC", CT, {})
    key, weights, x, bias, scheme, _ = _layer(case)
    weights, (x, bias) = _on_npu(weights), _on_npu([x, bias])
    traced = []

    def backend(gm, example_inputs):
        traced.append(gm)
        return gm  # run as traced, as vLLM's eager backend does

    def block(x, bias, *weights):
        y = traced_ops.linear(x, list(weights), bias, key)
        return torch.relu(y) * 2

    got = torch.compile(block, backend=backend, fullgraph=True)(x, bias, *weights)
    (graph,) = traced
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(OP) == 1
    assert got.device.type == "npu"
    want = torch.relu(scheme.apply(dict(zip(traced_ops.registered_layer(key).weight_names,
                                            weights, strict=True)), x, bias)) * 2
    assert torch.equal(got.cpu(), want.cpu())


def test_an_npu_graph_records_the_op_as_one_step_and_replays_it(reference_torch_npu):  # noqa: F811,E501
    key, weights, x, bias, scheme, runtime = _layer(("W8A8_DYNAMIC", CT, {}))
    weights, (x, bias) = _on_npu(weights), _on_npu([x, bias])
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        out = traced_ops.linear(x, weights, bias, key)
    assert graph.step_names() == [OP]
    fresh = torch.randn(x.shape, generator=gen(33)).to(x.dtype)
    x.copy_(fresh)
    graph.replay()
    assert torch.equal(out.cpu(), scheme.apply(runtime, fresh, bias.cpu()))
