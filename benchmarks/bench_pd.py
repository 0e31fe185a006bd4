"""Prefill/decode disaggregation against one colocated server, on the same two cores.

A mixed load on the trained demo model (pycoder-26m, bf16, host target): short prompts
from the held-out files decoding long answers while long prompts (about 700 tokens) arrive
one after another. The peer is one colocated vLLM server on both cores; the disaggregated
setup is 1P1D behind ``ascend_plugin.pd_proxy`` (prefill instance on CPU 0, decode instance
on CPU 1, MooncakeConnectorV1 over TCP on 127.0.0.1). Both run at once and take the load in
turns (A B A B ...), so each pair of rounds saw the same machine. Every request streams; we
read, at the client, the time to first token (TTFT) of the short and the long requests, the
inter-token latency (ITL: gaps between streamed tokens) of the short requests, and the
output throughput of each round.

Transfer speed: the decode instance's own pull time (``vllm:ascend_pd_pull_seconds``)
against the bytes it pulled, and, in this process, the transfer engine reading a cache's
worth of 0.5 MiB blocks between two registered buffers against ``torch``'s copy of the same
bytes.

Results: ``benchmarks/results/pd_disagg.json`` and ``pd_disagg.md``.

    python benchmarks/bench_pd.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"
SHORT, LONG = 8, 6  # requests per round
SHORT_TOKENS, LONG_TOKENS = 96, 8  # max_tokens
LONG_EVERY_S = 0.6  # a long prompt arrives this often, from the round's start


def prompts() -> tuple[list[str], list[str]]:
    from ascend_plugin.demo_model import held_out_prompts, held_out_texts

    short = held_out_prompts(SHORT)
    texts = [sample["text"] for sample in held_out_texts()[1::2]]
    long = []
    for index in range(LONG):  # 2400 characters: some 700 tokens
        joined = "\n".join(texts[index * 3:index * 3 + 3])[:2400]
        long.append(joined[: joined.rfind("\n")])
    return short, long


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def stream(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed completion: send time, the arrival time of every token event."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    arrivals = []
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {(await reply.aread())[:300]}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            if any(choice.get("text") for choice in event["choices"]):
                arrivals.append(time.perf_counter())
    return {"sent": sent, "arrivals": arrivals}


async def one_round(url: str, model: str, short: list[str], long: list[str]) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()

        async def late(index: int, prompt: str):
            await asyncio.sleep(LONG_EVERY_S * (index + 1))
            return await stream(client, url, model, prompt, LONG_TOKENS)

        results = await asyncio.gather(
            *(stream(client, url, model, p, SHORT_TOKENS) for p in short),
            *(late(i, p) for i, p in enumerate(long)))
        seconds = time.perf_counter() - started
    short_runs, long_runs = results[:len(short)], results[len(short):]
    def ttft(runs):
        return [r["arrivals"][0] - r["sent"] for r in runs]

    itl = [b - a for r in short_runs for a, b in itertools.pairwise(r["arrivals"])]
    tokens = sum(len(r["arrivals"]) for r in results)
    return {"seconds": seconds, "tokens": tokens, "ttft_short": ttft(short_runs),
            "ttft_long": ttft(long_runs), "itl": itl}


def transfer_speed(block_bytes: int, blocks: int, repeats: int = 5) -> dict:
    """The engine reading ``blocks`` scattered blocks between two local buffers, against
    torch copying the same blocks (and the same bytes in one piece)."""
    import torch

    from ascend_core.distributed.kv_transfer.transfer_engine import MooncakeEngine

    total = block_bytes * blocks
    source = torch.randint(0, 255, (2 * total,), dtype=torch.uint8)
    target = torch.zeros(2 * total, dtype=torch.uint8)
    near, far = MooncakeEngine("127.0.0.1", "tcp"), MooncakeEngine("127.0.0.1", "tcp")
    near.register([(target.data_ptr(), target.numel())])
    far.register([(source.data_ptr(), source.numel())])
    # Every other block: runs that do not merge, as a real request's blocks.
    offsets = [2 * i * block_bytes for i in range(blocks)]
    local = [target.data_ptr() + o for o in offsets]
    remote = [source.data_ptr() + o for o in offsets]
    engine, blockwise, whole = [], [], []
    for _ in range(repeats):
        target.zero_()
        started = time.perf_counter()
        assert near.read(far.session, local, remote, [block_bytes] * blocks) == 0
        engine.append(time.perf_counter() - started)
        assert torch.equal(target[:block_bytes], source[:block_bytes])
        started = time.perf_counter()
        for o in offsets:
            target[o:o + block_bytes].copy_(source[o:o + block_bytes])
        blockwise.append(time.perf_counter() - started)
        started = time.perf_counter()
        target[:total].copy_(source[:total])
        whole.append(time.perf_counter() - started)
    near.close([(target.data_ptr(), target.numel())])
    far.close([(source.data_ptr(), source.numel())])
    def gbps(times):
        return total / statistics.median(times) / 1e9

    return {"bytes": total, "block_bytes": block_bytes, "blocks": blocks,
            "engine_gb_s": gbps(engine), "torch_blockwise_gb_s": gbps(blockwise),
            "torch_one_copy_gb_s": gbps(whole)}


def summary(rounds: list[dict]) -> dict:
    pooled = {key: [v for r in rounds for v in r[key]] for key in ("ttft_short", "ttft_long",
                                                                    "itl")}
    out = {f"{key}_{q}_ms": 1000 * percentile(values, q) for key, values in pooled.items()
           for q in (50, 99)}
    out["throughput_tok_s"] = sum(r["tokens"] for r in rounds) / sum(r["seconds"]
                                                                     for r in rounds)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setup (default 3)")
    args = parser.parse_args()
    from ascend_plugin.demo_model import demo_model_dir
    from ascend_plugin.pd_serving import running_pd
    from ascend_plugin.serving import counter_totals, running_server

    model = str(demo_model_dir())
    short, long = prompts()
    server_args = ["--dtype", "bfloat16", "--enforce-eager"]
    logs = tempfile.mkdtemp(prefix="bench-pd-")
    print(f"[bench_pd] starting a colocated server (CPUs 0,1) and 1P1D (logs in {logs})",
          flush=True)
    counters = ["vllm:ascend_pd_pulled_bytes", "vllm:ascend_pd_pull_seconds",
                "vllm:ascend_pd_pulls", "vllm:ascend_pd_failed_pulls"]
    with running_server(model, extra_args=server_args, cpus="0,1",
                        log_path=f"{logs}/colocated.log") as colocated, \
            running_pd(model, logs, extra_args=server_args, cpus=("0", "1")) as pd:
        setups = {"colocated": colocated, "1P1D": pd.proxy}
        for url in setups.values():  # one round each, not counted: first requests pay
            asyncio.run(one_round(url, model, short, long))  # one-off costs
        before = counter_totals(pd.decode, counters)
        rounds = {name: [] for name in setups}
        for index in range(args.rounds):
            for name, url in setups.items():
                result = asyncio.run(one_round(url, model, short, long))
                rounds[name].append(result)
                print(f"[bench_pd] round {index + 1}/{args.rounds} {name}: "
                      f"{result['tokens'] / result['seconds']:.0f} tok/s, TTFT long p50 "
                      f"{1000 * statistics.median(result['ttft_long']):.0f} ms, ITL p50 "
                      f"{1000 * statistics.median(result['itl']):.0f} ms", flush=True)
        after = counter_totals(pd.decode, counters)
    pulled = {name: after[name] - before[name] for name in counters}
    block_bytes = 8 * 2 * 2 * 128 * 64 * 2  # layers x K/V x kv heads x tokens x head x bf16
    print("[bench_pd] transfer engine against torch copies", flush=True)
    transfer = transfer_speed(block_bytes, blocks=256)
    results = {
        "machine": host_machine.describe(),
        "load": {"short": SHORT, "short_max_tokens": SHORT_TOKENS, "long": LONG,
                 "long_max_tokens": LONG_TOKENS, "long_every_s": LONG_EVERY_S,
                 "rounds": args.rounds},
        "setups": {name: summary(r) for name, r in rounds.items()},
        "throughput_ratio_per_pair": [
            (b["tokens"] / b["seconds"]) / (a["tokens"] / a["seconds"])
            for a, b in zip(rounds["colocated"], rounds["1P1D"], strict=True)],
        "in_server_pulls": {**pulled, "gb_s": pulled["vllm:ascend_pd_pulled_bytes"]
                            / max(pulled["vllm:ascend_pd_pull_seconds"], 1e-9) / 1e9},
        "transfer": transfer,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pd_disagg.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "pd_disagg.md").write_text(markdown(results))
    print((RESULTS / "pd_disagg.md").read_text())
    return 0


def markdown(results: dict) -> str:
    load = results["load"]
    lines = [
        "# Prefill/decode disaggregation against a colocated server (host target)",
        "",
        f"Machine: {results['machine']}. Written by `benchmarks/bench_pd.py`.",
        "",
        f"Load per round: {load['short']} short prompts (held-out files, about 100 tokens) "
        f"decoding {load['short_max_tokens']} tokens each, and {load['long']} long prompts "
        f"(about 700 tokens, {load['long_max_tokens']} tokens each) arriving every "
        f"{load['long_every_s']} s; all streamed, greedy, pycoder-26m in bf16. "
        f"{load['rounds']} rounds per setup, taken in turns (colocated, 1P1D, colocated, "
        f"...); percentiles over every request of every round.",
        "",
        "| setup | TTFT short p50 / p99 (ms) | TTFT long p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| throughput (tok/s) |",
        "|---|---|---|---|---|",
    ]
    for name, s in results["setups"].items():
        lines.append(
            f"| {name} | {s['ttft_short_50_ms']:.0f} / {s['ttft_short_99_ms']:.0f} "
            f"| {s['ttft_long_50_ms']:.0f} / {s['ttft_long_99_ms']:.0f} "
            f"| {s['itl_50_ms']:.1f} / {s['itl_99_ms']:.1f} | {s['throughput_tok_s']:.0f} |")
    ratios = ", ".join(f"{r:.2f}" for r in results["throughput_ratio_per_pair"])
    pulls, transfer = results["in_server_pulls"], results["transfer"]
    count = pulls["vllm:ascend_pd_pulls"]
    colo, pd = results["setups"]["colocated"], results["setups"]["1P1D"]
    lines += [
        "",
        f"Throughput of 1P1D over colocated, per pair of rounds: {ratios}.",
        "",
        "## Reading",
        "",
        f"Two cores are too few for disaggregation to pay on throughput or time to first "
        f"token: the colocated server runs every step on both cores, while 1P1D gives the "
        f"prefill instance one and the decode instance the other, and adds a hop (prefill "
        f"answer, proxy, claim and pull). Here 1P1D reads {pd['throughput_tok_s']:.0f} "
        f"tok/s against {colo['throughput_tok_s']:.0f}, and long-prompt TTFT p50 "
        f"{pd['ttft_long_50_ms']:.0f} ms against {colo['ttft_long_50_ms']:.0f} ms. What it "
        f"buys is the decode stream's tail: colocated, a long prompt's prefill stalls every "
        f"running decode (ITL p99 {colo['itl_99_ms']:.0f} ms); disaggregated, decoding never "
        f"waits for a prefill (ITL p99 {pd['itl_99_ms']:.0f} ms).",
        "",
        "## KV transfer",
        "",
        f"In the decode instance, during the rounds: {count:.0f} pulls "
        f"({pulls['vllm:ascend_pd_failed_pulls']:.0f} failed), "
        f"{pulls['vllm:ascend_pd_pulled_bytes'] / 2**20:.0f} MiB in "
        f"{pulls['vllm:ascend_pd_pull_seconds']:.2f} s of pulls "
        f"({1000 * pulls['vllm:ascend_pd_pull_seconds'] / max(count, 1):.0f} ms a request, "
        f"{1000 * pulls['gb_s']:.0f} MB/s). A pull's time runs from the decode worker's "
        f"first claim to its release: side-channel round trips, the wait until the busy "
        f"prefill instance's next step registers the request's blocks, and the reads.",
        "",
        f"In one process, {transfer['blocks']} blocks of {transfer['block_bytes'] // 1024} KiB "
        f"({transfer['bytes'] / 2**20:.0f} MiB, every other block of a buffer), median of 5:",
        "",
        "| copy | GB/s |",
        "|---|---|",
        f"| Mooncake transfer engine, tcp on 127.0.0.1, one batched read "
        f"| {transfer['engine_gb_s']:.2f} |",
        f"| torch `copy_`, block by block | {transfer['torch_blockwise_gb_s']:.2f} |",
        f"| torch `copy_`, the same bytes in one piece | {transfer['torch_one_copy_gb_s']:.2f} |",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
