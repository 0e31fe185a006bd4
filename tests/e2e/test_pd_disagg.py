"""Prefill/decode disaggregation on the host target: two real OpenAI servers (one
kv_producer pinned to CPU 0, one kv_consumer pinned to CPU 1) with MooncakeConnectorV1
over TCP on 127.0.0.1, behind ``python -m ascend_plugin.pd_proxy``.

The reference is the prefill server itself answering without kv_transfer_params (a
colocated server: same model, same dtype). Prompts stay under one 128-token block except
one, so no answer comes from a local prefix-cache hit instead of a pull.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from ascend_plugin.pd_serving import running_pd
from ascend_plugin.serving import counter_totals, free_port, post_json, server_command

from pd_runs import (
    ALL_PROMPTS,
    LONG_PROMPT,
    MAX_TOKENS,
    MODEL,
    completion,
    counters,
    kv_cache_usage,
    text,
    wait_for,
)
from vllm_runs import PROMPTS, vllm_environment

LEASE_TIMEOUT_S = 15
SIDE_CHANNEL_TIMEOUT_S = 3


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    with running_pd(MODEL, str(logs), extra_args=["--dtype", "float32", "--enforce-eager"],
                    prefill_extra={"lease_timeout_s": LEASE_TIMEOUT_S},
                    decode_extra={"side_channel_timeout_s": SIDE_CHANNEL_TIMEOUT_S},
                    cpus=("0", "1"), env={"VLLM_ASCEND_TARGET": "host"}) as deployment:
        yield deployment


@pytest.fixture(scope="module")
def reference(pd) -> dict[str, str]:
    """The colocated answers: the prefill server serving normally."""
    return {prompt: text(completion(pd.prefill, prompt)) for prompt in ALL_PROMPTS}


def prefilled(pd, prompt: str) -> dict:
    """The kv_transfer_params of a one-token prefill on the prefill server."""
    reply = completion(pd.prefill, prompt, max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})
    params = reply["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    return params


def test_concurrent_requests_through_the_proxy_answer_what_a_colocated_server_answers(
        pd, reference):
    before = counters(pd.decode)
    with ThreadPoolExecutor(len(ALL_PROMPTS)) as pool:
        answers = list(pool.map(lambda p: text(completion(pd.proxy, p)), ALL_PROMPTS))
    assert answers == [reference[p] for p in ALL_PROMPTS]
    after = counters(pd.decode)
    # Every prompt's KV was pulled, none recomputed; the long prompt's three blocks too.
    assert after["vllm:ascend_pd_pulls"] - before["vllm:ascend_pd_pulls"] == len(ALL_PROMPTS)
    assert after["vllm:ascend_pd_failed_pulls"] == before["vllm:ascend_pd_failed_pulls"]
    pulled = after["vllm:ascend_pd_pulled_bytes"] - before["vllm:ascend_pd_pulled_bytes"]
    block_bytes = 8 * 2 * 2 * 128 * 64 * 4  # layers x K/V x kv heads x tokens x head x fp32
    assert pulled == (len(PROMPTS) + 3) * block_bytes
    # Afterwards the prefill node holds no blocks.
    wait_for(lambda: kv_cache_usage(pd.prefill) == 0.0, 10, "the prefill node freed its blocks")


def test_a_streamed_chat_through_the_proxy_equals_the_colocated_answer(pd):
    message = [{"role": "user", "content": "Write a function that adds two numbers."}]
    expected = post_json(pd.prefill + "/v1/chat/completions",
                         {"model": MODEL, "messages": message, "max_tokens": MAX_TOKENS,
                          "temperature": 0.0})["choices"][0]["message"]["content"]
    request = urllib.request.Request(
        pd.proxy + "/v1/chat/completions",
        data=json.dumps({"model": MODEL, "messages": message, "max_tokens": MAX_TOKENS,
                         "temperature": 0.0, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["content-type"].startswith("text/event-stream")
        for line in reply.read().decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                pieces.append(delta.get("content") or "")
    assert len(pieces) > 2 and "".join(pieces) == expected


def test_the_proxy_reports_health_and_metrics(pd):
    text(completion(pd.proxy, PROMPTS[0], max_tokens=2))
    with urllib.request.urlopen(pd.proxy + "/health", timeout=10) as reply:
        health = json.loads(reply.read())
    assert [b["healthy"] for b in health["prefill"] + health["decode"]] == [True, True]
    totals = counter_totals(pd.proxy, ["pd_proxy_requests", "pd_proxy_backend_requests"])
    assert totals["pd_proxy_requests"] >= 1
    assert totals["pd_proxy_backend_requests"] == 2 * totals["pd_proxy_requests"]


def decode_log_since(pd, start: int) -> str:
    return pathlib.Path(pd.decode_log).read_text()[start:]


def test_forged_kv_transfer_params_are_refused_and_the_prompt_recomputed(pd, reference):
    prompt = PROMPTS[1]
    params = prefilled(pd, prompt)
    mark = len(pathlib.Path(pd.decode_log).read_text())
    before = counters(pd.decode)
    forged = [
        ({**params, "remote_engine_id": "prefill-9"},
         "remote_engine_id 'prefill-9' is not the engine at 127.0.0.1:"),
        ({**params, "remote_block_ids": [99999]}, "holds block id 99999, outside the cache's"),
        ({**params, "remote_block_ids": [0, 1]}, "remote_block_ids has 2 blocks, but this"),
    ]
    for forgery, _ in forged:
        assert text(completion(pd.decode, prompt, kv_transfer_params=forgery)) == \
            reference[prompt]
    log = decode_log_since(pd, mark)
    for _, message in forged:
        assert message in log, log[-3000:]
    after = counters(pd.decode)
    # Two reached the prefill node and were refused there (load errors, recomputed); the
    # third never left the scheduler (computed here from the start).
    assert after["vllm:ascend_pd_failed_pulls"] - before["vllm:ascend_pd_failed_pulls"] == 2
    # The real parameters still pull: the forgeries did not free or spoil the blocks.
    assert text(completion(pd.decode, prompt, kv_transfer_params=params)) == reference[prompt]
    assert counters(pd.decode)["vllm:ascend_pd_pulls"] == after["vllm:ascend_pd_pulls"] + 1


def test_a_dead_prefill_node_costs_a_recompute_not_a_hang(pd, reference):
    prompt = PROMPTS[2]
    # Nothing listens there: no side channel, no engine.
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0",
              "remote_request_id": "cmpl-gone", "remote_host": "127.0.0.1",
              "remote_port": free_port(), "remote_block_ids": [0], "remote_tp_size": 1}
    mark = len(pathlib.Path(pd.decode_log).read_text())
    started = time.monotonic()
    assert text(completion(pd.decode, prompt, kv_transfer_params=params)) == reference[prompt]
    assert time.monotonic() - started < SIDE_CHANNEL_TIMEOUT_S + 20
    assert "no answer from the prefill node's side channel" in decode_log_since(pd, mark)


def test_an_unpulled_lease_expires_frees_its_blocks_and_a_late_pull_is_recomputed(
        pd, reference):
    prompt = LONG_PROMPT
    before = counters(pd.prefill)["vllm:ascend_pd_expired_leases"]
    params = prefilled(pd, prompt)
    assert len(params["remote_block_ids"]) == 3
    assert kv_cache_usage(pd.prefill) > 0  # held for a decode node that never comes
    wait_for(lambda: counters(pd.prefill)["vllm:ascend_pd_expired_leases"] > before,
             LEASE_TIMEOUT_S + 30, "the lease expired")
    wait_for(lambda: kv_cache_usage(pd.prefill) == 0.0, 10, "the expired blocks were freed")
    assert "no decode node pulled within lease_timeout_s=15" in \
        pathlib.Path(pd.prefill_log).read_text()
    mark = len(pathlib.Path(pd.decode_log).read_text())
    assert text(completion(pd.decode, prompt, kv_transfer_params=params)) == reference[prompt]
    assert "their lease expired after 15 s" in decode_log_since(pd, mark)


def test_an_unknown_kv_role_stops_the_server_with_what_is_allowed():
    config = json.dumps({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_prodcer"})
    proc = subprocess.run(
        server_command(MODEL, free_port(), ["--kv-transfer-config", config]),
        env=vllm_environment({"VLLM_ASCEND_TARGET": "host"}), capture_output=True, text=True,
        timeout=300)
    # vLLM's own config check refuses it before any engine (or connector) starts.
    assert proc.returncode == 2
    output = proc.stdout + proc.stderr
    assert "argument --kv-transfer-config: 1 validation error for KVTransferConfig" in output
    assert ("Input should be 'kv_producer', 'kv_both' or 'kv_consumer' [type=literal_error, "
            "input_value='kv_prodcer'") in output


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
