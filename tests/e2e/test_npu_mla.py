"""MLA attention (DeepSeek-V3) on the npu target, on the reference torch_npu: real vLLM, the
npu platform and the Ascend MLA backend (``ascend_core.attention.npu_mla``: latent-cache
writes through ``npu_scatter_pa_kv_cache``, attention through the MLA form of
``npu_fused_infer_attention_score``).

The model is test_eagle_mtp's tiny DeepSeek-V3 (MLA with kv_lora_rank 512 and rope 64, a
dense first layer, MoE after it, one MTP layer), served in bfloat16. Compared, greedy, on the
same prompts:

- the npu target against the host target (vLLM's CPU MLA backend): equal up to near-ties
  (``assert_equal_up_to_near_ties``; the two backends sum in other orders and bfloat16
  rounds them apart);
- chunked prefill on the npu target (8 tokens a step, so prompts are split over steps and
  attend to their cached first part) against the npu target's whole-prompt run, and MTP
  speculative decoding (3 drafted tokens, verified as 4-token queries) against the npu
  target without speculation: the same backend on the same device, up to near-ties;
- FULL decode graphs (``FULL_DECODE_ONLY``): decode steps replay captured graphs in which each MLA layer's fused attention is a graph task
  group, its lengths updated before every replay (``graph_counts``: one task group per
  attention layer and graph, one update per layer and replay); greedy tokens as eager. With
  MTP the captured batches are verification batches (4-token queries) and the draft model
  runs eagerly; greedy tokens as the eager run without speculation, up to near-ties.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_npu_target import (
    HOST,
    LLM,
    NPU,
    TOP_LOGPROBS,
    assert_equal_up_to_near_ties,
    assert_on_npu,
)

from vllm_runs import FIXED_DRAFT_LENGTH, PROMPTS, run_vllm

SMALL = 0.005  # test_eagle_mtp's weight std: the cached model is shared
MAX_TOKENS = 16


def run(model, env, **llm) -> dict:
    return run_vllm({"model": str(model), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                     "sampling": {"logprobs": TOP_LOGPROBS}, "llm": {**LLM, **llm}}, env)


@pytest.fixture(scope="module")
def deepseek() -> str:
    from ascend_plugin.tiny_drafts import ensure_deepseek_mtp_model

    return str(ensure_deepseek_mtp_model(std=SMALL, carry_embedding=True))


@pytest.fixture(scope="module")
def deepseek_npu(deepseek) -> dict:
    return run(deepseek, NPU)


def test_deepseek_runs_on_the_npu_target(deepseek_npu):
    assert_on_npu(deepseek_npu)
    assert all(len(tokens) == MAX_TOKENS for tokens in deepseek_npu["token_ids"])


def test_deepseek_on_npu_equals_the_host_target(deepseek, deepseek_npu):
    host = run(deepseek, HOST)
    assert host["platform"] != deepseek_npu["platform"]
    assert_equal_up_to_near_ties(deepseek_npu, host, "DeepSeek-V3 npu vs host")


def test_chunked_prefill_on_npu_keeps_greedy_tokens(deepseek, deepseek_npu):
    assert max(len(ids) for ids in deepseek_npu["prompt_token_ids"]) > 8
    chunked = run(deepseek, NPU, enable_chunked_prefill=True, max_num_batched_tokens=8,
                  max_num_seqs=8)
    assert_on_npu(chunked)
    assert_equal_up_to_near_ties(chunked, deepseek_npu, "chunked prefill on npu")


def test_mtp_speculation_on_npu_keeps_greedy_tokens(deepseek, deepseek_npu):
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    # At k=3 every step, for the acceptance length it prints (docs/FEATURES.md).
    result = run(deepseek, NPU, speculative_config=spec, disable_log_stats=False,
                 additional_config=FIXED_DRAFT_LENGTH)
    assert_on_npu(result)
    assert_equal_up_to_near_ties(result, deepseek_npu, "MTP on npu")
    metrics = result["metrics"]
    drafts = metrics["vllm:spec_decode_num_drafts"]
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    # Drafts were verified (4-token queries through the backend) and some were accepted.
    assert drafts > 0 and accepted > 0, metrics
    print(f"\nMTP on npu, k=3: mean acceptance length {1 + accepted / drafts:.3f}")


# --- FULL decode graphs -----------------------------------------------------------------------

FULL_DECODE = {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"},
               "enforce_eager": False, "max_num_seqs": 8}


def _assert_fused_attention_replayed_in_graphs(result: dict, deepseek: str) -> dict:
    (worker,) = result["workers"]
    full = worker["graph_counts"]["FULL"]
    layers = json.loads((Path(deepseek) / "config.json").read_text())["num_hidden_layers"]
    assert full["graphs"] > 0 and full["replays"] > 0, full
    # Every captured graph holds one task group per MLA layer, and every replay updated each
    # of them first: the fused op ran inside the graphs with the step's lengths.
    assert full["task_groups"] == full["graphs"] * layers, (full, layers)
    assert full["task_updates"] == full["replays"] * layers, (full, layers)
    return full


def test_deepseek_with_full_decode_graphs_keeps_greedy_tokens(deepseek, deepseek_npu):
    result = run(deepseek, NPU, **FULL_DECODE)
    assert_on_npu(result)
    full = _assert_fused_attention_replayed_in_graphs(result, deepseek)
    assert full["replays"] >= MAX_TOKENS - 1  # every decode step after the first token
    (eager_worker,) = deepseek_npu["workers"]
    assert eager_worker["graph_counts"] == {}
    assert result["token_ids"] == deepseek_npu["token_ids"]



def test_mtp_with_full_decode_graphs_keeps_greedy_tokens(deepseek, deepseek_npu):
    """MTP (3 drafts) with FULL decode graphs: the verification batches (4-token queries of
    every request) replay the captured graphs, the draft model runs eagerly (vLLM's drafter
    takes PIECEWISE graphs only), and the greedy tokens are the eager run's without
    speculation. Before AscendEagleProposer.dummy_run padded the draft layers' slots, the
    capture's warm-up of the drafter wrote every dummy token to KV slot 0 and the engine
    failed to start (npu_scatter_pa_kv_cache: duplicate slots)."""
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    result = run(deepseek, NPU, speculative_config=spec, disable_log_stats=False,
                 **FULL_DECODE)
    assert_on_npu(result)
    (worker,) = result["workers"]
    assert worker["drafter"] == "AscendEagleProposer"
    assert worker["drafter_counters"]["dummy_run_padding_slots"] > 0
    # Only verification batches were captured: each size a whole number of 4-token queries.
    sizes = worker["graph_capture_sizes"]
    assert sizes and all(size % 4 == 0 for size in sizes), sizes
    # Padding tokens of a captured batch write the null block, one slot each: no captured
    # batch is larger than the KV block size the MLA backend chose (16, where the platform
    # first assumed 128: 8 requests of 4 tokens were captured and padding wrote block 1).
    assert max(sizes) <= worker["kv_block_size"], (sizes, worker["kv_block_size"])
    full = _assert_fused_attention_replayed_in_graphs(result, deepseek)
    assert full["graphs"] == len(sizes), (full, sizes)
    # Graphs replayed, and no more often than the rejection sampler verified drafts.
    verifications = worker["rejection_sampler_calls"]
    assert 0 < full["replays"] <= verifications, (full, verifications)
    metrics = result["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens"] > 0, metrics
    assert_equal_up_to_near_ties(result, deepseek_npu, "MTP with FULL decode graphs on npu")
    print(f"\nMTP + FULL graphs: {full['replays']} replays of {verifications} verification "
          f"steps; equal to eager without speculation: "
          f"{result['token_ids'] == deepseek_npu['token_ids']}")
