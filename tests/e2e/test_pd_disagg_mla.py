"""Prefill/decode disaggregation of an MLA model (tiny DeepSeek-V3) on the npu target, on
the reference torch_npu: the Ascend MLA backend keeps two caches per layer (the latent
``kv_lora_rank`` part and the rope part, ``ascend_core.attention.npu_mla``), and both are
pulled, over TCP, from a prefill instance (1P1D; several prefill instances are
test_pd_disagg.py's 2P2D) behind the proxy. The reference is the prefill server
answering alone.
"""

from __future__ import annotations

import json
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from test_npu_target import NPU, TOP_LOGPROBS, assert_equal_up_to_near_ties

from ascend_plugin.pd_serving import running_pd
from ascend_plugin.serving import post_json

from pd_runs import ALL_PROMPTS, counters, kv_cache_usage, mixed_prompts, wait_for

# Weights wide enough that the model's next-token choices are clear (at the default 0.02 a
# random model is nearly uniform, and any cache, right or wrong, gives near-ties).
STD = 0.2


@pytest.fixture(scope="module")
def deepseek() -> str:
    from ascend_plugin.tiny_drafts import ensure_deepseek_mtp_model

    return str(ensure_deepseek_mtp_model(std=STD))


@pytest.fixture(scope="module")
def pd_mla(deepseek, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd_mla")
    tcp = {"protocol": "tcp"}
    with running_pd(deepseek, str(logs), extra_args=["--enforce-eager", "--dtype", "bfloat16",
                                                     "--gpu-memory-utilization", "0.2"],
                    prefill_extra=tcp, decode_extra=tcp, cpus=("0", "1"),
                    env=NPU) as deployment:
        yield deployment


def completion(url: str, model: str, prompt: str, **fields) -> tuple[list[int], list[dict]]:
    """Greedy token ids and, per position, the top logprobs by token id."""
    reply = post_json(url + "/v1/completions", {
        "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0.0,
        "logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True, **fields})
    logprobs = reply["choices"][0]["logprobs"]
    ids = [int(token.removeprefix("token_id:")) for token in logprobs["tokens"]]
    tops = [{token.removeprefix("token_id:"): value for token, value in top.items()}
            for top in logprobs["top_logprobs"]]
    return ids, tops


def as_run(replies) -> dict:
    return {"prompt_token_ids": None, "token_ids": [ids for ids, _ in replies],
            "logprobs": [tops for _, tops in replies]}


def assert_pd_answers_what_the_prefill_server_answers(pd, model, prompts, what,
                                                     differing: int) -> None:
    """Concurrent completions through the proxy equal the prefill server's own (colocated)
    answers, all pulled: the decode server computes each prompt's last token against the
    pulled cache, the colocated one within its prompt pass, so in bfloat16 they may part at
    a near-tie (checked), in at most ``differing`` prompts."""
    reference = [completion(pd.prefill, model, prompt) for prompt in prompts]
    before = counters(pd.decode)
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: completion(pd.proxy, model, p), prompts))
    assert_equal_up_to_near_ties(as_run(answers), as_run(reference), what)
    assert sum(a[0] != r[0] for a, r in zip(answers, reference)) <= differing
    after = counters(pd.decode)
    assert after["vllm:ascend_pd_pulls"] - before["vllm:ascend_pd_pulls"] == len(prompts)
    assert after["vllm:ascend_pd_failed_pulls"] == before["vllm:ascend_pd_failed_pulls"]


def kv_planes(pd) -> int:
    """The KV planes the prefill node registered with the transfer engine (its log)."""
    log = open(pd.prefill_log).read()
    return int(re.search(r"MooncakeConnectorV1 \(kv_producer, rank 0\): (\d+) KV planes",
                         log).group(1))


def num_layers(model: str) -> int:
    return json.load(open(f"{model}/config.json"))["num_hidden_layers"]


def test_mla_latent_and_rope_caches_are_pulled_and_answers_equal_the_colocated_ones(
        pd_mla, deepseek):
    assert_pd_answers_what_the_prefill_server_answers(pd_mla, deepseek, ALL_PROMPTS,
                                                      "MLA PD vs colocated", differing=2)
    # The prefill instance took every request, and afterwards holds no block.
    with urllib.request.urlopen(pd_mla.proxy + "/health", timeout=10) as reply:
        served = [b["served"] for b in json.loads(reply.read())["prefill"]]
    assert served == [len(ALL_PROMPTS)], served
    wait_for(lambda: kv_cache_usage(pd_mla.prefill) == 0.0, 10,
             "the prefill server freed its blocks")
    assert kv_planes(pd_mla) == 2 * num_layers(deepseek)  # every layer's latent and rope


def test_a_lease_on_another_prompt_is_refused_and_the_prompt_recomputed(pd_mla, deepseek):
    """Prompt 0 sent with prompt 1's kv_transfer_params (a lease the prefill node does
    hold): the prefill node refuses the claim, since its blocks hold another prompt, so the
    decode node recomputes prompt 0 instead of answering from prompt 1's cache; the lease
    is untouched and prompt 1 still pulls it."""
    reference = completion(pd_mla.prefill, deepseek, ALL_PROMPTS[0])
    params = post_json(pd_mla.prefill + "/v1/completions", {
        "model": deepseek, "prompt": ALL_PROMPTS[1], "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]
    mark = len(open(pd_mla.decode_log).read())
    before = counters(pd_mla.decode)
    answer = completion(pd_mla.decode, deepseek, ALL_PROMPTS[0], kv_transfer_params=params)
    assert_equal_up_to_near_ties(as_run([answer]), as_run([reference]), "recomputed")
    assert "hold the KV of another prompt than the claim's" in open(pd_mla.decode_log).read()[
        mark:]
    after = counters(pd_mla.decode)
    assert after["vllm:ascend_pd_failed_pulls"] == before["vllm:ascend_pd_failed_pulls"] + 1
    completion(pd_mla.decode, deepseek, ALL_PROMPTS[1], kv_transfer_params=params)
    assert counters(pd_mla.decode)["vllm:ascend_pd_pulls"] == after["vllm:ascend_pd_pulls"] + 1
    wait_for(lambda: kv_cache_usage(pd_mla.prefill) == 0.0, 10, "the prefill node freed it")


@pytest.fixture(scope="module")
def pd_mla_host(deepseek, tmp_path_factory):
    """The same model through vLLM's own CPU MLA backend (host target), two prefill
    instances and one decode instance (2P1D): one cache tensor per layer, latent and rope
    side by side in each token's row."""
    logs = tmp_path_factory.mktemp("pd_mla_host")
    with running_pd(deepseek, str(logs), num_prefill=2,
                    extra_args=["--enforce-eager", "--dtype", "bfloat16"],
                    cpus=("0", "1"), env={"VLLM_ASCEND_TARGET": "host"}) as deployment:
        yield deployment


def test_host_target_mla_2p1d_32_concurrent_requests_answer_what_a_colocated_server_does(
        pd_mla_host, deepseek):
    # Short, held-out ~100-token, and 3+ block prompts sharing a prefix.
    assert_pd_answers_what_the_prefill_server_answers(
        pd_mla_host, deepseek, mixed_prompts(), "host MLA 2P1D vs colocated", differing=4)
    with urllib.request.urlopen(pd_mla_host.proxy + "/health", timeout=10) as reply:
        served = [b["served"] for b in json.loads(reply.read())["prefill"]]
    assert len(served) == 2 and min(served) > 0 and sum(served) == 32, served
    for prefill in pd_mla_host.prefills:
        wait_for(lambda url=prefill.url: kv_cache_usage(url) == 0.0, 10,
                 f"{prefill.name} freed its blocks")
    assert kv_planes(pd_mla_host) == num_layers(deepseek)  # one cache tensor per layer
