"""Multi-LoRA decode on the host target: tokens/s with 0, 1 and 4 adapters in a batch, the
plugin against stock vLLM, side by side in one run.

The trained demo model (``models/pycoder-26m``, bfloat16) with four random rank-16 adapters
on every linear layer of its decoder (``ascend_plugin.tiny_adapters``, peft's format). Each
stack runs in its own process (vLLM picks its platform once per process): an engine with
``enable_lora`` (``max_loras`` 4, ``max_lora_rank`` 16) decodes a batch of 8 greedy requests
on held-out code prompts with no adapter, all 8 on one adapter, and 2 on each of four
adapters; plus an engine without LoRA as the baseline of what LoRA costs. Decode tokens/s is
``batch * (N - 1) / (t(N) - t(1))`` (generations of N and 1 tokens, so prefill cancels out),
the median of ``--repeats`` runs, the mixes interleaved within each repeat.

    python benchmarks/bench_lora.py [--repeats 3] [--max-tokens 64]

Results: ``benchmarks/results/lora_decode.json`` and ``lora_decode.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import host_machine  # beside this script

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results"
MODEL = REPO / "models" / "pycoder-26m"
BATCH = 8
ADAPTERS = 4
RANK = 16
MIXES = {"0 adapters": [None] * BATCH, "1 adapter": ["a0"] * BATCH,
         "4 adapters": [f"a{i % ADAPTERS}" for i in range(BATCH)]}
STACKS = {"stock vLLM": {}, "plugin (host)": {"VLLM_ASCEND_TARGET": "host"}}


def held_out_prompts(count: int, chars: int = 200) -> list[str]:
    lines = (MODEL / "held_out.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["text"][:chars] for line in lines[:count]]


def worker(args: dict) -> None:
    """In the engine's process: time each mix (or the plain engine) and print RESULT."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm_kwargs = dict(dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.05,
                      seed=0, enforce_eager=True)
    if args["lora"]:
        llm_kwargs.update(enable_lora=True, max_loras=ADAPTERS, max_lora_rank=RANK)
    llm = LLM(model=str(MODEL), **llm_kwargs)
    requests = {name: LoRARequest(name, number, path)
                for number, (name, path) in enumerate(args["adapters"].items(), start=1)}
    mixes = MIXES if args["lora"] else {"no LoRA engine": [None] * BATCH}

    def seconds(mix: list, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        lora = [requests[name] if name else None for name in mix] if args["lora"] else None
        start = time.perf_counter()
        llm.generate(args["prompts"], params, lora_request=lora, use_tqdm=False)
        return time.perf_counter() - start

    for mix in mixes.values():  # warm-up: loads the adapters, first-call costs
        seconds(mix, 2)
    times: dict[str, list[float]] = {name: [] for name in mixes}
    for _ in range(args["repeats"]):
        for name, mix in mixes.items():
            long_run, short_run = seconds(mix, args["max_tokens"]), seconds(mix, 1)
            times[name].append(BATCH * (args["max_tokens"] - 1) / (long_run - short_run))
    print("RESULT " + json.dumps({name: {"tokens_per_s": statistics.median(runs),
                                         "runs": runs} for name, runs in times.items()}),
          flush=True)


def run_stack(env_extra: dict, lora: bool, adapters: dict, options) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false",
                **env_extra})
    args = {"lora": lora, "adapters": adapters, "prompts": held_out_prompts(BATCH),
            "max_tokens": options.max_tokens, "repeats": options.repeats}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise SystemExit(f"bench_lora: a run failed (exit {proc.returncode}):\n"
                     f"{proc.stderr[-4000:]}")


def markdown(report: dict) -> str:
    rows = ["| mix | " + " | ".join(f"{s} tokens/s" for s in STACKS) + " | plugin / stock |",
            "|---|" + "---|" * (len(STACKS) + 1)]
    for mix in [*MIXES, "no LoRA engine"]:
        values = [report["results"][stack][mix]["tokens_per_s"] for stack in STACKS]
        rows.append(f"| {mix} | " + " | ".join(f"{v:.1f}" for v in values)
                    + f" | {values[1] / values[0]:.2f}x |")
    return (f"# Multi-LoRA decode on the host target\n\n{report['machine']}; "
            f"`{report['command']}`\n\nModel {report['model']} (bfloat16), batch {BATCH}, "
            f"{report['max_tokens']} tokens, rank-{RANK} adapters on every decoder linear "
            f"layer, `max_loras` {ADAPTERS}; median of {report['repeats']} repeats.\n\n"
            + "\n".join(rows) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    options = parser.parse_args()
    if options.worker:
        worker(json.loads(options.worker))
        return
    sys.path.insert(0, str(REPO / "packages" / "ascend-plugin" / "src"))
    from ascend_plugin.tiny_adapters import ensure_lora_adapter

    adapters = {f"a{i}": str(ensure_lora_adapter(MODEL, rank=RANK, seed=100 + i))
                for i in range(ADAPTERS)}
    results: dict = {stack: {} for stack in STACKS}
    for stack, env in STACKS.items():
        for lora in (True, False):
            print(f"[bench_lora] {stack}, {'LoRA engine' if lora else 'no LoRA'}...",
                  file=sys.stderr, flush=True)
            results[stack].update(run_stack(env, lora, adapters, options))
    report = {"machine": host_machine.describe(), "model": MODEL.name,
              "command": "python benchmarks/bench_lora.py " + " ".join(sys.argv[1:]),
              "max_tokens": options.max_tokens, "repeats": options.repeats,
              "results": results}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora_decode.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report)
    (RESULTS / "lora_decode.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
