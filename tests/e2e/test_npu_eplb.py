"""EPLB on the npu target end to end: real vLLM, the npu platform and the reference torch_npu;
a tiny Qwen3-MoE (8 experts, top-2, 2 MoE layers) served with dynamic EPLB and 2 redundant
experts by ascend-eplb's runtime through the npu MoE method's ``serve_expert_slots`` hook,
rearranged several times during one generation (on one NPU from a start map, each replan
recorded as an expert map).

Each configuration runs this file as a script in its own process (vLLM resolves its
platform once per process) and reports tokens, top-5 logprobs, which classes the workers
used (``run_llm.probe_worker``) and each worker's EPLB counters (``eplb_summary``).

What is compared with the npu target without EPLB, greedy, bfloat16: every token equal, on

- one NPU: each (token, choice) runs on a replica of its expert holding the same weights,
  through the same torch_npu ops (a row's result does not depend on the other rows of its
  grouped matmul), and a token's two expert outputs are summed in float32 from zero (two
  terms: their order does not change the sum);
- two NPUs (``tensor_parallel_size=2, enable_expert_parallel=True``, HCCL = gloo underneath)
  against the same two NPUs without EPLB, on the top-1 variant of the model: each token's
  one expert output is computed on one rank and the other rank contributes exact zeros to
  the all-gather path's all-reduce, or the row comes back whole from the all-to-all path; so
  no sum changes its order and no near-tie tolerance is needed. (With top-2 over two ranks
  a rearrangement could put a token's two experts on one rank or apart, adding them before
  or after the bfloat16 all-reduce; ``assert_equal_up_to_near_ties`` would then be the
  comparison, as in test_npu_target.py.)
"""

from __future__ import annotations

import json
import sys

import pytest
from test_npu_target import LLM, NPU, TOP_LOGPROBS, assert_on_npu

from vllm_runs import PROMPTS, run_script
from vllm_runs import start_failure as engine_start_failure

MAX_TOKENS = 32
NUM_EXPERTS = 8
NUM_LAYERS = 2  # tiny_models' default
REDUNDANT = 2
# Replan every 4 steps, applied 1 step later: a 32-token generation sees about 7
# rearrangements.
DYNAMIC = {"dynamic_eplb": True, "num_redundant_experts": REDUNDANT,
           "expert_heat_collection_interval": 4, "algorithm_execution_interval": 1}
# Two reference NPUs; batches of 16 tokens or more go all-to-all (the prefills), smaller
# ones all-gather (the decode steps of the 8 prompts), as in test_npu_moe_ep.py.
ALL2ALL_MIN_TOKENS = 16
TWO_NPUS = {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2",
            "VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS": str(ALL2ALL_MIN_TOKENS)}
EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True,
       "distributed_executor_backend": "mp"}


def probe_worker(worker) -> dict:
    """Runs in each worker: the classes it used and the EPLB counters of its model."""
    from ascend_eplb.vllm.routed_experts import eplb_summary

    from run_llm import probe_worker as classes

    inner = getattr(worker, "worker", worker)
    return {**classes(worker), "eplb": eplb_summary(inner.model_runner.get_model())}


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM as VllmLLM
    from vllm import SamplingParams
    from vllm.platforms import current_platform

    llm_kwargs = dict(max_model_len=512, enforce_eager=True, seed=0, **LLM)
    llm_kwargs.update(args.get("llm", {}))
    llm = VllmLLM(model=args["model"], **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=TOP_LOGPROBS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    result = {
        "platform": type(current_platform).__module__ + "." + type(current_platform).__name__,
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "prompt_token_ids": [list(out.prompt_token_ids) for out in outputs],
        "logprobs": [[{str(token): entry.logprob for token, entry in position.items()}
                      for position in out.outputs[0].logprobs] for out in outputs],
        "workers": llm.collective_rpc(probe_worker),
    }
    print("RESULT " + json.dumps(result), flush=True)


def run(model, env: dict, **llm) -> tuple[dict, str]:
    return run_script(__file__, {"model": str(model), "llm": llm}, env, timeout=900)


def start_failure(model, env: dict, **llm) -> str:
    return engine_start_failure({"model": str(model), "llm": llm}, env, timeout=600,
                                script=__file__)


@pytest.fixture(scope="module")
def qwen3_moe() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("qwen3_moe"))


@pytest.fixture(scope="module")
def npu_plain(qwen3_moe) -> dict:
    result, _ = run(qwen3_moe, NPU)
    return result


@pytest.fixture(scope="module")
def map_files(tmp_path_factory) -> dict:
    """A start map unlike the default placement, and where to record replans."""
    from ascend_eplb.expert_map import save_expert_map

    folder = tmp_path_factory.mktemp("npu_eplb_maps")
    start = [[7, 6, 5, 4, 3, 2, 1, 0, 7, 7], [0, 1, 2, 3, 4, 5, 6, 7, 3, 3]]
    save_expert_map(folder / "start.json", start, 1, num_experts=NUM_EXPERTS)
    return {"start": str(folder / "start.json"), "record": str(folder / "record.json"),
            "start_phy2log": start}


@pytest.fixture(scope="module")
def npu_eplb(qwen3_moe, map_files) -> tuple[dict, str]:
    eplb = {**DYNAMIC, "policy": "default", "expert_map_path": map_files["start"],
            "expert_map_record_path": map_files["record"]}
    return run(qwen3_moe, NPU, additional_config={"eplb_config": eplb})


def assert_rearranged_during_generation(summary: dict, phase: str = "all") -> None:
    assert summary["started"] and summary["target"] == "npu"
    history = summary["history"]
    assert summary["rearrangements"] >= 5 and summary["failed_replans"] == 0
    assert all(entry["ok"] for entry in history)
    # Rearrangements happened between steps of the generation, not only at its end (an
    # entry's step is the number of steps completed before it; another step ran after it).
    assert 0 < history[0]["step"] < history[-1]["step"] <= summary["steps"]
    assert summary["experts_moved"] > 0
    assert summary["bytes_moved"] == sum(entry["bytes"] for entry in history) > 0
    # One step per generated token after the prefill (the scheduler may split the prefill
    # over steps); every step recorded, or in the decode phase every step but the prefill.
    assert summary["steps"] >= MAX_TOKENS - 1
    if phase == "all":
        assert summary["recorded_steps"] == summary["steps"]
    else:
        assert 0 < summary["recorded_steps"] < summary["steps"]
    # Redundant experts are served: every slot holds an expert, some twice, and the
    # placement differs from the first one.
    assert summary["phy2log"] != summary["initial_phy2log"]
    for row in summary["phy2log"]:
        assert sorted(set(row)) == list(range(NUM_EXPERTS))
        assert len(row) == NUM_EXPERTS + REDUNDANT


def test_npu_moe_without_eplb_has_no_runtime(npu_plain):
    assert_on_npu(npu_plain)
    (worker,) = npu_plain["workers"]
    assert worker["eplb"] is None
    assert "AscendUnquantizedFusedMoEMethod" in worker["layer_classes"]
    assert len({tuple(ids) for ids in npu_plain["token_ids"]}) > 1


def test_one_npu_rearranges_during_generation_and_keeps_greedy_tokens(npu_eplb, npu_plain,
                                                                       map_files):
    result, _ = npu_eplb
    assert_on_npu(result)
    (worker,) = result["workers"]
    assert "AscendUnquantizedFusedMoEMethod" in worker["layer_classes"]
    summary = worker["eplb"]
    assert summary["num_ranks"] == 1 and summary["slots_per_rank"] == NUM_EXPERTS + REDUNDANT
    assert summary["num_layers"] == NUM_LAYERS
    assert_rearranged_during_generation(summary)
    assert summary["bytes_between_ranks"] == 0
    assert summary["initial_phy2log"] == map_files["start_phy2log"]
    print(f"\nEPLB on one NPU: {summary['rearrangements']} rearrangements at steps "
          f"{[entry['step'] for entry in summary['history']]}, "
          f"{summary['experts_moved']} expert copies, {summary['bytes_moved']} bytes")
    assert result["prompt_token_ids"] == npu_plain["prompt_token_ids"]
    assert result["token_ids"] == npu_plain["token_ids"]


if __name__ == "__main__":
    main()


def test_npu_replans_are_recorded_as_expert_maps(npu_eplb, map_files):
    from ascend_eplb.expert_map import load_expert_map

    result, _ = npu_eplb
    summary = result["workers"][0]["eplb"]
    recorded = load_expert_map(map_files["record"])
    assert recorded.phy2log.tolist() == summary["phy2log"]
    assert recorded.metadata["rearrangement"] == summary["rearrangements"]


# --- two NPUs: tensor parallel 2 + expert parallel --------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe_top1() -> str:
    from ascend_plugin.tiny_models import ensure_model

    # Top-1: with top-2 over two ranks every batch would take all-gather (test_npu_moe_ep.py).
    return str(ensure_model("qwen3_moe", num_experts_per_tok=1))


@pytest.fixture(scope="module")
def ep2_plain(qwen3_moe_top1) -> dict:
    result, _ = run(qwen3_moe_top1, TWO_NPUS, **EP2)
    return result


@pytest.fixture(scope="module")
def ep2_eplb(qwen3_moe_top1) -> dict:
    eplb = {**DYNAMIC, "policy": "flashlb", "heat_collection_phase": "decode"}
    result, _ = run(qwen3_moe_top1, TWO_NPUS, **EP2,
                    additional_config={"eplb_config": eplb})
    return result


def test_two_npus_exchange_expert_weights_over_hccl(ep2_eplb):
    assert_on_npu(ep2_eplb, workers=2)
    first, second = (worker["eplb"] for worker in ep2_eplb["workers"])
    assert (first["rank"], second["rank"]) == (0, 1)
    assert first["num_ranks"] == second["num_ranks"] == 2
    assert first["slots_per_rank"] == (NUM_EXPERTS + REDUNDANT) // 2
    # Rank 0 planned, both serve the same placement.
    assert first["phy2log"] == second["phy2log"]
    for summary in (first, second):
        assert_rearranged_during_generation(summary, phase="decode")
        # Weights crossed between the ranks (batched p2p over the EP device group), both ways.
        assert summary["bytes_between_ranks"] > 0
        assert sum(entry["rows_sent"] for entry in summary["history"]) > 0
        assert sum(entry["rows_received"] for entry in summary["history"]) > 0
    print(f"\nEPLB on two NPUs: {first['rearrangements']} rearrangements, "
          f"{first['bytes_between_ranks']} bytes between the ranks")


def test_two_npus_route_tokens_to_the_rank_of_their_slot(ep2_eplb):
    batches = [worker["moe_comm_batches"] for worker in ep2_eplb["workers"]]
    assert batches[0] == batches[1]
    # Both paths served the slots: prefills all-to-all, decode steps all-gather.
    assert any(int(n) >= ALL2ALL_MIN_TOKENS for n in batches[0]["alltoall"])
    assert batches[0]["allgather"].get(str(len(PROMPTS)), 0) >= MAX_TOKENS // 2


def test_two_npus_with_eplb_keep_greedy_tokens(ep2_eplb, ep2_plain):
    assert_on_npu(ep2_plain, workers=2)
    assert all(worker["eplb"] is None for worker in ep2_plain["workers"])
    assert len({tuple(ids) for ids in ep2_plain["token_ids"]}) > 1
    assert ep2_eplb["prompt_token_ids"] == ep2_plain["prompt_token_ids"]
    assert ep2_eplb["token_ids"] == ep2_plain["token_ids"]
