"""Prefill/decode disaggregation on the host target: four real OpenAI servers, two
kv_producers and two kv_consumers (2P2D; one of each kind pinned to CPU 0, the other to
CPU 1) with MooncakeConnectorV1 over TCP on 127.0.0.1, behind ``python -m
ascend_plugin.pd_proxy``.

The reference is the first prefill server answering without kv_transfer_params (a
colocated server: same model, same dtype). The faults come last: one prefill and then
one decode instance is killed under load.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from ascend_plugin.pd_serving import running_pd
from ascend_plugin.serving import (
    counter_totals,
    free_port,
    kill_server,
    post_json,
    server_command,
)

from pd_runs import (
    LONG_PROMPT,
    MAX_TOKENS,
    MODEL,
    completion,
    counters,
    kv_cache_usage,
    mixed_prompts,
    text,
    wait_for,
)
from vllm_runs import PROMPTS, vllm_environment

LEASE_TIMEOUT_S = 15
SIDE_CHANNEL_TIMEOUT_S = 3
BLOCK_TOKENS = 128
BLOCK_BYTES = 8 * 2 * 2 * BLOCK_TOKENS * 64 * 4  # layers x K/V x kv heads x tokens x head x fp32


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd")
    with running_pd(MODEL, str(logs), num_prefill=2, num_decode=2,
                    extra_args=["--dtype", "float32", "--enforce-eager"],
                    prefill_extra={"lease_timeout_s": LEASE_TIMEOUT_S},
                    decode_extra={"side_channel_timeout_s": SIDE_CHANNEL_TIMEOUT_S},
                    cpus=("0", "1"), env={"VLLM_ASCEND_TARGET": "host"}) as deployment:
        yield deployment


PROMPTS_32 = mixed_prompts()


def concurrently(function, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(function, items))


@pytest.fixture(scope="module")
def reference(pd) -> dict[str, str]:
    """The colocated answers: the first prefill server serving normally, as concurrently."""
    answers = concurrently(lambda p: text(completion(pd.prefill, p)), PROMPTS_32)
    return dict(zip(PROMPTS_32, answers, strict=True))


def through_proxy(pd, prompts) -> list[str]:
    return concurrently(lambda p: text(completion(pd.proxy, p)), prompts)


def prompt_tokens(pd, prompt: str) -> list[int]:
    return post_json(pd.decode + "/tokenize", {"model": MODEL, "prompt": prompt})["tokens"]


def proxy_health(pd) -> dict:
    with urllib.request.urlopen(pd.proxy + "/health", timeout=10) as reply:
        return json.loads(reply.read())


def summed(urls, name: str) -> float:
    return sum(counters(url)[name] for url in urls)


def prefill_nodes_hold_nothing(pd) -> bool:
    return all(kv_cache_usage(i.url) == 0.0 for i in pd.prefills
               if i.process.poll() is None)


def prefilled(pd, prompt: str, url: str | None = None) -> dict:
    """The kv_transfer_params of a one-token prefill on a prefill server."""
    reply = completion(url or pd.prefill, prompt, max_tokens=1,
                       kv_transfer_params={"do_remote_decode": True})
    params = reply["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == "prefill-0"
    return params


def test_32_concurrent_requests_through_2p2d_answer_what_a_colocated_server_answers(
        pd, reference):
    decodes = [i.url for i in pd.decodes]
    before = {name: summed(decodes, name) for name in
              ("vllm:ascend_pd_pulls", "vllm:ascend_pd_failed_pulls",
               "vllm:ascend_pd_pulled_bytes", "vllm:ascend_pd_pull_seconds")}
    assert through_proxy(pd, PROMPTS_32) == [reference[p] for p in PROMPTS_32]
    # Every prompt's KV was pulled, none recomputed. Prompts sharing a prefix may find its
    # blocks in a decode node's prefix cache: at least each one's last block is pulled. The
    # engines report their connector counters with their step stats, which may reach the
    # server's /metrics a little after the last answer.
    def pulls() -> float:
        return summed(decodes, "vllm:ascend_pd_pulls") - before["vllm:ascend_pd_pulls"]

    wait_for(lambda: pulls() >= 32, 10, "32 pulls reported")
    assert pulls() == 32
    assert summed(decodes, "vllm:ascend_pd_failed_pulls") == \
        before["vllm:ascend_pd_failed_pulls"]
    pulled = summed(decodes, "vllm:ascend_pd_pulled_bytes") - \
        before["vllm:ascend_pd_pulled_bytes"]
    seconds = summed(decodes, "vllm:ascend_pd_pull_seconds") - \
        before["vllm:ascend_pd_pull_seconds"]
    assert 0 < seconds < 32 * SIDE_CHANNEL_TIMEOUT_S
    most = sum(-(-(len(prompt_tokens(pd, p)) + 1) // BLOCK_TOKENS) for p in PROMPTS_32)
    assert 32 * BLOCK_BYTES <= pulled <= most * BLOCK_BYTES
    # Both instances of each kind served; afterwards the prefill nodes hold no blocks.
    served = [b["served"] for side in proxy_health(pd).values() for b in side]
    assert len(served) == 4 and min(served) >= 4, served
    wait_for(lambda: prefill_nodes_hold_nothing(pd), 10, "the prefill nodes freed their blocks")


def test_a_decode_prefix_cache_hit_pulls_only_the_blocks_it_lacks(pd, reference):
    """Two prompts sharing a prefix, one after the other on one decode node: the second
    pulls its blocks less those of the shared full blocks (its prefix-cache hit)."""
    first = LONG_PROMPT + "class Ledger:\n    def __init__(self):\n        self.rows = []\n"
    second = first + "".join(f"    def add_{i}(self, row):\n        self.rows.append(row)\n"
                             for i in range(12))
    a, b = prompt_tokens(pd, first), prompt_tokens(pd, second)
    shared = 0
    while shared < len(a) and a[shared] == b[shared]:
        shared += 1
    for prompt in (first, second):
        params = prefilled(pd, prompt)
        before = counters(pd.decode)["vllm:ascend_pd_pulled_bytes"]
        expected = text(completion(pd.prefill, prompt))
        assert text(completion(pd.decode, prompt, kv_transfer_params=params)) == expected
        pulled = counters(pd.decode)["vllm:ascend_pd_pulled_bytes"] - before
    hit_blocks = shared // BLOCK_TOKENS
    assert hit_blocks >= 2
    assert pulled == (len(params["remote_block_ids"]) - hit_blocks) * BLOCK_BYTES


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
    health = proxy_health(pd)
    assert [b["healthy"] for b in health["prefill"] + health["decode"]] == [True] * 4
    totals = counter_totals(pd.proxy, ["pd_proxy_requests", "pd_proxy_backend_requests"])
    assert totals["pd_proxy_requests"] >= 1
    assert totals["pd_proxy_backend_requests"] == 2 * totals["pd_proxy_requests"]


def decode_log_since(pd, start: int) -> str:
    return pathlib.Path(pd.decode_log).read_text()[start:]


def test_forged_kv_transfer_params_are_refused_and_the_prompt_recomputed(pd, reference):
    prompt = PROMPTS[1]
    params = prefilled(pd, prompt)
    other = prefilled(pd, PROMPTS[2])  # a live lease, on another prompt's blocks
    mark = len(pathlib.Path(pd.decode_log).read_text())
    before = counters(pd.decode)
    forged = [
        ({**params, "remote_engine_id": "prefill-9"},
         "remote_engine_id 'prefill-9' is not the engine at 127.0.0.1:"),
        ({**params, "remote_block_ids": [99999]}, "holds block id 99999, outside the cache's"),
        ({**params, "remote_block_ids": [0, 1]}, "remote_block_ids has 2 blocks, but this"),
        (other, "hold the KV of another prompt than the claim's"),
    ]
    for forgery, _ in forged:
        assert text(completion(pd.decode, prompt, kv_transfer_params=forgery)) == \
            reference[prompt]
    log = decode_log_since(pd, mark)
    for _, message in forged:
        assert message in log, log[-3000:]
    after = counters(pd.decode)
    # Three reached the prefill node and were refused there (load errors, recomputed); the
    # other never left the scheduler (computed here from the start).
    assert after["vllm:ascend_pd_failed_pulls"] - before["vllm:ascend_pd_failed_pulls"] == 3
    # The real parameters still pull: the forgeries did not free or spoil the blocks.
    assert text(completion(pd.decode, prompt, kv_transfer_params=params)) == reference[prompt]
    assert text(completion(pd.decode, PROMPTS[2], kv_transfer_params=other)) == \
        reference[PROMPTS[2]]
    assert counters(pd.decode)["vllm:ascend_pd_pulls"] == after["vllm:ascend_pd_pulls"] + 2


@pytest.mark.parametrize("peer", ["nothing", "an HTTP server"])
def test_a_dead_or_wrong_prefill_node_costs_a_recompute_not_a_hang(pd, reference, peer):
    prompt = PROMPTS[2]
    # Nothing listens on a free port; the prefill server's HTTP port speaks no side channel.
    port = free_port() if peer == "nothing" else int(pd.prefill.rsplit(":", 1)[1])
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0",
              "remote_request_id": "cmpl-gone", "remote_host": "127.0.0.1",
              "remote_port": port, "remote_block_ids": [0], "remote_tp_size": 1}
    mark = len(pathlib.Path(pd.decode_log).read_text())
    started = time.monotonic()
    assert text(completion(pd.decode, prompt, kv_transfer_params=params)) == reference[prompt]
    assert time.monotonic() - started < SIDE_CHANNEL_TIMEOUT_S + 20
    assert (f"no answer from the prefill node's side channel at tcp://127.0.0.1:{port} within "
            f"3 s: is a MooncakeConnectorV1 kv_producer up with that kv_port?") in \
        decode_log_since(pd, mark)


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


def streamed(url: str, prompt: str) -> str:
    """A streamed completion's text; an error event fails the test."""
    request = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                         "temperature": 0.0, "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as reply:
        events = [line[6:] for line in reply.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(event) for event in events[:-1]]
    assert not [p for p in payloads if "error" in p], payloads[-1]
    return "".join(c["text"] for p in payloads for c in p["choices"])


def answers_while_killing(pd, instance, ready) -> list[str]:
    """The 32 prompts through the proxy (every other one streamed), ``instance`` killed
    (SIGKILL to its server and engine processes) as soon as ``ready()``."""
    answers: list[str] = []

    def ask(item: tuple[int, str]) -> str:
        index, prompt = item
        return streamed(pd.proxy, prompt) if index % 2 else text(completion(pd.proxy, prompt))

    def send() -> None:
        answers.extend(concurrently(ask, list(enumerate(PROMPTS_32))))

    sender = threading.Thread(target=send)
    sender.start()
    wait_for(ready, 120, f"{instance.name} was busy", interval=0.02)
    kill_server(instance.process)
    sender.join(timeout=600)
    assert not sender.is_alive(), "requests hung after an instance died"
    return answers


def generated_tokens(url: str) -> float:
    name = "vllm:generation_tokens"
    return counter_totals(url, [name])[name]


def out_of_rotation(pd, instance) -> dict:
    kind = "prefill" if instance in pd.prefills else "decode"
    (state,) = [b for b in proxy_health(pd)[kind] if b["url"] == instance.url]
    assert not state["healthy"]
    return state


def test_a_prefill_instance_killed_under_load_costs_no_answer(pd, reference):
    retries = counter_totals(pd.proxy, ["pd_proxy_retries"])["pd_proxy_retries"]
    victim = pd.prefills[1]

    def has_requests() -> bool:
        return any(b["url"] == victim.url and b["in_flight"]
                   for b in proxy_health(pd)["prefill"])

    assert answers_while_killing(pd, victim, has_requests) == \
        [reference[p] for p in PROMPTS_32]
    # The survivors serve on (the proxy finds the dead instance by now, if the kill came
    # after its last request, on these) and the remaining prefill node frees what it held.
    assert through_proxy(pd, PROMPTS[:4]) == [reference[p] for p in PROMPTS[:4]]
    assert out_of_rotation(pd, victim)["last_error"]
    assert counter_totals(pd.proxy, ["pd_proxy_retries"])["pd_proxy_retries"] > retries
    # A request the kill cut between its prefill on the survivor and its decode's pull left
    # blocks there that only their lease frees.
    wait_for(lambda: prefill_nodes_hold_nothing(pd), LEASE_TIMEOUT_S + 20,
             "the prefill node freed its blocks")


def test_a_decode_instance_killed_under_load_costs_no_answer(pd, reference):
    """Requests it had not answered are sent again to the other decode node; streams the
    kill cuts continue there from the tokens already streamed (the answers stay exact);
    blocks it had claimed on prefill nodes and never released there expire with their
    leases."""
    retries = counter_totals(pd.proxy, ["pd_proxy_retries"])["pd_proxy_retries"]
    victim = pd.decodes[1]
    before = generated_tokens(victim.url)
    # Killed some steps into decoding its half of the requests: streams in mid-flight.
    assert answers_while_killing(pd, victim,
                                 lambda: generated_tokens(victim.url) >= before + 48) == \
        [reference[p] for p in PROMPTS_32]
    assert through_proxy(pd, PROMPTS[:4]) == [reference[p] for p in PROMPTS[:4]]
    assert out_of_rotation(pd, victim)["last_error"]
    assert counter_totals(pd.proxy, ["pd_proxy_retries"])["pd_proxy_retries"] > retries
    wait_for(lambda: prefill_nodes_hold_nothing(pd), LEASE_TIMEOUT_S + 20,
             "the prefill node freed the dead decode node's blocks")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
