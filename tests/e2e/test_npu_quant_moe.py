"""A W8A8 MoE checkpoint on the npu target (reference torch_npu) against the host target.

The tiny Qwen3-MoE (8 experts, top-2 renormalised) written as a compressed-tensors
W8A8_DYNAMIC checkpoint (experts and linear layers): on npu the experts' quant method
(``AscendQuantMoEMethod``) is monolithic, routes with ascend-kernels' ``topk_softmax``
(``npu_moe_gating_top_k_softmax``, no ``_moe_C``) and runs the experts in the scheme's npu
form (``npu_grouped_matmul`` int8 + ``npu_swiglu``). The greedy tokens equal the host
target's serving the same checkpoint up to near-ties (the int8 sums and bfloat16 roundings
happen in another order: see test_npu_target.py). With FULL decode graphs (NPUGraph) the
npu run keeps the eager npu run's greedy tokens.

This file is also the engine script: run_llm.py with a worker probe that reports the
runner's graph replays and, per MoE layer, the quant method, whether it routed and served
the experts on the npu path, and how many forward calls it took.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from test_npu_target import (
    GRAPHS,
    HOST,
    LLM,
    NPU,
    TOP_LOGPROBS,
    assert_equal_up_to_near_ties,
    assert_on_npu,
)

from vllm_runs import PROMPTS, run_script


def probe_moe_methods(worker) -> dict:
    """Inside the worker: the run_llm.py probe's worker classes, and per MoE quant method
    its class, route_here / npu_form and forward calls, plus the routed experts' device."""
    worker = getattr(worker, "worker", worker)
    runner = worker.model_runner
    methods = []
    for module in runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if method is None or not hasattr(method, "monolithic_calls"):
            continue
        weights = [p for n, p in module.named_parameters(recurse=False) if "w13" in n]
        methods.append({
            "class": type(method).__name__,
            "route_here": method.route_here,
            "npu_form": method.npu_form,
            "runs_npu_path": method.runs_npu_path,
            "monolithic_calls": method.monolithic_calls,
            "weights": sorted(n for n, _ in module.named_parameters(recurse=False)),
            "device": weights[0].device.type if weights else None,
        })
    return {
        "worker": type(worker).__module__ + "." + type(worker).__name__,
        "model_runner": type(runner).__module__ + "." + type(runner).__name__,
        "graph_replays": getattr(runner, "graph_replays", None),
        "moe_methods": methods,
    }


def serve(model: Path, env: dict, **llm) -> dict:
    args = {"model": str(model), "prompts": PROMPTS, "max_tokens": 16,
            "sampling": {"logprobs": TOP_LOGPROBS}, "llm": {**LLM, **llm}}
    return run_script(__file__, args, env)[0]


@pytest.fixture(scope="module")
def w8a8_moe(tmp_path_factory) -> Path:
    from ascend_plugin.tiny_models import ensure_model
    from ascend_quant.writers import Group, write_compressed_tensors

    out = tmp_path_factory.mktemp("npu-w8a8-moe") / "qwen3-moe-w8a8-dynamic"
    # initializer_range 0.005 (as the Medusa demo's base the dense W8A8 test serves): logits
    # with larger margins than the default tiny model's, whose bfloat16 near-ties the int8
    # requantization of the experts' hidden state (after the npu form's bfloat16 rounding
    # of it) moves by more than NEAR_TIE. The router (mlp.gate) stays float: only the
    # *_proj linears and the experts are int8.
    model = ensure_model("qwen3_moe", initializer_range=0.005)
    write_compressed_tensors(model, out, [Group(r".*_proj", "W8A8_DYNAMIC")])
    return out


@pytest.fixture(scope="module")
def host(w8a8_moe) -> dict:
    return serve(w8a8_moe, HOST)


@pytest.fixture(scope="module")
def npu(w8a8_moe) -> dict:
    return serve(w8a8_moe, NPU)


def test_w8a8_moe_checkpoint_on_npu_equals_the_host_target(npu, host):
    assert_on_npu(npu)
    (worker,) = npu["workers"]
    methods = worker["moe_methods"]
    assert methods, "no MoE layer was served by AscendQuantMoEMethod"
    steps = None
    for method in methods:
        assert method["class"] == "AscendQuantMoEMethod"
        # routed here (ascend-kernels), experts in the scheme's npu form, on the device
        assert method["runs_npu_path"], method
        assert method["device"] == "npu", method
        assert "ascend_npu_w13" in method["weights"], method["weights"]
        # eager: one call per forward step (16 steps at least: prefill + 15 decodes)
        assert method["monolithic_calls"] >= 16, method
        steps = steps or method["monolithic_calls"]
        assert method["monolithic_calls"] == steps, "every MoE layer runs every step"

    assert len({tuple(ids) for ids in host["token_ids"]}) == len(PROMPTS)
    assert_equal_up_to_near_ties(npu, host, "W8A8 qwen3-MoE npu vs host")


def test_w8a8_moe_with_full_decode_graphs_keeps_greedy_tokens(w8a8_moe, npu):
    """Routing and the int8 grouped matmuls of every MoE layer replayed from captured
    NPU graphs: the same greedy tokens as the eager npu run."""
    graphs = serve(w8a8_moe, NPU, **GRAPHS)
    assert_on_npu(graphs)
    (worker,) = graphs["workers"]
    assert worker["graph_replays"] >= 15
    assert npu["workers"][0]["graph_replays"] == 0
    assert all(method["runs_npu_path"] for method in worker["moe_methods"])
    assert graphs["token_ids"] == npu["token_ids"]


def test_host_target_keeps_vllms_router_for_the_w8a8_experts(host):
    (worker,) = host["workers"]
    assert worker["moe_methods"]
    for method in worker["moe_methods"]:
        assert method["class"] == "AscendQuantMoEMethod"
        assert not method["route_here"] and not method["npu_form"]
        assert method["monolithic_calls"] == 0
        assert "ascend_w13" in method["weights"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    import run_llm

    run_llm.probe_worker = probe_moe_methods
    run_llm.main()
