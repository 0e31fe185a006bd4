"""N-gram and suffix decoding on the host target: our proposers inside real vLLM.

The base model is the tiny Llama of test_medusa (initializer_range 0.005), whose greedy
continuations revisit earlier stretches and fall into loops on several of the prompts, so
prompt lookup and suffix trees find drafts that the target accepts. (The demo Llama is chaotic:
its continuations never repeat, and neither proposer ever drafts.)

The acceptance figures come from vLLM's own counters: ``LLM.get_metrics()`` summarised in the
engine's process by ``ascend_specdec.metrics.acceptance_summary``. For n-gram they are checked
against a replay of speculative decoding over the generated tokens: the n-gram rule drafts from
the history, the target accepts the longest prefix that equals its greedy continuation, plus
one token; every step that drafted is counted, as vLLM's scheduler does.
"""

from __future__ import annotations

import pytest

from vllm_runs import FIXED_DRAFT_LENGTH, PROMPTS, run_vllm

HOST = {"VLLM_ASCEND_TARGET": "host"}
BASE = {"initializer_range": 0.005}
MAX_TOKENS = 64
K = 3
NGRAM = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
SUFFIX_K = 4
SUFFIX = {"method": "suffix", "num_speculative_tokens": SUFFIX_K}


def run(model, max_tokens=MAX_TOKENS, **llm) -> dict:
    return run_vllm({"model": model, "prompts": PROMPTS, "max_tokens": max_tokens,
                     "acceptance_summary": "speculative_config" in llm,
                     "llm": {"disable_log_stats": False,
                             "additional_config": FIXED_DRAFT_LENGTH, **llm}}, HOST)


@pytest.fixture(scope="module")
def base_dir() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("llama", **BASE))


@pytest.fixture(scope="module")
def without_speculation(base_dir) -> dict:
    # K tokens more than the speculative runs: what the target would have said to every draft
    # the replay checks, including drafts verified in the last step.
    return run(base_dir, max_tokens=MAX_TOKENS + K)


@pytest.fixture(scope="module")
def reference_tokens(without_speculation) -> list[list[int]]:
    tokens = [ids[:MAX_TOKENS] for ids in without_speculation["token_ids"]]
    assert len({tuple(ids) for ids in tokens}) == len(PROMPTS)
    return tokens


@pytest.fixture(scope="module")
def ngram_8(base_dir) -> dict:
    return run(base_dir, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def ngram_1(base_dir) -> dict:
    return run(base_dir, speculative_config=NGRAM, max_num_seqs=1)


@pytest.fixture(scope="module")
def suffix_8(base_dir) -> dict:
    return run(base_dir, speculative_config=SUFFIX)


@pytest.fixture(scope="module")
def suffix_1(base_dir) -> dict:
    return run(base_dir, speculative_config=SUFFIX, max_num_seqs=1)


def report(name, result) -> dict:
    summary = result["acceptance_summary"]
    print(f"\n{name}: mean acceptance length {summary['mean_acceptance_length']:.3f}, "
          f"per-position acceptance {[round(r, 3) for r in summary['per_position_rate']]}, "
          f"{summary['num_drafts']} drafting steps, {summary['num_draft_tokens']} draft tokens")
    return summary


def assert_ours(result, drafter):
    (worker,) = result["workers"]
    assert worker["model_runner"] == "ascend_core.worker.host_model_runner.AscendHostModelRunner"
    assert worker["proposer_source"] == "ascend"
    assert worker["drafter"] == drafter


def replay_ngram(prompt, continuation, generated):
    """vLLM's counters for n-gram speculation over a known greedy continuation."""
    from ascend_specdec.ngram import NgramConfig, propose_reference

    config = NgramConfig(NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"], K)
    history, done = list(prompt) + continuation[:1], 1  # the prefill step samples one token
    drafts, draft_tokens, per_pos = 0, 0, [0] * K
    while done < generated:
        draft = propose_reference(config, history)
        accepted = 0
        while accepted < len(draft) and draft[accepted] == continuation[done + accepted]:
            accepted += 1
        if draft:
            drafts += 1
            draft_tokens += len(draft)
            for position in range(accepted):
                per_pos[position] += 1
        history += continuation[done:done + accepted + 1]
        done += accepted + 1
    return drafts, draft_tokens, per_pos


# ------------------------------------------------------------------------------------ n-gram


def test_ngram_our_proposer_runs_inside_vllm(ngram_8, ngram_1):
    assert_ours(ngram_8, "AscendNgramProposer")
    assert_ours(ngram_1, "AscendNgramProposer")


def test_ngram_greedy_output_equals_no_speculation_at_batch_8_and_1(ngram_8, ngram_1,
                                                                    reference_tokens):
    assert ngram_8["token_ids"] == reference_tokens
    assert ngram_1["token_ids"] == reference_tokens


def test_ngram_acceptance_from_get_metrics_matches_a_replay_of_the_outputs(
        ngram_8, ngram_1, without_speculation):
    expected_drafts, expected_tokens, expected_per_pos = 0, 0, [0] * K
    for prompt, continuation in zip(without_speculation["prompt_token_ids"],
                                    without_speculation["token_ids"], strict=True):
        drafts, tokens, per_pos = replay_ngram(prompt, continuation, MAX_TOKENS)
        expected_drafts += drafts
        expected_tokens += tokens
        expected_per_pos = [a + b for a, b in zip(expected_per_pos, per_pos, strict=True)]
    for name, result in (("n-gram batch 8", ngram_8), ("n-gram batch 1", ngram_1)):
        summary = report(name, result)
        assert summary["num_drafts"] == expected_drafts
        assert summary["num_draft_tokens"] == expected_tokens
        assert summary["num_accepted_tokens_per_pos"] == expected_per_pos
        assert all(count > 0 for count in summary["num_accepted_tokens_per_pos"])
        assert summary["mean_acceptance_length"] == pytest.approx(
            1 + sum(expected_per_pos) / expected_drafts)
        assert summary["per_position_rate"] == pytest.approx(
            [count / expected_drafts for count in expected_per_pos])
        # The same counters as run_llm reads them, engine by engine.
        assert result["metrics"]["vllm:spec_decode_num_accepted_tokens_per_pos"] == (
            summary["num_accepted_tokens_per_pos"])
    assert ngram_8["acceptance_summary"]["mean_acceptance_length"] > 1.5


# ------------------------------------------------------------------------------------ suffix


def test_suffix_our_proposer_runs_inside_vllm_without_arctic_inference(suffix_8, suffix_1):
    import importlib.util

    assert importlib.util.find_spec("arctic_inference") is None
    assert_ours(suffix_8, "AscendSuffixProposer")
    assert_ours(suffix_1, "AscendSuffixProposer")


def test_suffix_greedy_output_equals_no_speculation_at_batch_8_and_1(suffix_8, suffix_1,
                                                                    reference_tokens):
    assert suffix_8["token_ids"] == reference_tokens
    assert suffix_1["token_ids"] == reference_tokens


def test_suffix_drafts_are_accepted_and_vary_in_length(suffix_8, suffix_1):
    for name, result in (("suffix batch 8", suffix_8), ("suffix batch 1", suffix_1)):
        summary = report(name, result)
        assert all(count > 0 for count in summary["num_accepted_tokens_per_pos"])
        assert summary["mean_acceptance_length"] > 1.5
        # Drafts stop where the tree's path probability or the match length runs out.
        assert summary["num_draft_tokens"] < SUFFIX_K * summary["num_drafts"]
