"""Graph modes of the npu target end to end on the reference torch_npu (NPUGraph through
vLLM's CUDAGraphWrapper), each against the same configuration run eagerly, greedy.

- PIECEWISE and FULL_AND_PIECEWISE: vLLM's compilation with the eager backend (Dynamo's FX
  graph split at the attention ops, no Inductor), each piece captured per batch size. The
  runs take at most 8 tokens a step (``max_num_batched_tokens=8``, chunked prefill) so that
  prefill chunks and mixed steps fit the captured sizes too, not only decode steps. Proof
  of replay: ``NPUModelRunner.graph_counts`` -- per runtime mode, vLLM's wrappers in the
  worker, the NPU graphs they captured and how often those were replayed.
- FULL decode graphs with speculative decoding: a decode step of k drafts per request is a
  uniform batch of 1 + k tokens per request, captured at multiples of 1 + k. n-gram (k 3)
  drafts only where the last token occurred before, which the tiny random Llama's output
  rarely does on text prompts; its prompts here are therefore 2000 distinct token ids of
  its 2048 (shuffled), so nearly every step drafts k tokens for every request (the drafts
  are random and rejected: this proves the shapes and the bonus token). Medusa (3 heads,
  on the Medusa demo) drafts k tokens every step and gets drafts accepted. Both keep the
  greedy tokens of the run without speculation.
- FULL decode graphs with tensor parallel 2 (two reference NPUs, HCCL = gloo underneath):
  the all-reduces are steps of the captured graphs (``npu_graph_capture`` in place of
  vLLM's ``graph_capture``, which takes CUDA/XPU communicators only); compared with TP 2
  eager up to near-ties (``assert_equal_up_to_near_ties``), on the Medusa demo's base Llama.
"""

from __future__ import annotations

import random

import pytest
from test_npu_target import NPU, assert_equal_up_to_near_ties, assert_on_npu, run

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


# --- speculative decoding ---------------------------------------------------------------------

FULL_DECODE = graphs("FULL_DECODE_ONLY", max_num_seqs=8)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1}
# 2000 of the 2048 token ids, shuffled, per prompt: the model's position limit (2048) leaves
# room for the 16 generated tokens and the drafts.
VOCAB_PROMPTS = [{"prompt_token_ids": random.Random(seed).sample(range(2048), 2000)}
                 for seed in range(4)]
LONG = {"max_model_len": 2048}


def test_full_decode_graphs_replay_ngram_verification_steps(llama):
    plain = run(llama, NPU, prompts=VOCAB_PROMPTS, **LONG)
    result = run(llama, NPU, prompts=VOCAB_PROMPTS, speculative_config=NGRAM,
                 disable_log_stats=False, **LONG, **FULL_DECODE)
    assert_on_npu(result)
    metrics = result["metrics"]
    full = counts(result)["FULL"]
    print(f"\nn-gram under FULL graphs: {full}, drafts {metrics['vllm:spec_decode_num_drafts']}")
    assert full["graphs"] == CAPTURED_SIZES  # 4, 8, 16, 32 tokens: 1, 2, 4, 8 requests
    # Most of the 15 decode steps drafted 3 tokens for every request and ran as a graph.
    assert full["replays"] >= (MAX_TOKENS - 1) // 2
    assert metrics["vllm:spec_decode_num_drafts"] >= full["replays"]
    assert result["token_ids"] == plain["token_ids"]


def test_full_decode_graphs_replay_medusa_steps_with_accepted_drafts():
    from tiny_medusa import MEDUSA_HEADS, ensure_tiny_medusa

    base, heads = ensure_tiny_medusa()
    plain = run(base, NPU)
    spec = {"method": "medusa", "model": heads, "num_speculative_tokens": MEDUSA_HEADS}
    result = run(base, NPU, speculative_config=spec, disable_log_stats=False, **FULL_DECODE)
    assert_on_npu(result)
    metrics = result["metrics"]
    full = counts(result)["FULL"]
    print(f"\nMedusa under FULL graphs: {full}, drafts {metrics['vllm:spec_decode_num_drafts']}"
          f", accepted {metrics['vllm:spec_decode_num_accepted_tokens']}")
    assert full["graphs"] == CAPTURED_SIZES
    # Every decode step drafts for every request: each one is a uniform batch, replayed.
    assert full["replays"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0
    assert result["token_ids"] == plain["token_ids"]


# --- tensor parallel 2 ------------------------------------------------------------------------


TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
TWO_NPUS = {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2"}


@pytest.fixture(scope="module")
def medusa_base() -> str:
    from tiny_medusa import ensure_tiny_medusa

    return ensure_tiny_medusa()[0]


@pytest.fixture(scope="module")
def tp2_eager(medusa_base) -> dict:
    result = run(medusa_base, TWO_NPUS, **TP2)
    for worker in result["workers"]:
        assert worker["graph_counts"] == {}
    return result


def test_full_decode_graphs_with_tensor_parallel_2_equal_tp_2_eager(medusa_base, tp2_eager):
    result = run(medusa_base, TWO_NPUS, **TP2, **FULL_DECODE)
    assert_on_npu(result, workers=2)
    for worker in result["workers"]:
        full = worker["graph_counts"]["FULL"]
        assert full["graphs"] == CAPTURED_SIZES
        assert full["replays"] >= MAX_TOKENS - 1  # every decode step, on both ranks
    assert_equal_up_to_near_ties(result, tp2_eager, "TP 2 FULL graphs vs TP 2 eager on npu")


def test_piecewise_graphs_with_tensor_parallel_2_equal_tp_2_eager(medusa_base, tp2_eager):
    """vLLM's collectives are its torch.ops.vllm.* custom ops on the npu platform, so Dynamo
    keeps them opaque and the pieces between the attention ops hold the all-reduces."""
    result = run(medusa_base, TWO_NPUS, **TP2, **graphs("PIECEWISE", **SMALL_STEPS))
    assert_on_npu(result, workers=2)
    for worker in result["workers"]:
        pieces = worker["graph_counts"]["PIECEWISE"]
        assert pieces["graphs"] == pieces["wrappers"] * CAPTURED_SIZES
        assert pieces["replays"] >= (MAX_TOKENS - 1) * pieces["wrappers"]
    assert_equal_up_to_near_ties(result, tp2_eager, "TP 2 PIECEWISE vs TP 2 eager on npu")
