"""Data parallel with expert parallelism on the npu target: ``vllm serve --data-parallel-size 2
--enable-expert-parallel`` on two reference NPUs (one engine per NPU, vLLM's DP coordinator in
front; the experts split over the DP x TP expert group of both engines, tokens dispatched and
combined between them per batch, idle ranks running vLLM's dummy batches to keep the
collectives in step).

Eight concurrent greedy completions answer what one engine on one NPU (DP 1) answers: token
for token, or, where the expert sums of another batch composition round a near-tie in
bfloat16 the other way, up to a near-tie under 0.05 nat, checked in both answers' top-5
logprobs at the first token where they part (the continuations after it are not compared).
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_npu_target import NPU

from ascend_plugin.serving import post_json, running_server

from vllm_runs import PROMPTS

NEAR_TIE = 0.05
MAX_TOKENS = 12
SERVE = ["--dtype", "bfloat16", "--gpu-memory-utilization", "0.2", "--max-num-seqs", "8"]
EAGER = ["--enforce-eager"]
FULL_DECODE = ["--compilation-config", json.dumps({"cudagraph_mode": "FULL_DECODE_ONLY"})]
DP2 = ["--data-parallel-size", "2", "--enable-expert-parallel", "--api-server-count", "1"]
TWO_NPUS = {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2"}


def answers(model: str, args: list[str], log) -> tuple[list[dict], str]:
    """The eight completions (tokens and top-5 logprobs per position) and the server log."""
    def one(url: str, prompt: str) -> dict:
        reply = post_json(url + "/v1/completions",
                          {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                           "temperature": 0.0, "logprobs": 5})
        return reply["choices"][0]["logprobs"]

    with running_server(model, extra_args=[*SERVE, *args], env=TWO_NPUS, log_path=str(log),
                        timeout=600) as url, ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda p: one(url, p), PROMPTS))
    return replies, log.read_text()


def assert_same_up_to_near_ties(ours: list[dict], reference: list[dict]) -> int:
    """Each answer equal, or parting at a near-tie seen from both sides; returns how many
    parted."""
    parted = 0
    for index, (a, b) in enumerate(zip(ours, reference, strict=True)):
        for position, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=True)):
            if x == y:
                continue
            for mine, theirs in ((a, x), (b, y)):
                top = mine["top_logprobs"][position]
                other = y if theirs == x else x
                assert other in top, (index, position, x, y, top)
                gap = top[theirs] - top[other]
                assert 0 <= gap < NEAR_TIE, (index, position, x, y, gap)
            parted += 1
            break
    return parted


def assert_two_dp_ranks_share_the_experts(log: str, graphs: bool) -> None:
    for rank in (0, 1):
        assert re.search(rf"DP rank {rank}, .*EP rank {rank}", log), f"no DP/EP rank {rank}"
        captured = rf"Worker_DP{rank}_EP{rank} .*capturing FULL_DECODE_ONLY graphs"
        assert bool(re.search(captured, log)) == graphs, f"DP rank {rank}: graphs {graphs}"


@pytest.fixture(scope="module")
def qwen3_moe() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("qwen3_moe", num_experts_per_tok=1))


@pytest.fixture(scope="module")
def deepseek() -> str:
    from ascend_plugin.tiny_drafts import ensure_deepseek_mtp_model

    return str(ensure_deepseek_mtp_model(std=0.005, carry_embedding=True))  # test_npu_mla's


def test_qwen3_moe_dp2_ep_under_full_decode_graphs_answers_what_dp1_does(qwen3_moe, tmp_path):
    """Decode steps replay FULL graphs, prefill steps run eagerly (idle ranks' dummy batches
    take whichever path their step takes), so both modes are crossed in one server."""
    reference, _ = answers(qwen3_moe, EAGER, tmp_path / "dp1.log")
    ours, log = answers(qwen3_moe, [*FULL_DECODE, *DP2], tmp_path / "dp2.log")
    assert_two_dp_ranks_share_the_experts(log, graphs=True)
    parted = assert_same_up_to_near_ties(ours, reference)
    assert parted <= 2, f"{parted} of {len(PROMPTS)} answers parted at near-ties"


def test_deepseek_v3_dp2_ep_under_full_decode_graphs_answers_what_dp1_does(deepseek,
                                                                           tmp_path):
    reference, _ = answers(deepseek, EAGER, tmp_path / "dp1.log")
    ours, log = answers(deepseek, [*FULL_DECODE, *DP2], tmp_path / "dp2.log")
    assert_two_dp_ranks_share_the_experts(log, graphs=True)
    parted = assert_same_up_to_near_ties(ours, reference)
    assert parted <= 2, f"{parted} of {len(PROMPTS)} answers parted at near-ties"
