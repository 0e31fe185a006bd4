"""Graph modes of the npu target end to end on the reference torch_npu (NPUGraph through
vLLM's CUDAGraphWrapper), each against the same configuration run eagerly, greedy.

- PIECEWISE and FULL_AND_PIECEWISE: vLLM's compilation with the eager backend (Dynamo's FX
  graph split at the attention ops, no Inductor), each piece captured per batch size. The
  runs take at most 8 tokens a step (``max_num_batched_tokens=8``, chunked prefill) so that
  prefill chunks and mixed steps fit the captured sizes too, not only decode steps. Proof
  of replay: ``NPUModelRunner.graph_counts`` -- per runtime mode, vLLM's wrappers in the
  worker, the NPU graphs they captured and how often those were replayed.
"""

from __future__ import annotations

import pytest
from test_npu_target import NPU, assert_on_npu, run

MAX_TOKENS = 16
SMALL_STEPS = {"max_num_seqs": 8, "max_num_batched_tokens": 8}
CAPTURED_SIZES = 4  # 1, 2, 4, 8 tokens (plan_decode_capture_sizes for 8 requests)


def graphs(mode: str, **llm) -> dict:
    return {"compilation_config": {"cudagraph_mode": mode}, "enforce_eager": False, **llm}


@pytest.fixture(scope="module")
def llama():
    from ascend_plugin.tiny_models import ensure_model

    return ensure_model("llama")


@pytest.fixture(scope="module")
def llama_eager_small_steps(llama) -> dict:
    return run(llama, NPU, **SMALL_STEPS)


def counts(result: dict) -> dict:
    (worker,) = result["workers"]
    return worker["graph_counts"]


def test_piecewise_graphs_keep_greedy_tokens(llama, llama_eager_small_steps):
    result = run(llama, NPU, **graphs("PIECEWISE", **SMALL_STEPS))
    assert_on_npu(result)
    assert counts(llama_eager_small_steps) == {}
    by_mode = counts(result)
    assert set(by_mode) == {"PIECEWISE"}
    pieces = by_mode["PIECEWISE"]
    # The tiny Llama's 2 decoder layers: 3 pieces around the 2 attention ops.
    assert pieces["wrappers"] == 3
    assert pieces["graphs"] == pieces["wrappers"] * CAPTURED_SIZES
    # Every step (prefill chunks included) runs every piece from a graph: at least the 15
    # decode steps after the first token, each replaying all pieces.
    assert pieces["replays"] % pieces["wrappers"] == 0
    assert pieces["replays"] >= (MAX_TOKENS - 1) * pieces["wrappers"]
    assert result["token_ids"] == llama_eager_small_steps["token_ids"]


def test_full_and_piecewise_graphs_keep_greedy_tokens(llama, llama_eager_small_steps):
    result = run(llama, NPU, **graphs("FULL_AND_PIECEWISE", **SMALL_STEPS))
    assert_on_npu(result)
    by_mode = counts(result)
    # Uniform decode steps replay the FULL graph of the whole model ...
    assert by_mode["FULL"]["wrappers"] == 1
    assert by_mode["FULL"]["graphs"] == CAPTURED_SIZES
    assert by_mode["FULL"]["replays"] >= MAX_TOKENS - 1
    # ... prefill chunks and mixed steps the PIECEWISE graphs of the pieces.
    pieces = by_mode["PIECEWISE"]
    assert pieces["graphs"] == pieces["wrappers"] * CAPTURED_SIZES
    assert pieces["replays"] > 0 and pieces["replays"] % pieces["wrappers"] == 0
    assert result["token_ids"] == llama_eager_small_steps["token_ids"]
