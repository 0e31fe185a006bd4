"""Sleep mode on the npu target end to end: LLM(enable_sleep_mode=True) on the reference
torch_npu, with FULL decode graphs, put to sleep at level 1 and at level 2 between greedy
generations (run_npu_sleep.py, one engine in its own process).

What is checked, from the worker's own numbers (``NPUWorker.npu_memory_report`` through
``collective_rpc``): each sleep gives back at least the weights' and the KV cache's bytes
(``torch.npu.memory_allocated`` and ``mem_get_info``), level 1 keeps exactly the weights on
the host and level 2 nothing; wake-up (after ``reload_weights`` at level 2) brings every
byte back and the greedy tokens equal those before sleeping; the captured graphs are dropped
at sleep and captured again at wake-up (the reference refuses to replay a graph over memory
released since capture), and decode steps replay them afterwards; the engine shuts down
without a traceback (torch.accelerator.empty_cache on the npu allocator).
"""

from __future__ import annotations

import pytest
from test_npu_target import LLM, NPU

from vllm_runs import HERE, PROMPTS, run_script

GRAPHS = {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}, "enforce_eager": False,
          "max_num_seqs": 8}


@pytest.fixture(scope="module")
def sleep_run() -> dict:
    from ascend_plugin.tiny_models import ensure_model

    args = {"model": str(ensure_model("llama")), "prompts": PROMPTS, "max_tokens": 16,
            "llm": {**LLM, **GRAPHS}}
    result, output = run_script(HERE / "run_npu_sleep.py", args, NPU)
    return {**result, "output": output}


def _tagged(stage: dict) -> tuple[int, int]:
    return stage["weights_resident_bytes"], stage["kv_cache_resident_bytes"]


def test_greedy_tokens_after_waking_equal_those_before_sleeping(sleep_run):
    tokens = sleep_run["tokens"]
    assert len(tokens["before"]) == len(PROMPTS)
    assert all(len(ids) == 16 for ids in tokens["before"])
    assert len({tuple(ids) for ids in tokens["before"]}) == len(PROMPTS)
    assert tokens["after_level1"] == tokens["before"]
    assert tokens["after_level2"] == tokens["before"]  # weights reloaded from the checkpoint


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_gives_back_the_weights_and_the_kv_cache(sleep_run, level):
    memory = sleep_run["memory"]
    awake = memory["awake"] if level == 1 else memory["after_level1"]
    asleep = memory[f"level{level}_asleep"]
    weights, kv_cache = _tagged(awake)
    assert weights > 1_000_000 and kv_cache > 100_000_000  # the tiny Llama, 20% of 1 GiB
    released = weights + kv_cache
    assert awake["memory_allocated"] - asleep["memory_allocated"] >= released
    assert asleep["free_memory"] - awake["free_memory"] >= released
    assert asleep["weights_asleep_bytes"] == weights
    assert asleep["kv_cache_asleep_bytes"] == kv_cache
    assert _tagged(asleep) == (0, 0)
    # Level 1 keeps the weights on the host, level 2 nothing.
    assert asleep["host_copy_bytes"] == (weights if level == 1 else 0)
    print(f"\nlevel {level}: released {awake['memory_allocated'] - asleep['memory_allocated']} "
          f"bytes (weights {weights}, KV cache {kv_cache}); free "
          f"{awake['free_memory']} -> {asleep['free_memory']}")


def test_wake_up_brings_every_byte_back(sleep_run):
    memory = sleep_run["memory"]
    for woken in ("level1_woken", "level2_woken"):
        assert _tagged(memory[woken]) == _tagged(memory["awake"])
        assert memory[woken]["host_copy_bytes"] == 0
        # Every tagged byte is back (above, exactly) on top of what stayed while asleep.
        # Untagged runtime allocations (sampler and graph scratch, reload_weights) come and go
        # between the stages, so the totals are not compared for equality.
        assert memory[woken]["memory_allocated"] >= (
            memory["level1_asleep"]["memory_allocated"] + sum(_tagged(memory["awake"])))
    # Partway through a level-2 wake-up: weights back (and reloaded), the KV cache not.
    partial = memory["level2_weights_reloaded"]
    assert _tagged(partial) == (memory["awake"]["weights_resident_bytes"], 0)


def test_graphs_are_captured_again_at_wake_up_and_replayed(sleep_run):
    memory = sleep_run["memory"]
    captured = memory["start"]["captured_graphs"]
    assert captured >= 1
    for stage in ("level1_asleep", "level2_asleep", "level2_weights_reloaded"):
        assert memory[stage]["captured_graphs"] == 0, stage
    for stage in ("level1_woken", "level2_woken"):
        assert memory[stage]["captured_graphs"] == captured, stage
    # Each generation's decode steps replayed graphs (15 decode steps per generation).
    assert memory["awake"]["graph_replays"] - memory["start"]["graph_replays"] >= 15
    assert memory["after_level1"]["graph_replays"] - memory["level1_woken"]["graph_replays"] >= 15
    assert memory["after_level2"]["graph_replays"] - memory["level2_woken"]["graph_replays"] >= 15


def test_the_engine_shuts_down_cleanly(sleep_run):
    # run_script checked the exit status
    assert "Traceback" not in sleep_run["output"]
    assert "is not a DeviceAllocator" not in sleep_run["output"]
    assert sleep_run["output"].count("Sleep mode freed") == 2  # vLLM's own log of each sleep
