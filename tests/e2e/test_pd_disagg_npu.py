"""Prefill/decode disaggregation on the npu target, on the reference torch_npu: two real
OpenAI servers on the npu platform (NPUWorker, NPUModelRunner, ASCEND_ATTN, KV caches on
the reference's npu device), MooncakeConnectorV1 over TCP (the Mooncake build for NPUs and
its ``ascend`` protocol need real NPUs), behind the proxy.

The reference is the prefill server answering each prompt alone: the same backend on the same
device. The decode server batches the requests, and bfloat16 sums formed for another batch may
round a near-tie the other way (seen on a CPU with AMX), so answers are compared up to
near-ties, and most must be equal whole.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from test_npu_target import NEAR_TIE, NPU, TOP_LOGPROBS, first_difference

from ascend_plugin.pd_serving import running_pd

from pd_runs import ALL_PROMPTS, MODEL, completion, counters, kv_cache_usage, text, wait_for
from vllm_runs import PROMPTS


def assert_replies_equal_up_to_near_ties(answers: list[dict], references: list[dict]) -> None:
    """Completions asked with ``logprobs``: the tokens equal, or equal up to a position where
    both replies rank both tokens among their top logprobs within NEAR_TIE of each other
    (bfloat16 sums formed in another batch round a near-tie either way); nothing after it is
    compared, the contexts differ from there."""
    for prompt, (ours, theirs) in enumerate(zip(answers, references, strict=True)):
        a, b = ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"]
        n = first_difference(a["tokens"], b["tokens"])
        if n is None:
            continue
        pair = (a["tokens"][n], b["tokens"][n])
        for top in (a["top_logprobs"][n], b["top_logprobs"][n]):
            assert all(t in top for t in pair), (
                f"prompt {prompt}: tokens {pair} differ at position {n} and are not "
                f"both in the top logprobs there: {top}")
            gap = abs(top[pair[0]] - top[pair[1]])
            assert gap <= NEAR_TIE, (f"prompt {prompt}: tokens {pair} at position {n} are "
                                     f"{gap:.3f} nat apart, not a near-tie (<= {NEAR_TIE})")


@pytest.fixture(scope="module")
def pd_npu(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_npu")
    tcp = {"protocol": "tcp"}
    with running_pd(MODEL, str(logs), extra_args=["--enforce-eager",
                                                  "--gpu-memory-utilization", "0.2"],
                    prefill_extra=tcp, decode_extra=tcp, cpus=("0", "1"),
                    env=NPU) as deployment:
        yield deployment


def test_npu_target_pd_answers_what_the_prefill_server_answers_alone(pd_npu):
    reference = [completion(pd_npu.prefill, prompt, logprobs=TOP_LOGPROBS)
                 for prompt in ALL_PROMPTS]
    before = counters(pd_npu.decode)
    with ThreadPoolExecutor(len(ALL_PROMPTS)) as pool:
        answers = list(pool.map(lambda p: completion(pd_npu.proxy, p, logprobs=TOP_LOGPROBS),
                                ALL_PROMPTS))
    # The decode server batches the nine requests; the reference ran them one at a time.
    assert_replies_equal_up_to_near_ties(answers, reference)
    assert sum(text(a) == text(r) for a, r in zip(answers, reference)) >= len(ALL_PROMPTS) // 2
    after = counters(pd_npu.decode)
    assert after["vllm:ascend_pd_pulls"] - before["vllm:ascend_pd_pulls"] == len(ALL_PROMPTS)
    assert after["vllm:ascend_pd_failed_pulls"] == before["vllm:ascend_pd_failed_pulls"]
    pulled = after["vllm:ascend_pd_pulled_bytes"] - before["vllm:ascend_pd_pulled_bytes"]
    # bfloat16 K and V planes per layer: 8 layers x 2 x 128 tokens x 2 kv heads x 64 x 2 B.
    assert pulled == (len(PROMPTS) + 3) * 8 * 2 * 128 * 2 * 64 * 2
    wait_for(lambda: kv_cache_usage(pd_npu.prefill) == 0.0, 10,
             "the prefill server freed its blocks")
    log = open(pd_npu.prefill_log).read()
    assert "Ascend plugin active: npu target (AscendPlatform)" in log
    assert "MooncakeConnectorV1 (kv_producer, rank 0): 16 KV planes" in log
