"""Medusa tree verification against chain verification: decode tokens/s on the host target.

One run, side by side, on the trained demo model (pycoder-26m, bfloat16) and its committed
Medusa heads (3 heads), prompted with held-out text of the model's corpus:

- no speculation (the plugin's host target, and stock vLLM),
- chain Medusa, k = 3 (ours, and stock vLLM's proposer on the same heads),
- tree Medusa (ours) at several node budgets: ``medusa_tree_config`` ``auto`` with
  ``num_speculative_tokens`` the budget, i.e. the tree of that many nodes that accepted the
  most tokens on the heads' own measured continuations (``medusa_paths.json``, written by
  ``python -m ascend_specdec.train_medusa --measure-paths``; the benchmark's prompts are
  the other half of the held-out files),

at batch 1 and batch 8: decode tokens/s (``batch * (N - 1) / (t(N) - t(1))``, medians of
``--repeats``), mean acceptance length from vLLM's counters, ratios to no speculation and to
our chain, and whether every greedy request equals no speculation. Each configuration runs
in its own process through ``bench_specdec``'s worker.

Results: ``benchmarks/results/medusa_tree.json`` and ``medusa_tree.md``.

    python benchmarks/bench_medusa_tree.py [--nodes 8,16,32] [--repeats 3] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import bench_specdec as bench  # beside this script

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="8,16,32", help="tree node budgets")
    parser.add_argument("--k", type=int, default=3, help="chain draft tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", default="medusa_tree")
    parser.add_argument("--pairs", type=int, default=0,
                        help="only measure chain against the tree of --pair-nodes at batch 1, "
                             "alternating N times (A B A B: this machine's load drifts), and "
                             "add the per-pair ratios to the stored result")
    parser.add_argument("--pair-nodes", type=int, default=8)
    options = parser.parse_args()
    budgets = [int(n) for n in options.nodes.split(",") if n.strip()]
    if options.pairs:
        return measure_pairs(options)

    from ascend_plugin.demo_model import demo_medusa_dir, demo_model_dir, held_out_prompts

    base, heads = str(demo_model_dir()), str(demo_medusa_dir())
    measured = json.loads((Path(heads) / "medusa_paths.json").read_text())
    prompts = held_out_prompts()
    started = time.monotonic()
    load_at_start = bench.load_average()

    def config(name, stack, spec=None, llm=None):
        # The plain runs record each position's top-2 logprob gap: where a bfloat16 run
        # parts from them, the gap there says whether it was a near-tie.
        return {"name": name, "method": name, "stack": stack, "target": "pycoder-26m",
                "model": base, "spec": spec, "prompts": prompts, "llm": llm or {},
                "top2_gaps": spec is None}

    chain = {"method": "medusa", "model": heads, "num_speculative_tokens": options.k}
    configs = [config("no speculation", bench.PLUGIN), config("no speculation", bench.STOCK),
               config(f"chain k={options.k}", bench.PLUGIN, chain),
               config(f"chain k={options.k}", bench.STOCK, chain)]
    for nodes in budgets:
        configs.append(config(f"tree {nodes} nodes", bench.PLUGIN,
                              {**chain, "num_speculative_tokens": nodes},
                              {"additional_config": {"medusa_tree_config": {"auto": True}}}))
    results = [bench.run_config(c, options) for c in configs]

    def find(name, stack):
        return next(r for r in results if r["name"] == name and r["stack"] == stack)

    rows = []
    for result in results:
        if "error" in result:
            rows.append({"name": result["name"], "stack": result["stack"],
                         "error": result["error"]})
            continue
        base_run = find("no speculation", result["stack"])
        ours_chain = find(f"chain k={options.k}", bench.PLUGIN)
        for batch in bench.BATCHES:
            run = result["runs"][str(batch)]
            plain = base_run["runs"][str(batch)]
            chain_run = None if "error" in ours_chain else ours_chain["runs"][str(batch)]
            rows.append({
                "name": result["name"], "stack": result["stack"], "batch": batch,
                "decode_tokens_per_s": run["decode_tokens_per_s"],
                "vs_no_speculation": run["decode_tokens_per_s"] / plain["decode_tokens_per_s"],
                "vs_our_chain": None if chain_run is None
                else run["decode_tokens_per_s"] / chain_run["decode_tokens_per_s"],
                "acceptance_length": bench.acceptance_length(run["spec_decode"]),
                "accepted_vs_our_chain": None if chain_run is None
                or bench.acceptance_length(chain_run["spec_decode"]) is None
                or bench.acceptance_length(run["spec_decode"]) is None
                else bench.acceptance_length(run["spec_decode"])
                / bench.acceptance_length(chain_run["spec_decode"]),
                "greedy_equal_to_no_speculation": run["token_ids"] == plain["token_ids"],
                "largest_gap_where_parted": max(
                    (gap for gap in bench.gaps_at(bench.first_differences(
                        run["token_ids"], plain["token_ids"]), plain.get("top2_gaps"))
                     if gap is not None), default=None),
            })
    summary = {"machine": bench.machine(), "load_average_start": load_at_start,
               "load_average_end": bench.load_average(), "base": base, "heads": heads,
               "k": options.k, "nodes": budgets, "max_tokens": options.max_tokens,
               "repeats": options.repeats, "dtype": options.dtype,
               "trainer_estimates": {"chain": measured.get("chain_acceptance_length"),
                                     **{f"tree {n}": measured["trees"].get(str(n), {}).get(
                                         "acceptance_length") for n in budgets}},
               "rows": rows, "total_seconds": time.monotonic() - started}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{options.out}.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = markdown(summary)
    (RESULTS / f"{options.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def measure_pairs(options: argparse.Namespace) -> None:
    from ascend_plugin.demo_model import demo_medusa_dir, demo_model_dir, held_out_prompts

    bench.BATCHES = (1,)
    base, heads = str(demo_model_dir()), str(demo_medusa_dir())
    chain = {"method": "medusa", "model": heads, "num_speculative_tokens": options.k}
    tree = {**chain, "num_speculative_tokens": options.pair_nodes}
    common = {"method": "pair", "stack": bench.PLUGIN, "target": "pycoder-26m", "model": base,
              "prompts": held_out_prompts(), "top2_gaps": False}
    pairs = []
    for _ in range(options.pairs):
        runs = [bench.run_config({**common, "name": name, "spec": spec, "llm": llm}, options)
                for name, spec, llm in (
                    (f"chain k={options.k}", chain, {}),
                    (f"tree {options.pair_nodes} nodes", tree,
                     {"additional_config": {"medusa_tree_config": {"auto": True}}}))]
        speeds = [run["runs"]["1"]["decode_tokens_per_s"] for run in runs]
        pairs.append({"chain_tokens_per_s": speeds[0], "tree_tokens_per_s": speeds[1],
                      "ratio": speeds[1] / speeds[0],
                      "load_average_after": runs[1]["load_average_after"]})
    stored = json.loads((RESULTS / f"{options.out}.json").read_text())
    stored["pairs"] = {"nodes": options.pair_nodes, "k": options.k, "batch": 1,
                       "max_tokens": options.max_tokens, "repeats": options.repeats,
                       "runs": pairs,
                       "median_ratio": sorted(p["ratio"] for p in pairs)[len(pairs) // 2]}
    (RESULTS / f"{options.out}.json").write_text(json.dumps(stored, indent=2) + "\n")
    lines = markdown(stored)
    (RESULTS / f"{options.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def _fmt(value, spec=".2f"):
    return "-" if value is None else format(value, spec)


def markdown(summary: dict) -> list[str]:
    lines = [
        "# Medusa tree verification against chains (host target, trained demo model)",
        "",
        f"`python benchmarks/bench_medusa_tree.py` on {summary['machine']}; load average "
        f"{summary['load_average_start']} at the start, {summary['load_average_end']} at the "
        f"end; {summary['dtype']}, {summary['max_tokens']} tokens per request, medians of "
        f"{summary['repeats']} runs, {summary['total_seconds'] / 60:.1f} min in all.",
        "",
        f"Base `{summary['base']}`, heads `{summary['heads']}`. Trees: `medusa_tree_config` "
        "`auto` with `num_speculative_tokens` the node budget. The heads' measured acceptance "
        "lengths (`medusa_paths.json`, on continuations of the other held-out half): "
        + ", ".join(f"{name} {_fmt(value)}"
                    for name, value in summary["trainer_estimates"].items()) + ".",
        "",
        "| configuration | stack | batch | decode tok/s | vs no spec | vs our chain | "
        "accepted / step | accepted vs our chain | greedy equal (largest top-2 gap where "
        "a request parted) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["rows"]:
        if "error" in row:
            lines.append(f"| {row['name']} | {row['stack']} | - | failed: {row['error']} "
                         "| | | | | |")
            continue
        lines.append(
            f"| {row['name']} | {row['stack']} | {row['batch']} | "
            f"{row['decode_tokens_per_s']:.1f} | {row['vs_no_speculation']:.2f}x | "
            f"{_fmt(row['vs_our_chain'])}x | {_fmt(row['acceptance_length'])} | "
            f"{_fmt(row['accepted_vs_our_chain'])}x | "
            + ("yes |" if row["greedy_equal_to_no_speculation"]
               else f"no ({_fmt(row['largest_gap_where_parted'], '.3f')}) |"))
    pairs = summary.get("pairs")
    if pairs:
        ratios = ", ".join(f"{p['ratio']:.2f}" for p in pairs["runs"])
        lines += [
            "",
            f"Paired at batch 1 (`--pairs {len(pairs['runs'])} --pair-nodes {pairs['nodes']}`:"
            f" chain k={pairs['k']} and the {pairs['nodes']}-node tree in alternating "
            "processes, each the median of its repeats): tree / chain decode tokens/s per "
            f"pair {ratios}; median {pairs['median_ratio']:.2f}.",
        ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
