"""Speculative decoding in bf16 on the trained demo model (pycoder-26m), as users serve it.

On a trained model greedy paths rarely hang on near-ties, so bf16 speculation should keep
almost every request equal to bf16 without speculation. Where a request parts, it must be at
a near-tie of the run without speculation (its two best logprobs within ``NEAR_TIE`` nats):
a verification step scores the same position in a batch of another shape, and bf16 rounding
may then flip the order of two nearly equal logits, nothing more. Prompts come from the
model's held-out files. Float32 exactness of every method is tested on tiny models elsewhere.
"""

from __future__ import annotations

import pytest

from vllm_runs import FIXED_DRAFT_LENGTH, run_vllm

HOST = {"VLLM_ASCEND_TARGET": "host"}
MAX_TOKENS = 48
K = 3
NEAR_TIE = 0.1  # nats
BF16 = {"dtype": "bfloat16", "disable_log_stats": False, "max_model_len": 1024,
        "additional_config": FIXED_DRAFT_LENGTH}


def run(model, **llm) -> dict:
    from ascend_plugin.demo_model import held_out_prompts

    return run_vllm({"model": model, "prompts": held_out_prompts(), "max_tokens": MAX_TOKENS,
                     "sampling": {"logprobs": 2}, "llm": {**BF16, **llm}}, HOST)


def acceptance_length(result) -> float:
    metrics = result["metrics"]
    return 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / metrics[
        "vllm:spec_decode_num_drafts"]


def partings(result, plain) -> list[tuple[int, int, float]]:
    """(request, position, top-2 gap of the plain run there) where ``result`` leaves ``plain``."""
    found = []
    for i, (ours, theirs) in enumerate(zip(result["token_ids"], plain["token_ids"])):
        position = next((p for p, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if position is not None:
            best = sorted(plain["logprobs"][i][position].values(), reverse=True)
            found.append((i, position, best[0] - best[1]))
    return found


@pytest.fixture(scope="module")
def plain(model) -> dict:
    return run(model)


def test_the_trained_model_is_confident_where_a_random_one_is_flat(plain):
    # The random demo model's greedy tokens sat near -7.4 nats (ln 2048 = 7.6).
    chosen = [max(position.values()) for request in plain["logprobs"] for position in request]
    assert sum(chosen) / len(chosen) > -1.0


def check(result, plain, label: str, min_length: float) -> None:
    """Our proposer ran, accepted at least ``min_length``, and at most two requests parted
    from ``plain``, each at a near-tie."""
    assert result["workers"][0]["proposer_source"] == "ascend"
    length = acceptance_length(result)
    parted = partings(result, plain)
    print(f"\n{label} bf16: acceptance length {length:.2f}, parted {parted}")
    assert length >= min_length
    assert len(parted) <= 2 and all(gap < NEAR_TIE for _, _, gap in parted), parted


def test_medusa_heads_in_bf16_accept_and_keep_greedy_tokens(model, plain):
    from ascend_plugin.demo_model import demo_medusa_dir

    spec = {"method": "medusa", "model": str(demo_medusa_dir()), "num_speculative_tokens": K}
    check(run(model, speculative_config=spec), plain, "Medusa", 1.4)  # measured 1.47


def test_ngram_in_bf16_accepts_and_keeps_greedy_tokens(model, plain):
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}
    check(run(model, speculative_config=spec), plain, "n-gram", 2.2)  # measured 2.45
