"""Prefill/decode disaggregation across tensor-parallel sizes on the host target: a
prefill server at TP 2 (each rank holds one of the model's two KV heads) and a decode
server at TP 1, behind the proxy. Each decode block is assembled from both prefill ranks.

The reference is the decode server answering alone; its prefix cache is off, so neither
its own answers nor the pulled blocks feed one another.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ascend_plugin.pd_serving import running_pd

from pd_runs import ALL_PROMPTS, MODEL, completion, counters, kv_cache_usage, text, wait_for
from vllm_runs import PROMPTS


@pytest.fixture(scope="module")
def pd_tp(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_tp")
    # The two prefill workers bind one CPU each; the decode server shares the second.
    with running_pd(MODEL, str(logs), extra_args=["--dtype", "float32", "--enforce-eager"],
                    prefill_tp=2, prefill_env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                    decode_args=["--no-enable-prefix-caching"], cpus=(None, "1"),
                    env={"VLLM_ASCEND_TARGET": "host"}) as deployment:
        yield deployment


def test_prefill_tp_2_to_decode_tp_1_answers_what_the_decode_server_answers_alone(pd_tp):
    reference = [text(completion(pd_tp.decode, prompt)) for prompt in ALL_PROMPTS]
    before = counters(pd_tp.decode)
    with ThreadPoolExecutor(len(ALL_PROMPTS)) as pool:
        answers = list(pool.map(lambda p: text(completion(pd_tp.proxy, p)), ALL_PROMPTS))
    assert answers == reference
    after = counters(pd_tp.decode)
    assert after["vllm:ascend_pd_pulls"] - before["vllm:ascend_pd_pulls"] == len(ALL_PROMPTS)
    assert after["vllm:ascend_pd_failed_pulls"] == before["vllm:ascend_pd_failed_pulls"]
    pulled = after["vllm:ascend_pd_pulled_bytes"] - before["vllm:ascend_pd_pulled_bytes"]
    # The decode blocks are whole (two heads); each prefill rank sent half of each.
    assert pulled == (len(PROMPTS) + 3) * 8 * 2 * 2 * 128 * 64 * 4
    wait_for(lambda: kv_cache_usage(pd_tp.prefill) == 0.0, 10,
             "the prefill ranks freed their blocks")
