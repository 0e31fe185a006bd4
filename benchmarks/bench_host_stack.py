"""The plugin's host stack against stock vLLM without speculation: decode tokens/s.

Issue 14, item 5: the host target must not be slower than stock vLLM on the CPU. Both
stacks serve the trained demo model (pycoder-26m, bfloat16, eager, greedy, 128 tokens,
prompts from its held-out files) at batch 1 and 8, each run in its own process through
``bench_specdec``'s worker (decode tokens/s = batch x (N - 1) / (t(N) - t(1)), medians of
``--repeats`` generations). The machine is shared and its speed drifts, so the two stacks
run in pairs, back to back, alternating which goes first, and each pair gives a ratio;
the table quotes the median ratio with its range.

    python benchmarks/bench_host_stack.py [--pairs 4] [--repeats 3]

Results: ``benchmarks/results/host_stack.json`` and ``host_stack.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench_specdec import BATCHES, PLUGIN, STOCK, load_average, run_config

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"


def markdown(summary: dict) -> str:
    lines = ["# The host stack against stock vLLM, no speculation: decode tokens/s", "",
             f"Machine: {summary['machine']} (load average {summary['load_average'][0]:.2f} "
             f"at the start, {summary['load_average_end'][0]:.2f} at the end).", "",
             "Model: the trained demo model pycoder-26m (26M parameters, bfloat16), eager, "
             f"greedy, {summary['max_tokens']} tokens per request, prompts from its held-out "
             "files. Each stack runs in its own process; the two run in pairs back to back "
             f"({summary['pairs']} pairs, alternating which goes first), and each pair gives "
             "the ratio plugin / stock. The host's custom-op classes (RMSNorm, rotary "
             "embedding but for 3-D inputs, SiluAndMul) run vLLM's own CPU code; before they "
             "ran ascend-kernels' reference, which read 0.93x stock at batch 1 "
             "(`specdec_decode.md`).", "",
             "| batch | stock tok/s (median) | plugin tok/s (median) | plugin / stock, median "
             "of pairs | range over pairs | greedy tokens equal |",
             "|---|---|---|---|---|---|"]
    for batch in map(str, BATCHES):
        row = summary["batches"][batch]
        lines.append(f"| {batch} | {row['stock_median']:.1f} | {row['plugin_median']:.1f} | "
                     f"{row['ratio_median']:.2f}x | {min(row['ratios']):.2f}-"
                     f"{max(row['ratios']):.2f}x | {'yes' if row['tokens_equal'] else 'NO'} |")
    verdicts = []
    for batch in map(str, BATCHES):
        ratios = summary["batches"][batch]["ratios"]
        below = sum(r < 1.0 for r in ratios)
        slower = summary["batches"][batch]["ratio_median"] < 1.0 and below > len(ratios) / 2
        verdicts.append(f"batch {batch}: {below} of {len(ratios)} pairs below 1.00, "
                        + ("slower" if slower else "not slower"))
    lines += ["", "Goal (issue 14, item 5): the plugin not slower than stock at batch 1 and 8. "
              "The pairs scatter with the machine's load, so a stack counts as slower when "
              "its median ratio is below 1.00 and more than half of the pairs are: "
              + "; ".join(verdicts) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations (median)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--render", action="store_true",
                        help="rewrite host_stack.md from the stored host_stack.json")
    options = parser.parse_args()
    if options.render:
        summary = json.loads((RESULTS / "host_stack.json").read_text())
        (RESULTS / "host_stack.md").write_text(markdown(summary))
        return
    from ascend_plugin.demo_model import demo_model_dir, held_out_prompts

    # What run_config reads of the options.
    options.dtype, options.max_model_len = "bfloat16", 512
    model, prompts = str(demo_model_dir()), held_out_prompts()
    configs = {stack: {"name": "no speculation", "method": None, "stack": stack,
                       "target": "Llama", "model": model, "spec": None, "prompts": prompts,
                       "top2_gaps": False}
               for stack in (STOCK, PLUGIN)}
    summary = {"machine": host_machine.describe(), "load_average": load_average(),
               "pairs": options.pairs, "repeats": options.repeats,
               "max_tokens": options.max_tokens, "runs": []}
    started = time.monotonic()
    for pair in range(options.pairs):
        order = (STOCK, PLUGIN) if pair % 2 == 0 else (PLUGIN, STOCK)
        runs = {stack: run_config(configs[stack], options) for stack in order}
        for stack, result in runs.items():
            if "error" in result:
                raise SystemExit(f"{stack} failed: {result['error']}")
        summary["runs"].append({stack: result["runs"] for stack, result in runs.items()})
        print(f"[bench_host_stack] pair {pair + 1}/{options.pairs}: " + ", ".join(
            f"batch {b} plugin/stock {runs[PLUGIN]['runs'][str(b)]['decode_tokens_per_s'] / runs[STOCK]['runs'][str(b)]['decode_tokens_per_s']:.2f}"  # noqa: E501
            for b in BATCHES) + f" ({time.monotonic() - started:.0f} s)", file=sys.stderr,
            flush=True)
    summary["batches"] = {}
    for batch in map(str, BATCHES):
        speeds = {stack: [run[stack][batch]["decode_tokens_per_s"] for run in summary["runs"]]
                  for stack in (STOCK, PLUGIN)}
        ratios = [p / s for p, s in zip(speeds[PLUGIN], speeds[STOCK], strict=True)]
        summary["batches"][batch] = {
            "stock_median": statistics.median(speeds[STOCK]),
            "plugin_median": statistics.median(speeds[PLUGIN]),
            "ratios": ratios, "ratio_median": statistics.median(ratios),
            "tokens_equal": all(run[STOCK][batch]["token_ids"] == run[PLUGIN][batch]["token_ids"]
                                for run in summary["runs"])}
    for run in summary["runs"]:  # compared above; the tokens themselves are not kept
        for stack in run.values():
            for batch in stack.values():
                batch.pop("token_ids", None)
    summary["load_average_end"] = load_average()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "host_stack.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (RESULTS / "host_stack.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
