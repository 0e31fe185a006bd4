"""PIECEWISE and FULL_AND_PIECEWISE graphs of the npu target on MoE, quantized and MLA models,
on one reference NPU, each against the same model run eagerly on npu, greedy.

vLLM's compilation (``VLLM_COMPILE`` with the eager backend) traces each model with Dynamo
and splits the graph at the attention ops; the pieces are captured as NPU graphs per
batch size (``test_npu_graphs`` has the dense Llama). What keeps Dynamo out of code it
cannot trace, per model:

- tiny Qwen3-MoE (8 experts, top-2): vLLM puts a FusedMoE layer's forward behind its opaque
  ``torch.ops.vllm.moe_forward`` op on every platform but CPU and TPU, so routing
  (``npu_moe_gating_top_k_softmax``) and the experts (``npu_grouped_matmul``) of our
  ``AscendUnquantizedFusedMoEMethod`` run inside that node, group sizes as device tensors;
- W8A8 (compressed-tensors, dynamic per-token activations, every ``*_proj``) of the Medusa
  demo's Llama: each quantized linear layer is one ``torch.ops.ascend_quant.linear`` node
  (``ascend_quant.traced_ops``; ``npu_dynamic_quant`` + ``npu_quant_matmul`` inside);
  without it Dynamo stops in ascend-kernels' backend dispatch at start-up;
- tiny DeepSeek-V3 (MLA, a dense first layer, MoE with shared experts after it): MLA
  attention is vLLM's opaque attention op, its MoE ``moe_forward_shared``; its projections
  and norms are traced as written (norms as ``torch.ops.ascend`` ops).

The runs take at most 8 tokens a step (chunked prefill), so prefill chunks and mixed steps
replay the pieces too. Tokens are compared exactly: the traced pieces run the same kernels
in the same order as the eager forward, so no sum changes its order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_npu_target import NPU, assert_on_npu, run

MAX_TOKENS = 16
SMALL_STEPS = {"max_num_seqs": 8, "max_num_batched_tokens": 8}
CAPTURED_SIZES = 4  # 1, 2, 4, 8 tokens (plan_decode_capture_sizes for 8 requests)
DECODE_STEPS = MAX_TOKENS - 1  # after the first token, which comes from prefill


def graphs(mode: str) -> dict:
    return {"compilation_config": {"cudagraph_mode": mode}, "enforce_eager": False,
            **SMALL_STEPS}


def counts(result: dict) -> dict:
    (worker,) = result["workers"]
    return worker["graph_counts"]


def assert_piecewise_replays(result: dict, layers: int) -> dict:
    """The pieces around ``layers`` attention ops, captured at every size, all replayed by
    each of the decode steps at least; returns the PIECEWISE counts."""
    pieces = counts(result)["PIECEWISE"]
    assert pieces["wrappers"] == layers + 1
    assert pieces["graphs"] == pieces["wrappers"] * CAPTURED_SIZES
    assert pieces["replays"] % pieces["wrappers"] == 0
    assert pieces["replays"] >= DECODE_STEPS * pieces["wrappers"]
    return pieces


def assert_full_and_piecewise_replays(result: dict, layers: int) -> None:
    """Uniform decode steps replay FULL graphs where the attention backend can be captured
    whole, the rest (prefill chunks, mixed steps) the pieces; every decode step replays
    one or the other."""
    by_mode = counts(result)
    pieces = by_mode["PIECEWISE"]
    assert pieces["wrappers"] == layers + 1
    assert pieces["graphs"] == pieces["wrappers"] * CAPTURED_SIZES
    assert pieces["replays"] > 0 and pieces["replays"] % pieces["wrappers"] == 0
    full = by_mode.get("FULL", {"graphs": 0, "replays": 0})
    assert full["graphs"] in (0, CAPTURED_SIZES)
    assert full["replays"] + pieces["replays"] // pieces["wrappers"] >= DECODE_STEPS


def assert_eager(result: dict) -> None:
    assert_on_npu(result)
    assert counts(result) == {}
    # The runs differ per prompt: equality below is not the same few tokens repeated.
    assert len({tuple(ids) for ids in result["token_ids"]}) > 1


def assert_graphs_keep_greedy_tokens(model, eager: dict, mode: str, *,
                                     full_captured: bool = False) -> dict:
    """``model`` run under ``mode`` replays its graphs and gives ``eager``'s tokens; with
    ``full_captured`` FULL_AND_PIECEWISE must have captured and replayed FULL graphs."""
    result = run(model, NPU, **graphs(mode))
    assert_on_npu(result)
    if mode == "PIECEWISE":
        assert set(counts(result)) == {"PIECEWISE"}
        assert_piecewise_replays(result, layers=2)
    else:
        assert_full_and_piecewise_replays(result, layers=2)
        if full_captured:
            full = counts(result)["FULL"]
            assert full["graphs"] == CAPTURED_SIZES and full["replays"] > 0
    assert result["token_ids"] == eager["token_ids"]
    return result


# --- MoE --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe() -> Path:
    from ascend_plugin.tiny_models import ensure_model

    return ensure_model("qwen3_moe")


@pytest.fixture(scope="module")
def qwen3_moe_eager(qwen3_moe) -> dict:
    result = run(qwen3_moe, NPU, **SMALL_STEPS)
    assert_eager(result)
    return result


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_moe_model_with_graphs_keeps_greedy_tokens(qwen3_moe, qwen3_moe_eager, mode):
    result = assert_graphs_keep_greedy_tokens(qwen3_moe, qwen3_moe_eager, mode,
                                              full_captured=True)
    (worker,) = result["workers"]
    assert "AscendUnquantizedFusedMoEMethod" in worker["layer_classes"]


# --- W8A8 (compressed-tensors) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def w8a8_checkpoint(tmp_path_factory) -> Path:
    from ascend_quant.writers import Group, write_compressed_tensors

    from tiny_medusa import ensure_tiny_medusa

    out = tmp_path_factory.mktemp("npu-graphs-w8a8") / "llama-w8a8-dynamic"
    write_compressed_tensors(ensure_tiny_medusa()[0], out, [Group(r".*_proj", "W8A8_DYNAMIC")])
    return out


@pytest.fixture(scope="module")
def w8a8_eager(w8a8_checkpoint) -> dict:
    result = run(w8a8_checkpoint, NPU, **SMALL_STEPS)
    assert_eager(result)
    return result


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_w8a8_checkpoint_with_graphs_keeps_greedy_tokens(w8a8_checkpoint, w8a8_eager, mode):
    assert_graphs_keep_greedy_tokens(w8a8_checkpoint, w8a8_eager, mode, full_captured=True)


# --- MLA (DeepSeek-V3) ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deepseek() -> str:
    from ascend_plugin.tiny_drafts import ensure_deepseek_mtp_model

    # test_npu_mla's model (std 0.005, embedding carried into its MTP layer): cached, shared.
    return str(ensure_deepseek_mtp_model(std=0.005, carry_embedding=True))


@pytest.fixture(scope="module")
def deepseek_eager(deepseek) -> dict:
    result = run(deepseek, NPU, **SMALL_STEPS)
    assert_eager(result)
    return result


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_mla_model_with_graphs_keeps_greedy_tokens(deepseek, deepseek_eager, mode):
    assert_graphs_keep_greedy_tokens(deepseek, deepseek_eager, mode)
