"""EPLB on the host target inside real vLLM: a tiny Qwen3-MoE is rearranged several
times during one generation, with redundant experts, on one rank and on two
expert-parallel ranks, and its greedy tokens equal the plugin's without EPLB.

Each configuration runs this file as a script in its own process (vLLM resolves its
platform once per process) and reports tokens and the workers' EPLB counters.
"""

from __future__ import annotations

import json
import sys

import pytest

from vllm_runs import PROMPTS, run_script

HOST = {"VLLM_ASCEND_TARGET": "host"}
MAX_TOKENS = 32
NUM_EXPERTS = 8
REDUNDANT = 2
# Replan every 4 steps: a 32-token generation sees about 7 rearrangements.
DYNAMIC = {"dynamic_eplb": True, "num_redundant_experts": REDUNDANT,
           "expert_heat_collection_interval": 4}


def probe_worker(worker) -> dict | None:
    """Runs in each worker: the EPLB counters of the served model."""
    from ascend_eplb.vllm.routed_experts import eplb_summary

    worker = getattr(worker, "worker", worker)
    return eplb_summary(worker.model_runner.get_model())


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm_kwargs = dict(dtype="float32", max_model_len=512, enforce_eager=True,
                      gpu_memory_utilization=0.05, seed=0)
    llm_kwargs.update(args.get("llm", {}))
    llm = LLM(model=args["model"], **llm_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    result = {
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "eplb": llm.collective_rpc(probe_worker),
    }
    print("RESULT " + json.dumps(result), flush=True)


def run(model: str, llm: dict, env: dict | None = None) -> tuple[dict, str]:
    return run_script(__file__, {"model": model, "llm": llm}, {**HOST, **(env or {})})


@pytest.fixture(scope="module")
def moe_dir() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("qwen3_moe"))


@pytest.fixture(scope="module")
def without_eplb(moe_dir) -> dict:
    result, _ = run(moe_dir, {})
    return result


@pytest.fixture(scope="module")
def map_files(tmp_path_factory) -> dict:
    """A start map unlike the default placement, and where to record replans."""
    from ascend_eplb.expert_map import save_expert_map

    folder = tmp_path_factory.mktemp("eplb_maps")
    start = [[7, 6, 5, 4, 3, 2, 1, 0, 7, 7], [0, 1, 2, 3, 4, 5, 6, 7, 3, 3]]
    save_expert_map(folder / "start.json", start, 1, num_experts=NUM_EXPERTS)
    return {"start": str(folder / "start.json"), "record": str(folder / "record.json"),
            "start_phy2log": start}


@pytest.fixture(scope="module")
def one_rank(moe_dir, map_files) -> tuple[dict, str]:
    eplb = {**DYNAMIC, "algorithm_execution_interval": 1, "policy": "default",
            "expert_map_path": map_files["start"],
            "expert_map_record_path": map_files["record"]}
    return run(moe_dir, {"additional_config": {"eplb_config": eplb}})


@pytest.fixture(scope="module")
def two_ranks(moe_dir) -> tuple[dict, str]:
    eplb = {**DYNAMIC, "algorithm_execution_interval": 2, "policy": "flashlb",
            "heat_collection_phase": "decode"}
    return run(moe_dir, {"tensor_parallel_size": 2, "enable_expert_parallel": True,
                         "additional_config": {"eplb_config": eplb}},
               {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def assert_rearranged_during_generation(summary: dict) -> None:
    history = summary["history"]
    assert summary["rearrangements"] >= 5 and summary["failed_replans"] == 0
    assert all(entry["ok"] for entry in history)
    # Rearrangements happened between steps of the generation, not only at its end.
    assert 0 < history[0]["step"] < history[-1]["step"] < summary["steps"]
    assert summary["experts_moved"] > 0
    assert summary["bytes_moved"] == sum(entry["bytes"] for entry in history) > 0
    # Redundant experts are served: every slot holds an expert, some twice.
    for row in summary["phy2log"]:
        assert sorted(set(row)) == list(range(NUM_EXPERTS))
        assert len(row) == NUM_EXPERTS + REDUNDANT


def test_baseline_is_prompt_dependent(without_eplb):
    (worker,) = without_eplb["eplb"]
    assert worker is None  # no EPLB configured: vLLM's MoE path
    assert len({tuple(ids) for ids in without_eplb["token_ids"]}) > 1


def test_one_rank_rearranges_and_keeps_greedy_tokens(one_rank, without_eplb, map_files):
    result, log = one_rank
    (summary,) = result["eplb"]
    assert summary["num_ranks"] == 1 and summary["slots_per_rank"] == NUM_EXPERTS + REDUNDANT
    assert summary["initial_phy2log"] == map_files["start_phy2log"]
    assert_rearranged_during_generation(summary)
    assert summary["bytes_between_ranks"] == 0
    assert result["token_ids"] == without_eplb["token_ids"]
    assert "EPLB rearrangement 3 at step" in log and "bytes moved" in log


def test_replans_are_recorded_as_expert_maps(one_rank, map_files):
    from ascend_eplb.expert_map import load_expert_map

    result, _ = one_rank
    (summary,) = result["eplb"]
    recorded = load_expert_map(map_files["record"])
    assert recorded.phy2log.tolist() == summary["phy2log"]
    assert recorded.metadata["rearrangement"] == summary["rearrangements"]


def test_two_expert_parallel_ranks_exchange_weights(two_ranks, without_eplb):
    result, log = two_ranks
    first, second = result["eplb"]
    assert (first["rank"], second["rank"]) == (0, 1)
    assert first["phy2log"] == second["phy2log"]
    assert first["slots_per_rank"] == (NUM_EXPERTS + REDUNDANT) // 2
    for summary in (first, second):
        assert_rearranged_during_generation(summary)
    # Weights crossed between the ranks (point-to-point over gloo), both ways.
    assert first["bytes_between_ranks"] > 0
    for summary in (first, second):
        assert sum(e["rows_sent"] for e in summary["history"]) > 0
        assert sum(e["rows_received"] for e in summary["history"]) > 0
    assert result["token_ids"] == without_eplb["token_ids"]
    assert "between ranks" in log


def test_heat_collection_phases(one_rank, two_ranks):
    (all_phases,) = one_rank[0]["eplb"]
    assert all_phases["recorded_steps"] == all_phases["steps"]
    for decode_only in two_ranks[0]["eplb"]:
        # The prefill step (all 8 prompts in one step) is not recorded.
        assert decode_only["recorded_steps"] == decode_only["steps"] - 1
        # The window holds the last 4 decode steps: 8 requests, one token each, top-2.
        assert [sum(row) for row in decode_only["window_load"]] == [4 * len(PROMPTS) * 2] * 2


if __name__ == "__main__":
    main()
