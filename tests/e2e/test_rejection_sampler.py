"""Our rejection sampler inside real vLLM on the host target, with n-gram speculation:
it is the one verifying, greedy output equals output without speculation, and seeded
random sampling is reproducible."""

from __future__ import annotations

import pytest

from vllm_runs import FIXED_DRAFT_LENGTH, PROMPTS, run_vllm

HOST = {"VLLM_ASCEND_TARGET": "host"}
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
MAX_TOKENS = 64
# The model's logits are nearly flat, so sampling wanders; top-k 3 keeps the walk on few
# tokens, so it revisits them and drafts get verified on the random path.
SEEDED = {"temperature": 0.8, "top_k": 3, "seed": 1234}
# Top-k 1 makes the target one-hot: the random path (temperature > 0) must then accept
# exactly the drafts greedy verification accepts and give the greedy tokens.
ONE_HOT = {"temperature": 0.8, "top_k": 1, "seed": 99}
# Sampling at temperature 0.8 from that model wanders over the whole vocabulary; a draft on
# every token seen before (prompt_lookup_min 1) still gives a few drafts per request.
NGRAM_ANY_REPEAT = {**NGRAM, "prompt_lookup_min": 1}
# The demo Llama never repeats itself, so n-gram lookup finds nothing to draft; with weights
# 40x smaller (test_medusa.py's base) greedy continuations fall into loops and drafts come.
LOOPING_LLAMA = {"initializer_range": 0.005}


def run(model, sampling=None, prompts=PROMPTS, **llm) -> dict:
    return run_vllm({"model": model, "prompts": prompts, "max_tokens": MAX_TOKENS,
                     "sampling": sampling or {},
                     "llm": {"disable_log_stats": False,
                             "additional_config": FIXED_DRAFT_LENGTH, **llm}}, HOST)


@pytest.fixture(scope="module")
def model_dir() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("llama", **LOOPING_LLAMA))


@pytest.fixture(scope="module")
def without_speculation(model_dir) -> dict:
    return run(model_dir)


@pytest.fixture(scope="module")
def greedy_ngram(model_dir) -> dict:
    return run(model_dir, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def one_hot_ngram(model_dir) -> dict:
    return run(model_dir, ONE_HOT, speculative_config=NGRAM)


@pytest.fixture(scope="module")
def seeded_ngram(model_dir) -> dict:
    # Every prompt twice in one batch, each request with the same seed: a seeded request's
    # tokens must not depend on where it sits in the batch or on its neighbours' draws.
    return run(model_dir, SEEDED, prompts=PROMPTS + PROMPTS,
               speculative_config=NGRAM_ANY_REPEAT)


def drafts_verified(result) -> int:
    return result["metrics"]["vllm:spec_decode_num_drafts"]


def test_our_sampler_verifies_the_drafts(greedy_ngram):
    (worker,) = greedy_ngram["workers"]
    assert worker["model_runner"] == "ascend_core.worker.host_model_runner.AscendHostModelRunner"
    assert worker["rejection_sampler_source"] == "ascend"
    assert worker["rejection_sampler"] == "AscendRejectionSampler"
    # vLLM counted drafts, and our sampler ran (the runner calls it every step while
    # speculation is on, drafts or not).
    assert drafts_verified(greedy_ngram) > 0
    assert worker["rejection_sampler_calls"] >= MAX_TOKENS - drafts_verified(greedy_ngram)


def test_greedy_output_equals_no_speculation(greedy_ngram, without_speculation):
    assert len({tuple(ids) for ids in without_speculation["token_ids"]}) > 1
    assert greedy_ngram["token_ids"] == without_speculation["token_ids"]
    assert greedy_ngram["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_random_path_with_a_one_hot_target_is_greedy(one_hot_ngram, greedy_ngram,
                                                     without_speculation):
    assert one_hot_ngram["token_ids"] == without_speculation["token_ids"]
    # Same drafts, and every one accepted exactly when greedy verification accepted it.
    assert one_hot_ngram["metrics"] == greedy_ngram["metrics"]
    assert one_hot_ngram["metrics"]["vllm:spec_decode_num_accepted_tokens"] > 0


def test_seeded_random_sampling_is_reproducible(seeded_ngram, without_speculation):
    (worker,) = seeded_ngram["workers"]
    assert worker["rejection_sampler_source"] == "ascend"
    metrics = seeded_ngram["metrics"]
    print(f"\nseeded n-gram run: {drafts_verified(seeded_ngram)} drafts, "
          f"{metrics['vllm:spec_decode_num_accepted_tokens']} draft tokens accepted")
    assert drafts_verified(seeded_ngram) > 0
    first, second = (seeded_ngram["token_ids"][:len(PROMPTS)],
                     seeded_ngram["token_ids"][len(PROMPTS):])
    assert first == second
    # It did sample: at temperature 0.8 the tokens leave the greedy path.
    assert first != without_speculation["token_ids"]
