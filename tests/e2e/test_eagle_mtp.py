"""EAGLE, EAGLE-3 and MTP on the host target: our proposer inside real vLLM, on drafts made here.

Targets and drafts (``ascend_plugin.tiny_drafts``, random weights, cached):
- EAGLE and EAGLE-3 draft for the tiny Llama of test_medusa (initializer_range 0.005, where
  the token embedding dominates the residual stream). The EAGLE draft's ``fc`` passes the token
  embedding through, so it predicts, from its input token, what the target would: it is
  accepted often without training. The EAGLE-3 draft is random, over a truncated draft
  vocabulary of 1024 of 2048 tokens (``d2t``): its drafts are almost never accepted, which still
  tests that rejected drafts leave the output alone.
- MTP: a DeepSeek-V3 model (MLA attention, MoE) with one MTP layer, loaded by vLLM as
  ``DeepSeekMTPModel`` on its CPU MLA backend; its ``eh_proj`` passes the embedding through
  like the EAGLE draft's ``fc``.

For each method, greedy output equals greedy output without speculation, at batch 8 and at
batch 1 (``max_num_seqs=1``), and the mean acceptance length is recorded from vLLM's own
counters. Engines are shared through module-scoped fixtures (each start costs 30-60 s).

These random targets are nearly uniform at some positions, and there two tokens can tie
exactly in float32 (seen in development: two logprobs of -7.4475212 in the MTP target,
batch 1 on one core); a batch of k + 1 tokens rounds apart from a batch of one (vLLM's
CPU matmuls and attention), so such a tie may break the other way. Outputs are equal, or equal up to a
position where the run without speculation has the two tokens within ``FLOAT32_TIE``.
"""

from __future__ import annotations

import pytest
from test_npu_target import first_difference

from vllm_runs import FIXED_DRAFT_LENGTH, PROMPTS, run_vllm, start_failure

HOST = {"VLLM_ASCEND_TARGET": "host"}
SMALL = 0.005  # weight std of the embedding-dominated models
MAX_TOKENS = 48
K = 3
METHODS = ("eagle", "eagle3", "mtp")
# Each proposer step our subclass takes over, counted inside the worker.
BOOKKEEPING = ("next_token_ids_padded", "sample_indices_padded", "step_positions_and_slots")
TOP_LOGPROBS = 5
FLOAT32_TIE = 1e-4  # nat: rounding, not a preference


@pytest.fixture(scope="module")
def llama_dir() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("llama", initializer_range=SMALL))


@pytest.fixture(scope="module")
def models(llama_dir) -> dict:
    """method -> (target folder, speculative_config)."""
    from ascend_plugin.tiny_drafts import (
        ensure_deepseek_mtp_model,
        ensure_eagle3_draft,
        ensure_eagle_draft,
    )

    eagle = ensure_eagle_draft(llama_dir, std=SMALL, carry_embedding=True)
    eagle3 = ensure_eagle3_draft(llama_dir, draft_vocab_size=1024)
    deepseek = ensure_deepseek_mtp_model(std=SMALL, carry_embedding=True)
    return {
        "eagle": (llama_dir, {"method": "eagle", "model": str(eagle),
                              "num_speculative_tokens": K}),
        "eagle3": (llama_dir, {"method": "eagle3", "model": str(eagle3),
                               "num_speculative_tokens": K}),
        # MTP drafts with the target's own checkpoint: no "model".
        "mtp": (str(deepseek), {"method": "mtp", "num_speculative_tokens": K}),
    }


def run(model: str, env: dict | None, sampling: dict | None = None, **llm) -> dict:
    return run_vllm({"model": model, "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
                     "sampling": sampling or {},
                     "llm": {"disable_log_stats": False,
                             "additional_config": FIXED_DRAFT_LENGTH, **llm}}, env)


@pytest.fixture(scope="module")
def runs(models):
    """A cache of engine runs by (target, method or None, batch, env)."""
    done: dict = {}

    def get(method: str, *, speculate: bool = True, batch: int = 8, stock: bool = False):
        target, spec = models[method]
        key = (target, method if speculate else None, batch, stock)
        if key not in done:
            llm = {"max_num_seqs": batch}
            if speculate:
                llm["speculative_config"] = spec
            # Without speculation, the logprobs that tell a tie (the module docstring).
            sampling = None if speculate else {"logprobs": TOP_LOGPROBS}
            done[key] = run(target, None if stock else HOST, sampling, **llm)
        return done[key]

    return get


def acceptance_length(result: dict) -> float:
    metrics = result["metrics"]
    drafts = metrics["vllm:spec_decode_num_drafts"]
    assert drafts > 0, metrics
    return 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / drafts


@pytest.mark.parametrize("method", METHODS)
def test_our_proposer_runs_inside_vllm(runs, method):
    (worker,) = runs(method)["workers"]
    assert worker["model_runner"] == "ascend_core.worker.host_model_runner.AscendHostModelRunner"
    assert worker["proposer_source"] == "ascend"
    assert worker["drafter"] == "AscendEagleProposer"
    counters = worker["drafter_counters"]
    for step in BOOKKEEPING:
        assert counters.get(step, 0) > 0, counters
    sampling = "greedy_truncated_vocab" if method == "eagle3" else "greedy_full_vocab"
    assert counters.get(sampling, 0) > 0, counters


@pytest.mark.parametrize("batch", [8, 1])
@pytest.mark.parametrize("method", METHODS)
def test_greedy_output_equals_no_speculation(runs, method, batch):
    plain = runs(method, speculate=False)
    # Prompt-dependent continuations (two prompts ending alike may share one).
    assert len({tuple(ids) for ids in plain["token_ids"]}) >= len(PROMPTS) - 1
    speculated = runs(method, batch=batch)["token_ids"]
    ties = []
    for prompt, (ours, theirs) in enumerate(zip(speculated, plain["token_ids"], strict=True)):
        n = first_difference(ours, theirs)
        if n is None:
            continue
        top = plain["logprobs"][prompt][n]
        gap = (abs(top[str(ours[n])] - top[str(theirs[n])]) if str(ours[n]) in top
               else float("inf"))
        assert gap <= FLOAT32_TIE, (f"{method}, batch {batch}, prompt {prompt}: token "
                                    f"{ours[n]} where no speculation chose {theirs[n]} at "
                                    f"position {n}; the top logprobs there: {top}")
        ties.append((prompt, n))
    print(f"\n{method}, batch {batch}: equal but for float32 ties at (prompt, position) "
          f"{ties}")


@pytest.mark.parametrize("method", METHODS)
def test_mean_acceptance_length(runs, method):
    lengths = {batch: acceptance_length(runs(method, batch=batch)) for batch in (8, 1)}
    metrics = runs(method)["metrics"]
    print(f"\n{method} k={K}: mean acceptance length {lengths[8]:.3f} at batch 8, "
          f"{lengths[1]:.3f} at batch 1 (accepted per position "
          f"{metrics['vllm:spec_decode_num_accepted_tokens_per_pos']}, "
          f"{metrics['vllm:spec_decode_num_drafts']} drafts)")
    if method == "eagle3":  # a random draft over half the vocabulary: (almost) never right
        assert lengths[8] < 1.2
    else:  # the embedding-carrying drafts are right often, at every position
        assert lengths[8] >= 1.5
        assert all(n > 0 for n in metrics["vllm:spec_decode_num_accepted_tokens_per_pos"])


def test_stock_vllm_drafts_the_same_as_ours(runs):
    # Without VLLM_ASCEND_TARGET the plugin stays out: vLLM's EagleProposer with its own
    # bookkeeping kernels. Same draft, same target: the same drafts, hence the same counters.
    stock = runs("eagle", stock=True)
    (worker,) = stock["workers"]
    assert worker["drafter"] == "EagleProposer" and worker["proposer_source"] is None
    ours = runs("eagle")
    assert stock["token_ids"] == ours["token_ids"]
    assert stock["metrics"] == ours["metrics"]


def test_draft_for_another_hidden_size_fails_at_start_up(llama_dir):
    from ascend_plugin.tiny_drafts import ensure_eagle_draft

    wide = ensure_eagle_draft(llama_dir, hidden_size=256)
    output = start_failure({"model": llama_dir, "prompts": ["x"],
                            "llm": {"speculative_config": {"method": "eagle", "model": str(wide),
                                                           "num_speculative_tokens": K}}},
                           HOST)
    assert "DraftConfigError" in output
    assert "reads target hidden states of size 256" in output
    assert "the target model's hidden size is 128" in output


def eagle_start_failure(target: str, method: str, draft: str) -> str:
    return start_failure({"model": target, "prompts": ["x"],
                          "llm": {"speculative_config": {"method": method, "model": draft,
                                                         "num_speculative_tokens": K}}},
                         HOST)


def test_draft_of_the_other_eagle_kind_fails_at_start_up(llama_dir):
    from ascend_plugin.tiny_drafts import ensure_eagle3_draft

    # Stock vLLM fails later, loading weights: "no module or parameter named 'd2t'".
    output = eagle_start_failure(llama_dir, "eagle", str(ensure_eagle3_draft(llama_dir)))
    assert "DraftConfigError" in output
    assert "is an EAGLE-3 draft (fc.weight [128, 384]" in output
    assert "serve it with method 'eagle3'" in output


def test_full_model_passed_as_an_eagle_draft_fails_at_start_up(llama_dir):
    # A checkpoint of the target's own architecture that is not a draft: vLLM accepts the
    # config and would fail loading weights; our check names what is wrong.
    output = eagle_start_failure(llama_dir, "eagle", llama_dir)
    assert "DraftConfigError" in output
    assert "is not an EAGLE draft (its weights have no fc.weight" in output


def test_eagle_checkpoint_for_another_architecture_fails_at_start_up(llama_dir):
    from ascend_plugin.tiny_models import ensure_model

    # A Qwen2 checkpoint as an EAGLE draft: vLLM's config check refuses the draft
    # architecture it would need (EagleQwen2ForCausalLM) and names it.
    output = eagle_start_failure(llama_dir, "eagle", str(ensure_model("qwen2")))
    assert "Model architectures ['EagleQwen2ForCausalLM'] are not supported" in output


def test_unknown_speculative_method_fails_at_start_up(llama_dir):
    output = start_failure({"model": llama_dir, "prompts": ["x"],
                            "llm": {"speculative_config": {"method": "medusaa",
                                                           "num_speculative_tokens": K}}},
                           HOST)
    assert "medusaa" in output
    assert "'medusa'" in output and "'eagle3'" in output  # the valid methods are listed
