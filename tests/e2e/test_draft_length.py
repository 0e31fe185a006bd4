"""The draft-length controller (ascend-specdec, ``draft_length_config.dynamic``) inside real
vLLM on the host.

The trained demo model in float32 serves held-out code prompts at batch 1, 8 and 64 in one
engine per configuration (this file is also that engine's script): n-gram, suffix decoding,
the demo's Medusa heads, and EAGLE and EAGLE-3 drafts of random weights (their drafts are
almost never accepted); MTP on a tiny random DeepSeek-V3 target with one MTP layer (test
test_eagle_mtp.py's). Greedy tokens equal those without speculation at every batch size,
whatever lengths were chosen; the controller's own record (the lengths it chose, its
acceptance estimates) comes back from the scheduler.
"""

from __future__ import annotations

import json
import sys

import pytest

from vllm_runs import run_script, start_failure

HOST = {"VLLM_ASCEND_TARGET": "host"}
DYNAMIC = {"draft_length_config": {"dynamic": True}}
K = 3
MAX_TOKENS = 24
BATCHES = (1, 8, 64)


def engine_main(args: dict) -> None:
    from vllm import LLM, SamplingParams

    from ascend_plugin.demo_model import held_out_prompts

    base = held_out_prompts(28, 300)
    prompts = [base[i % len(base)][: 300 - 60 * (i // len(base))] for i in range(64)]
    llm = LLM(model=args["model"], dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, max_num_seqs=64, **args.get("llm", {}))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    result = {"token_ids": {}}
    for batch in BATCHES:
        outputs = llm.generate(prompts[:batch], params, use_tqdm=False)
        result["token_ids"][str(batch)] = [list(o.outputs[0].token_ids) for o in outputs]
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    result["scheduler"] = type(scheduler).__name__
    controller = getattr(scheduler, "draft_controller", None)
    if controller is not None:
        result["chosen"] = {str(k): n for k, n in controller.chosen.items()}
        result["position_rates"] = controller.position_rates()
        result["steps"] = {f"{n}x{k}": f"{1e3 * t:.1f} ms, {1e3 * per:.2f} ms per request"
                           for (n, k), (t, per) in controller.times.table().items()}
    print("RESULT " + json.dumps(result), flush=True)


def run(model: str, **llm) -> dict:
    # The engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): the scheduler is here.
    return run_script(__file__, {"model": model, "llm": llm}, HOST)[0]


@pytest.fixture(scope="module")
def deepseek() -> str:
    from ascend_plugin.tiny_drafts import ensure_deepseek_mtp_model

    return str(ensure_deepseek_mtp_model(std=0.005, carry_embedding=True))


@pytest.fixture(scope="module")
def plain(model, deepseek):
    done: dict = {}

    def get(method: str = "ngram") -> dict:
        target = deepseek if method == "mtp" else model
        if target not in done:
            done[target] = run(target)
        return done[target]

    return get


def speculation(model: str, method: str) -> dict:
    from ascend_plugin.demo_model import demo_medusa_dir
    from ascend_plugin.tiny_drafts import ensure_eagle3_draft, ensure_eagle_draft

    if method == "mtp":  # drafts with the target's own MTP layer: no "model"
        return {"method": "mtp", "num_speculative_tokens": K}
    if method == "eagle3":
        return {"method": "eagle3", "num_speculative_tokens": K,
                "model": str(ensure_eagle3_draft(model, draft_vocab_size=1024))}
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": K}
    if method == "medusa":
        return {"method": "medusa", "model": str(demo_medusa_dir()), "num_speculative_tokens": K}
    return {"method": "eagle", "model": str(ensure_eagle_draft(model, std=0.02)),
            "num_speculative_tokens": K}


@pytest.fixture(scope="module")
def dynamic(model, deepseek):
    done: dict = {}

    def get(method: str) -> dict:
        if method not in done:
            target = deepseek if method == "mtp" else model
            done[method] = run(target, speculative_config=speculation(target, method),
                               additional_config=DYNAMIC)
        return done[method]

    return get


@pytest.mark.parametrize("method", ["ngram", "suffix", "medusa", "eagle", "eagle3", "mtp"])
def test_greedy_tokens_equal_no_speculation_at_batch_1_8_and_64(plain, dynamic, method):
    result = dynamic(method)
    assert result["scheduler"] == "AscendDraftLengthScheduler"
    expected = plain(method)
    for batch in BATCHES:
        assert result["token_ids"][str(batch)] == expected["token_ids"][str(batch)], batch
    chosen = {int(k): n for k, n in result["chosen"].items()}
    print(f"\n{method}: lengths chosen {chosen}, per-position acceptance "
          f"{[round(r, 2) for r in result['position_rates']]}, steps (requests x length) "
          f"{result['steps']}")
    assert set(chosen) == set(range(K + 1))
    # Every decode step chose: at least the calibration of each batch-size range.
    assert sum(chosen.values()) >= MAX_TOKENS * len(BATCHES) // (K + 1)
    assert all(n > 0 for n in chosen.values())


def test_lengths_that_cost_more_and_buy_nothing_are_only_measured(dynamic):
    """A random EAGLE draft, almost never accepted: lengths 2 and 3 (each a draft-model pass
    more than 1, and more tokens to verify) are run only to time them: three steps each per
    batch-size range at start-up, and at most two steps of exploration per range here."""
    result = dynamic("eagle")
    assert result["position_rates"][0] < 0.2, result["position_rates"]
    chosen = {int(k): n for k, n in result["chosen"].items()}
    calibration = 3 * len(BATCHES)
    assert chosen[2] + chosen[3] <= 2 * calibration + 2 * len(BATCHES), chosen


def test_medusa_heads_are_accepted(dynamic):
    """The demo's heads (trained in bf16, here in float32): a first draft accepted about a
    third of the time, where the random EAGLE draft's almost never is."""
    result = dynamic("medusa")
    assert result["position_rates"][0] > 0.25, result["position_rates"]


def test_pinned_length_and_the_switch_off(model, plain):
    pinned = run(model, speculative_config=speculation(model, "medusa"),
                 additional_config={"draft_length_config": {
                     "dynamic": True, "min_num_speculative_tokens": 2,
                     "max_num_speculative_tokens": 2}})
    assert pinned["chosen"] == {"2": sum(pinned["chosen"].values())}
    assert pinned["token_ids"] == plain()["token_ids"]
    # Off by default: vLLM's own scheduler, every step at num_speculative_tokens.
    off = run(model, speculative_config=speculation(model, "medusa"))
    assert off["scheduler"] == "Scheduler" and "chosen" not in off
    assert off["token_ids"] == plain()["token_ids"]


def test_a_bound_above_the_configured_length_stops_the_start(model):
    output = start_failure(
        {"model": model, "llm": {"speculative_config": speculation(model, "ngram"),
                                 "additional_config": {"draft_length_config": {
                                     "dynamic": True,
                                     "max_num_speculative_tokens": K + 1}}}},
        HOST, script=__file__)
    assert ("additional_config key 'draft_length_config.max_num_speculative_tokens' is 4, "
            "more than speculative_config's num_speculative_tokens=3: use at most 3.") in output


if __name__ == "__main__":
    engine_main(json.loads(sys.argv[1]))
