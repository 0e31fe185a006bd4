"""What vLLM's asynchronous scheduling is worth on the host: is it the floor of speculation?

vLLM 0.32 schedules the next step while the model runs the current one (async scheduling,
on by default) only without speculation or with EAGLE / MTP / draft models; for Medusa,
n-gram and suffix decoding it turns async scheduling off. So a Medusa server whose
draft-length controller drafts nothing still runs synchronously; issue 14's pass line
compares it with the default (async) server. This benchmark measures, on the host target,
what synchronous scheduling costs without speculation, beside Medusa under the controller.

Three engines, up at once, each with its engine core in a process of its own (as ``vllm
serve`` runs it): no speculation (vLLM's default: async scheduling), no speculation with
``async_scheduling=False``, and the demo's Medusa heads (k = 3) under the draft-length
controller. The trained demo model pycoder-26m in bf16, eager; a round generates N greedy
completions of held-out prompts at once (128 tokens each, end of sequence ignored),
N = 1, 4, 16, 64; throughput = tokens over the round's wall time. Per N each engine gets
one uncounted round, then ``--rounds`` turns of one round per engine (the machine is
shared and its speed drifts), each round after ``host_machine.quiet_gap_s()`` (the previous
engine's worker spinning no more): the table gives each engine's median and the
median over turns of its ratio to the default engine.

    python benchmarks/bench_async_scheduling.py [--rounds 6]

Results: ``benchmarks/results/async_scheduling.json`` and ``async_scheduling.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"
CONCURRENCY = (1, 4, 16, 64)
MAX_TOKENS = 128
SETUPS = ("no speculation (async scheduling)", "no speculation (synchronous)",
          "medusa k=3, dynamic")


def engine_args(setup: str, model: str) -> dict:
    args = {"model": model, "dtype": "bfloat16", "enforce_eager": True, "max_num_seqs": 64,
            "max_model_len": 1024}
    if setup == SETUPS[1]:
        args["async_scheduling"] = False
    elif setup == SETUPS[2]:
        from ascend_plugin.demo_model import demo_medusa_dir

        args["speculative_config"] = {"method": "medusa", "model": str(demo_medusa_dir()),
                                      "num_speculative_tokens": 3}
        args["additional_config"] = {"draft_length_config": {"dynamic": True}}
    return args


def measure(rounds: int) -> dict:
    """``{setup: {N: [tokens/s of each counted round]}}``: every setup's engine up at once
    (each engine core in its own process), the rounds of one N taken in turns."""
    from vllm import LLM, SamplingParams

    from ascend_plugin.demo_model import demo_model_dir, held_out_prompts

    model = str(demo_model_dir())
    engines = {}
    for setup in SETUPS:
        print(f"[bench_async_scheduling] starting: {setup}", flush=True)
        engines[setup] = LLM(**engine_args(setup, model))
    base = held_out_prompts(28, 300)
    prompts = [base[i % len(base)][: 300 - 60 * (i // len(base))]
               for i in range(max(CONCURRENCY))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    rates: dict = {setup: {} for setup in SETUPS}
    gap = host_machine.quiet_gap_s()  # the previous round's worker sleeps again
    for n in CONCURRENCY:
        for setup, llm in engines.items():
            time.sleep(gap)
            llm.generate(prompts[:n], params, use_tqdm=False)  # uncounted
            rates[setup][str(n)] = []
        for _ in range(rounds):
            for setup, llm in engines.items():
                time.sleep(gap)
                start = time.perf_counter()
                outputs = llm.generate(prompts[:n], params, use_tqdm=False)
                seconds = time.perf_counter() - start
                rates[setup][str(n)].append(
                    sum(len(o.outputs[0].token_ids) for o in outputs) / seconds)
        print(f"[bench_async_scheduling] N={n}: " + ", ".join(
            f"{setup} {statistics.median(rates[setup][str(n)]):.0f} tok/s"
            for setup in SETUPS), flush=True)
    return rates


def _ratios(rates: dict, setup: str, n: int) -> list[float]:
    """Per turn (one round of each setup, back to back): ``setup`` over the default."""
    return [mine / default for mine, default in zip(rates[setup][str(n)],
                                                    rates[SETUPS[0]][str(n)], strict=True)]


def markdown(results: dict) -> str:
    rates = results["rates"]
    lines = ["# Async scheduling on the host: what a synchronous server gives up", "",
             f"Machine: {results['machine']}. Written by "
             f"`benchmarks/bench_async_scheduling.py` in {results['minutes']:.1f} min.", "",
             "pycoder-26m in bf16, eager; the three engines up at once, each engine core in "
             "its own process (as `vllm serve` runs it); a round generates N greedy "
             f"completions of held-out prompts ({MAX_TOKENS} tokens each) at once; "
             f"{results['rounds']} counted rounds per engine and N after one uncounted, taken "
             "in turns (one round of each engine, each started 1.5 s after the one before, "
             "when that engine's worker has stopped spinning). Throughput: median of "
             "rounds; ratio: median over turns of the turn's ratio to the default engine. "
             "vLLM 0.32 turns async scheduling off for Medusa, n-gram and suffix "
             "speculation, so their servers run synchronously even where the draft-length "
             "controller drafts nothing; the synchronous engine without speculation shows "
             "what that costs by itself.", "",
             "| setup | " + " | ".join(f"N={n} tok/s" for n in CONCURRENCY) + " | "
             + " | ".join(f"N={n} vs default" for n in CONCURRENCY) + " |",
             "|---" * (1 + 2 * len(CONCURRENCY)) + "|"]
    for setup in SETUPS:
        medians = [statistics.median(rates[setup][str(n)]) for n in CONCURRENCY]
        ratios = [statistics.median(_ratios(rates, setup, n)) for n in CONCURRENCY]
        lines.append(f"| {setup} | " + " | ".join(f"{r:.0f}" for r in medians) + " | "
                     + " | ".join(f"{q:.2f}x" for q in ratios) + " |")
    lines += ["", "Per-turn ratios to the default engine:", ""]
    for setup in SETUPS[1:]:
        per_n = "; ".join(f"N={n}: " + ", ".join(f"{q:.2f}" for q in _ratios(rates, setup, n))
                          for n in CONCURRENCY)
        lines.append(f"- {setup}: {per_n}")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6,
                        help="counted rounds per engine and N")
    parser.add_argument("--render", action="store_true",
                        help="write the .md again from the stored .json")
    args = parser.parse_args()
    if args.render:
        results = json.loads((RESULTS / "async_scheduling.json").read_text())
        (RESULTS / "async_scheduling.md").write_text(markdown(results))
        return 0
    os.environ["VLLM_ASCEND_TARGET"] = "host"
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: own process
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"  # GiB per engine (vLLM takes most RAM else)
    started = time.time()
    rates = measure(args.rounds)
    results = {"machine": host_machine.describe(), "rounds": args.rounds, "rates": rates,
               "minutes": (time.time() - started) / 60}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "async_scheduling.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS / "async_scheduling.md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
