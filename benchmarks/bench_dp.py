"""Data parallel 2 against data parallel 1 through ``vllm serve`` on the host target.

The trained demo model (pycoder-26m, bf16), two servers on the same two cores: one engine
(DP 1) and two engines behind vLLM's data-parallel coordinator (``--data-parallel-size 2``,
the ``mp`` backend, vLLM's default API servers). Both run at once and take the load in turns
(A B A B ...), so each pair of rounds saw the same machine. A round sends N greedy
completions of held-out prompts at once (N = 16 and 64, ``max_tokens`` 64, end of sequence
ignored) and reads the output throughput (tokens over the round's wall time) and each
request's latency. Which engine served how much comes from vLLM's ``/metrics``.

Results: ``benchmarks/results/dp.json`` and ``dp.md``.

    python benchmarks/bench_dp.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"
CONCURRENCY = (16, 64)
MAX_TOKENS = 64


async def one_round(url: str, model: str, prompts: list[str]) -> dict:
    import httpx

    async def one(client, prompt: str) -> tuple[float, int]:
        body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                "temperature": 0.0, "ignore_eos": True}
        sent = time.perf_counter()
        reply = await client.post(url + "/v1/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {reply.status_code}: {reply.text[:300]}")
        return time.perf_counter() - sent, reply.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one(client, p) for p in prompts))
        seconds = time.perf_counter() - started
    return {"seconds": seconds, "tokens": sum(t for _, t in results),
            "latency": [s for s, _ in results]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per setup and load")
    args = parser.parse_args()
    from ascend_plugin.demo_model import demo_model_dir, held_out_prompts
    from ascend_plugin.serving import finished_per_engine, running_server

    model = str(demo_model_dir())
    prompts = held_out_prompts(max(CONCURRENCY))
    server_args = ["--dtype", "bfloat16", "--enforce-eager"]
    logs = tempfile.mkdtemp(prefix="bench-dp-")
    print(f"[bench_dp] starting DP 1 and DP 2 servers (logs in {logs})", flush=True)
    with running_server(model, extra_args=server_args, log_path=f"{logs}/dp1.log") as dp1, \
            running_server(model, extra_args=[*server_args, "--data-parallel-size", "2"],
                           log_path=f"{logs}/dp2.log") as dp2:
        setups = {"DP 1": dp1, "DP 2": dp2}
        for url in setups.values():  # not counted: first requests pay one-off costs
            asyncio.run(one_round(url, model, prompts[:8]))
        rounds = {(name, n): [] for n in CONCURRENCY for name in setups}
        for n in CONCURRENCY:
            for index in range(args.rounds):
                for name, url in setups.items():
                    result = asyncio.run(one_round(url, model, prompts[:n]))
                    rounds[(name, n)].append(result)
                    print(f"[bench_dp] {n} concurrent, round {index + 1}/{args.rounds} "
                          f"{name}: {result['tokens'] / result['seconds']:.0f} tok/s",
                          flush=True)
        engines = {name: finished_per_engine(url) for name, url in setups.items()}
    results = {
        "machine": host_machine.describe(),
        "load": {"concurrency": list(CONCURRENCY), "max_tokens": MAX_TOKENS,
                 "rounds": args.rounds},
        "setups": {
            f"{name} @ {n}": {
                "throughput_tok_s": statistics.median(r["tokens"] / r["seconds"]
                                                      for r in runs),
                "latency_50_ms": 1000 * statistics.median(
                    x for r in runs for x in r["latency"]),
                "rounds_tok_s": [r["tokens"] / r["seconds"] for r in runs]}
            for (name, n), runs in rounds.items()},
        "dp2_over_dp1_per_pair": {
            str(n): [(b["tokens"] / b["seconds"]) / (a["tokens"] / a["seconds"])
                     for a, b in zip(rounds[("DP 1", n)], rounds[("DP 2", n)], strict=True)]
            for n in CONCURRENCY},
        "requests_per_engine": engines,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dp.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "dp.md").write_text(markdown(results))
    print((RESULTS / "dp.md").read_text())
    return 0


def markdown(results: dict) -> str:
    load = results["load"]
    lines = [
        "# Data parallel 2 against data parallel 1 (host target, `vllm serve`)",
        "",
        f"Machine: {results['machine']}. Written by `benchmarks/bench_dp.py`.",
        "",
        f"pycoder-26m in bf16; a round sends N greedy completions of held-out prompts at once "
        f"({load['max_tokens']} tokens each); {load['rounds']} rounds per setup and N, taken "
        "in turns (DP 1, DP 2, DP 1, ...) with both servers up on the same cores.",
        "",
        "| setup @ concurrent requests | throughput (tok/s, median of rounds) "
        "| request latency p50 (ms) |",
        "|---|---|---|",
    ]
    for name, s in results["setups"].items():
        lines.append(f"| {name} | {s['throughput_tok_s']:.0f} | {s['latency_50_ms']:.0f} |")
    lines += ["", "DP 2 over DP 1, throughput per pair of rounds:"]
    for n, ratios in results["dp2_over_dp1_per_pair"].items():
        lines.append(f"- {n} concurrent: " + ", ".join(f"{r:.2f}" for r in ratios))
    served = results["requests_per_engine"]["DP 2"]
    lines += ["", "Requests each DP 2 engine finished (vLLM's `/metrics`, all rounds): "
              + ", ".join(f"engine {k}: {v:.0f}" for k, v in sorted(served.items())) + ".",
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
