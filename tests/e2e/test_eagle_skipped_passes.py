"""EAGLE steps that ask for no drafts skip the draft model, and a catch-up pass restores its KV.

vLLM runs the draft's first pass in every step, even where the draft-length controller asks
for no drafts, only to keep the draft's KV cache in step with the target. Our proposer keeps
those steps' inputs instead and runs them in one pass before the next step that drafts.
Here the controller's choice is forced to a fixed pattern of lengths (0 and 3) in the engine
(this file is also its script), and every draft the proposer returns is recorded, per step
and request: with skipping on, the drafts are those of a proposer that runs every pass; with
skipping on and the catch-up pass left out, they are not (the draft attends to KV that was
never written), so the comparison can fail. Greedy tokens are the same in all runs (those of
every pass equal no speculation: test_draft_length.py).
"""

from __future__ import annotations

import json
import sys

import pytest

from vllm_runs import run_script

HOST = {"VLLM_ASCEND_TARGET": "host"}
K = 3
MAX_TOKENS = 32
# Lengths of consecutive steps, repeated: runs of skipped passes of different lengths.
PATTERN = [3, 0, 0, 3, 0, 0, 0, 0, 3, 3, 0]
_DRAFTS: list = []


def install(worker, skip: bool, catch_up: bool) -> str:
    """In the worker: skipping on or off, the catch-up pass on or off, a record of drafts."""
    drafter = getattr(worker, "worker", worker).model_runner.drafter
    drafter.skips_idle_passes = skip
    if not catch_up:
        drafter._catch_up = lambda *args, **kwargs: None
    propose = drafter.propose

    def recorded(*args, **kwargs):
        drafts = propose(*args, **kwargs)
        if drafts.shape[1]:
            # vLLM's request ids: the prompt's index, then a random suffix.
            ids = [r.split("-")[0] for r in drafter._runner.input_batch.req_ids]
            _DRAFTS.append(dict(zip(ids[:drafts.shape[0]], drafts.tolist(), strict=True)))
        return drafts

    drafter.propose = recorded
    return type(drafter).__name__


def collect(worker) -> dict:
    drafter = getattr(worker, "worker", worker).model_runner.drafter
    return {"drafts": _DRAFTS, "counters": dict(drafter.ascend_counters)}


def engine_main(args: dict) -> None:
    from vllm import LLM, SamplingParams

    from ascend_plugin.demo_model import held_out_prompts

    prompts = held_out_prompts(8, 300)
    llm = LLM(model=args["model"], dtype="float32", max_model_len=512, enforce_eager=True,
              seed=0, max_num_seqs=8, enable_prefix_caching=False, **args["llm"])
    controller = llm.llm_engine.engine_core.engine_core.scheduler.draft_controller
    steps = iter(range(10 ** 9))

    def forced(req_ids, full=()):
        k = PATTERN[next(steps) % len(PATTERN)]
        return k, {r: k for r in req_ids}

    controller.choose = forced
    drafter = llm.collective_rpc(install, args=(args["skip"], args["catch_up"]))[0]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {"drafter": drafter, "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
              **llm.collective_rpc(collect)[0]}
    print("RESULT " + json.dumps(result), flush=True)


@pytest.fixture(scope="module")
def runs(model) -> dict:
    from ascend_plugin.tiny_drafts import ensure_eagle_draft

    eagle = {"method": "eagle", "model": str(ensure_eagle_draft(model, std=0.02)),
             "num_speculative_tokens": K}
    llm = {"speculative_config": eagle,
           "additional_config": {"draft_length_config": {"dynamic": True}}}
    out = {}
    for name, skip, catch_up in (("every pass", False, True), ("skipped", True, True),
                                 ("no catch-up", True, False)):
        out[name] = run_script(__file__, {"model": model, "llm": llm, "skip": skip,
                                          "catch_up": catch_up}, HOST)[0]
    return out


def drafted_tokens(result: dict) -> list[int]:
    return [t for step in result["drafts"] for ids in step.values() for t in ids]


def test_skipped_passes_give_the_drafts_of_every_pass(runs):
    every, skipped = runs["every pass"], runs["skipped"]
    assert every["drafter"] == skipped["drafter"] == "AscendEagleProposer"
    assert every["counters"].get("draft_passes_skipped", 0) == 0
    counters = skipped["counters"]
    assert counters["draft_passes_skipped"] >= 10, counters
    assert counters["draft_catch_up_passes"] >= 3, counters
    # Each catch-up pass carries the kept tokens of several steps and requests.
    assert counters["draft_catch_up_tokens"] >= 4 * counters["draft_catch_up_passes"]
    assert len(drafted_tokens(every)) >= 100
    assert skipped["drafts"] == every["drafts"]
    for name in ("skipped", "no catch-up"):
        assert runs[name]["token_ids"] == every["token_ids"], name


def test_without_the_catch_up_the_drafts_differ(runs):
    every, blind = drafted_tokens(runs["every pass"]), drafted_tokens(runs["no catch-up"])
    assert len(blind) == len(every)
    # The random draft leans mostly on the token and hidden state it is given, so only some
    # of its drafts change when it attends to KV that was never written; any is a failure.
    assert any(a != b for a, b in zip(every, blind, strict=True))


if __name__ == "__main__":
    engine_main(json.loads(sys.argv[1]))
