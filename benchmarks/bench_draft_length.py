"""Speculation under load through ``vllm serve`` on the host target: no speculation, a fixed
draft length k = 3, and the draft-length controller (ascend-specdec,
``draft_length_config.dynamic``), per method.

The trained demo model (pycoder-26m) in bf16; methods: n-gram, suffix decoding, the demo's
Medusa heads, and an EAGLE draft of random weights (a drafter whose drafts are almost never
accepted: what a wrong or stale draft model looks like to a server). The no-speculation
server is up throughout; each method's two servers (k = 3, dynamic) are up while that
method is measured, and the load is taken in turns (none, k=3, dynamic, none, ...), so each
round of a load level saw the same machine. Each round starts once the servers' workers
sleep: a vLLM worker spins on its queue for ``busy_loop_s`` (1 s) after its engine's last
step, and without the wait the previous round's server took a large share of the 2 cores
from the next round's first second (an ad-hoc /proc look, not stored: late first tokens).
A round is N concurrent clients (N = 1, 4, 16, 64), each sending ``--requests-per-client``
streamed greedy completions of held-out prompts one after another through the ``openai``
client, the next as soon as the one before finished (the load of vLLM's serving benchmark
with ``--max-concurrency N``; ``max_tokens`` 128, end of sequence ignored; with
``--max-tokens-spread S`` the requests' lengths are spread evenly over 128 +- S, so that a
round's requests do not all end in the same step without speculation). With one request
per client a round is one closed batch, and its time is that of its slowest request: under
speculation requests advance at different speeds, so the batch's tail runs at small batch
sizes that a steady load does not have (n-gram k = 3 over no speculation at N = 16: 0.77
with one request per client, ``results/draft_length_rounds.md``; 1.08 with two,
``results/draft_length.md``).
Before
the counted rounds each server gets one uncounted round at that N (first requests pay
one-off costs, and the controller calibrates each batch-size range on its first steps
there). Per setup and N: output throughput (tokens over the round's wall time, median of
rounds), time to first token and inter-token latency (medians over requests). From vLLM's
``/metrics`` over all rounds: mean acceptance length, mean draft length, and for dynamic
the lengths it chose (``ascend:spec_decode_draft_length``), in all and per N over the
counted rounds.

Pass line (issue 14): at every N, dynamic's throughput at least 0.95x the better of no
speculation and fixed k = 3 for the same method.

Results: ``benchmarks/results/draft_length.json`` and ``draft_length.md`` (``--name`` gives
another file name, for a run of some methods only).

    python benchmarks/bench_draft_length.py [--rounds 3] [--requests-per-client 2]
        [--methods ngram,suffix,medusa,eagle] [--max-tokens-spread 0] [--name draft_length]
    python benchmarks/bench_draft_length.py --render   # the .md again from the stored .json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"
CONCURRENCY = (1, 4, 16, 64)
MAX_TOKENS = 128
K = 3
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens")


def speculative_config(method: str, model: str) -> dict:
    from ascend_plugin.demo_model import demo_medusa_dir
    from ascend_plugin.tiny_drafts import ensure_eagle_draft

    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": K}
    if method == "medusa":
        return {"method": "medusa", "model": str(demo_medusa_dir()), "num_speculative_tokens": K}
    if method == "eagle":
        return {"method": "eagle", "model": str(ensure_eagle_draft(model, std=0.02)),
                "num_speculative_tokens": K}
    raise SystemExit(f"unknown method {method!r}: use ngram, suffix, medusa or eagle")


BASE_ARGS = ["--dtype", "bfloat16", "--enforce-eager", "--max-num-seqs", "64"]


def method_setups(method: str, model: str) -> dict[str, list[str]]:
    """Setup name -> extra ``vllm serve`` arguments, for one method."""
    spec = ["--speculative-config", json.dumps(speculative_config(method, model))]
    return {name: [*BASE_ARGS, *spec, "--additional-config",
                   json.dumps({"draft_length_config": {"dynamic": dynamic}})]
            for name, dynamic in ((f"{method} k={K}", False), (f"{method} dynamic", True))}


def output_lengths(count: int, spread: int) -> list[int]:
    """``max_tokens`` of a round's ``count`` requests: all ``MAX_TOKENS``, or with
    ``spread`` evenly from ``MAX_TOKENS - spread`` to ``MAX_TOKENS + spread`` in the order
    sent (so requests sent together differ in length)."""
    if count <= 1 or spread == 0:
        return [MAX_TOKENS] * count
    return [MAX_TOKENS - spread + round(2 * spread * i / (count - 1)) for i in range(count)]


async def one_round(url: str, model: str, prompts: list[str], clients: int,
                    max_tokens: list[int] | None = None) -> dict:
    """``clients`` concurrent clients, client ``i`` sending ``prompts[i::clients]`` one after
    another; ``max_tokens`` per prompt (default ``MAX_TOKENS`` each)."""
    from openai import AsyncOpenAI

    lengths = max_tokens or [MAX_TOKENS] * len(prompts)

    async def one(client, prompt: str, length: int) -> dict:
        sent = time.perf_counter()
        arrivals, tokens = [], 0
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=length, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
        ttft = arrivals[0] - sent
        # Arrivals are chunks (a step that accepts drafts sends several tokens at once).
        itl = (arrivals[-1] - arrivals[0]) / (tokens - 1) if tokens > 1 else 0.0
        return {"ttft": ttft, "itl": itl, "tokens": tokens}

    async with AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900,
                           max_retries=0) as client:
        async def client_loop(mine: list[tuple[str, int]]) -> list[dict]:
            return [await one(client, p, length) for p, length in mine]

        sent = list(zip(prompts, lengths, strict=True))
        started = time.perf_counter()
        per_client = await asyncio.gather(*(client_loop(sent[i::clients])
                                            for i in range(clients)))
        seconds = time.perf_counter() - started
        results = [r for mine in per_client for r in mine]
    return {"seconds": seconds, "tokens": sum(r["tokens"] for r in results),
            "ttft": [r["ttft"] for r in results], "itl": [r["itl"] for r in results]}


def measure(urls: dict[str, str], model: str, prompts: list[str], rounds: int,
            requests_per_client: int, record: dict, turns: dict, lengths: dict,
            spread: int = 0) -> None:
    """Every N: one uncounted round per server, then ``rounds`` counted ones in turns;
    ``record`` by (setup, N), ``turns`` (this method's) by N and setup, ``lengths`` (this
    method's) by N: the draft lengths its dynamic server verified requests with in the
    counted rounds. Every round starts after ``host_machine.quiet_gap_s()``."""
    from ascend_plugin.serving import histogram_counts

    gap = host_machine.quiet_gap_s()

    def run(url: str, n: int) -> dict:
        time.sleep(gap)
        sent = [prompts[i % len(prompts)] for i in range(n * requests_per_client)]
        return asyncio.run(one_round(url, model, sent, clients=n,
                                     max_tokens=output_lengths(len(sent), spread)))

    for n in CONCURRENCY:
        for url in urls.values():
            run(url, n)
        for index in range(rounds):
            for name, url in urls.items():
                dynamic = name.endswith(" dynamic")
                if dynamic:
                    before = histogram_counts(url, "ascend:spec_decode_draft_length")
                result = run(url, n)
                if dynamic:
                    after = histogram_counts(url, "ascend:spec_decode_draft_length")
                    per_n = lengths.setdefault(str(n), {})
                    for k, count in after.items():
                        per_n[str(k)] = per_n.get(str(k), 0) + count - before.get(k, 0)
                record.setdefault((name, n), []).append(result)
                turns.setdefault(str(n), {}).setdefault(name, []).append(
                    result["tokens"] / result["seconds"])
                print(f"[bench_draft_length] N={n} round {index + 1}/{rounds} {name}: "
                      f"{result['tokens'] / result['seconds']:.0f} tok/s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="counted rounds per setup and N")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests each of the N clients sends in a round, one after another")
    parser.add_argument("--max-tokens-spread", type=int, default=0,
                        help="requests' max_tokens spread evenly over 128 +- this (default 0: "
                             "all 128, so without speculation a round's requests end together)")
    parser.add_argument("--methods", default="ngram,suffix,medusa,eagle")
    parser.add_argument("--render", action="store_true",
                        help="only rewrite the .md (and the pass line) from the stored .json")
    parser.add_argument("--name", default="draft_length",
                        help="results file name under benchmarks/results (default draft_length)")
    args = parser.parse_args()
    if not 0 <= args.max_tokens_spread < MAX_TOKENS:
        parser.error(f"--max-tokens-spread is {args.max_tokens_spread}: a request's max_tokens "
                     f"must stay positive, use 0 to {MAX_TOKENS - 1}")
    if args.render:
        results = json.loads((RESULTS / f"{args.name}.json").read_text())
        write(results, list(results["turns"]), args.name)
        return 0
    from ascend_plugin.demo_model import demo_model_dir, held_out_prompts
    from ascend_plugin.serving import counter_totals, histogram_counts, running_server

    methods = args.methods.split(",")
    model = str(demo_model_dir())
    base = held_out_prompts(28, 300)
    prompts = [base[i % len(base)][: 300 - 60 * (i // len(base))]
               for i in range(max(CONCURRENCY))]
    logs = tempfile.mkdtemp(prefix="bench-draft-length-")
    print(f"[bench_draft_length] server logs in {logs}", flush=True)
    rounds: dict = {}
    counters, chosen, turns, lengths_per_n = {}, {}, {}, {}
    with running_server(model, extra_args=BASE_ARGS, log_path=f"{logs}/none.log") as plain:
        for method in methods:
            with contextlib.ExitStack() as stack:
                print(f"[bench_draft_length] {method}: starting its servers", flush=True)
                urls = {name: stack.enter_context(running_server(
                            model, extra_args=extra, log_path=f"{logs}/{name}.log"))
                        for name, extra in method_setups(method, model).items()}
                measure({"no speculation": plain, **urls}, model, prompts, args.rounds,
                        args.requests_per_client, rounds, turns.setdefault(method, {}),
                        lengths_per_n.setdefault(method, {}), args.max_tokens_spread)
                for name, url in urls.items():
                    counters[name] = counter_totals(url, COUNTERS)
                chosen[method] = histogram_counts(urls[f"{method} dynamic"],
                                                  "ascend:spec_decode_draft_length")
    names = ["no speculation"] + [name for method in methods
                                  for name in method_setups(method, model)]
    results = {
        "machine": host_machine.describe(),
        "load": {"concurrency": list(CONCURRENCY), "max_tokens": MAX_TOKENS,
                 "max_tokens_spread": args.max_tokens_spread,
                 "rounds": args.rounds, "requests_per_client": args.requests_per_client,
                 "k": K},
        "setups": {name: {str(n): summary(rounds[(name, n)]) for n in CONCURRENCY}
                   for name in names},
        "turns": turns,
        "acceptance": {name: acceptance(c) for name, c in counters.items()},
        "dynamic_lengths": {method: {str(k): n for k, n in sorted(h.items())}
                            for method, h in chosen.items()},
        "dynamic_lengths_per_n": lengths_per_n,
    }
    write(results, methods, args.name)
    return 0


def write(results: dict, methods: list[str], name: str) -> None:
    results["pass_line"] = pass_line(results, methods)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / f"{name}.md").write_text(markdown(results))
    print((RESULTS / f"{name}.md").read_text())


def summary(runs: list[dict]) -> dict:
    return {"throughput_tok_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "rounds_tok_s": [r["tokens"] / r["seconds"] for r in runs],
            "ttft_50_ms": 1000 * statistics.median(x for r in runs for x in r["ttft"]),
            "itl_50_ms": 1000 * statistics.median(x for r in runs for x in r["itl"])}


def acceptance(counters: dict) -> dict:
    drafts, proposed, accepted = (counters[name] for name in COUNTERS)
    return {"drafts": drafts,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "mean_draft_length": proposed / drafts if drafts else None}


def pass_line(results: dict, methods: list[str]) -> dict:
    """Per method and N: dynamic over the better of no speculation and fixed k (the better
    by median throughput), as the ratio of medians and as the median of the ratios within
    each turn (the rounds of one turn ran back to back, so the machine's drift between turns
    cancels out); the pass line is read on the second."""
    line = {}
    for method in methods:
        for n in map(str, CONCURRENCY):
            turns = results["turns"][method][n]
            best = max(("no speculation", f"{method} k={K}"),
                       key=lambda name: statistics.median(turns[name]))
            dynamic = turns[f"{method} dynamic"]
            per_turn = [d / b for d, b in zip(dynamic, turns[best], strict=True)]
            ratio = statistics.median(per_turn)
            line[f"{method} @ {n}"] = {
                "best": best, "per_turn": per_turn, "dynamic_over_best": ratio,
                "of_medians": statistics.median(dynamic) / statistics.median(turns[best]),
                "over_fixed_k": (statistics.median(dynamic)
                                 / statistics.median(turns[f"{method} k={K}"])),
                "passes": ratio >= 0.95}
    return line


def markdown(results: dict) -> str:
    load = results["load"]
    lines = [
        "# Speculation under load: no speculation, fixed k, and the draft-length controller "
        "(host target, `vllm serve`)",
        "",
        f"Machine: {results['machine']}. Written by `benchmarks/bench_draft_length.py`.",
        "",
        f"pycoder-26m in bf16; a round is N concurrent clients, each sending "
        f"{load.get('requests_per_client', 1)} streamed greedy completion(s) of held-out "
        f"prompts one after another through the `openai` client ({load['max_tokens']} "
        + ("tokens each); " if not load.get("max_tokens_spread") else
           f"+- {load['max_tokens_spread']} tokens, spread evenly over a round's requests in "
           "the order sent); ")
        + f"{load['rounds']} counted rounds per setup and N (after one uncounted), taken in turns "
        "(no speculation, k=3, dynamic) with the no-speculation server and the method's two "
        "up on the same cores, each round started 1.5 s after the one before (when that "
        "server's worker has stopped spinning). Throughput: median of rounds; TTFT and ITL: "
        "medians over requests.",
        "",
        "| setup | " + " | ".join(f"N={n} tok/s" for n in load["concurrency"])
        + " | " + " | ".join(f"N={n} TTFT / ITL ms" for n in load["concurrency"]) + " |",
        "|---|" + "---|" * (2 * len(load["concurrency"])),
    ]
    for name, per_n in results["setups"].items():
        tput = " | ".join(f"{per_n[str(n)]['throughput_tok_s']:.0f}"
                          for n in load["concurrency"])
        lat = " | ".join(f"{per_n[str(n)]['ttft_50_ms']:.0f} / {per_n[str(n)]['itl_50_ms']:.1f}"
                         for n in load["concurrency"])
        lines.append(f"| {name} | {tput} | {lat} |")
    lines += ["", "Acceptance over all rounds (vLLM's `/metrics`):", "",
              "| setup | mean acceptance length | mean draft length |", "|---|---|---|"]
    for name, a in results["acceptance"].items():
        if a["drafts"]:
            lines.append(f"| {name} | {a['mean_acceptance_length']:.2f} | "
                         f"{a['mean_draft_length']:.2f} |")
        else:
            lines.append(f"| {name} | no drafts | 0 |")
    lines += ["", "Draft lengths the controller verified requests with (`/metrics` "
              "`ascend:spec_decode_draft_length`, requests x steps):", ""]
    for method, counts in results["dynamic_lengths"].items():
        lines.append(f"- {method}: " + ", ".join(f"{k}: {n}" for k, n in counts.items()))
        for n, per_n in results.get("dynamic_lengths_per_n", {}).get(method, {}).items():
            total = sum(per_n.values()) or 1
            lines.append(f"  - N={n}, counted rounds: " + ", ".join(
                f"{k}: {count} ({100 * count / total:.0f}%)"
                for k, count in sorted(per_n.items(), key=lambda item: int(item[0]))))
    lines += ["", "Pass line: dynamic's throughput over the better of no speculation and "
              f"k={load['k']}, the median of the ratios within each turn (goal: at least "
              "0.95); in brackets the ratio of the medians and the per-turn ratios:", ""]
    for key, p in results["pass_line"].items():
        turns = ", ".join(f"{r:.2f}" for r in p["per_turn"])
        lines.append(f"- {key} (against {p['best']}): {p['dynamic_over_best']:.2f}"
                     + ("" if p["passes"] else " (below the line)")
                     + f" [{p['of_medians']:.2f}; {turns}]")
    lines += ["", f"Dynamic over fixed k={load['k']} alone (ratio of medians), N = "
              + " / ".join(map(str, load["concurrency"])) + ":", ""]
    for method in results["dynamic_lengths"]:
        lines.append(f"- {method}: " + " / ".join(
            f"{results['pass_line'][f'{method} @ {n}']['over_fixed_k']:.2f}"
            for n in load["concurrency"]))
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
