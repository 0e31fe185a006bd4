"""Speculative decoding on the host target: decode tokens/s, our plugin against stock vLLM.

One run, side by side, on one base model and one set of Medusa heads:

- no speculation (stock vLLM, and the plugin's host target),
- n-gram (vLLM's proposer through the plugin's model runner),
- Medusa: our proposer (plugin) and stock vLLM's ``MedusaProposer``, same heads folder,

each at batch 1 and batch 8, as ratios to no speculation on the same stack, plus ours against
stock Medusa end to end, and the two Medusa proposers alone (our heads' ``propose`` against
vLLM's ``Medusa`` model loaded from the same folder, in one process). Decode tokens/s is
``batch * (N - 1) / (t(N) - t(1))``: greedy generations of N and 1 tokens, so prefill cancels
out. Acceptance comes from vLLM's own counters (``LLM.get_metrics()``), over the timed
generations only; times are medians of ``--repeats`` runs.

The base model is a random Llama from ``ascend_plugin.tiny_models`` (default: hidden 1024,
9 layers, 106M parameters, bfloat16: a decode step reads about 210 MB of weights). Its
``initializer_range`` (0.0006) puts it in the regime where the token embedding dominates the
residual stream and greedy continuations become a learnable walk; at the demo's 0.2 the model
is chaotic and no draft head can predict it. The heads are self-distilled with
``ascend_specdec.medusa.ensure_medusa_heads`` (one LM head shared by all heads, initialised from
the base model's, so the heads add about 5% to a step's weights), cached between runs.

Each configuration runs in its own process (vLLM picks its platform once per process).
Results: ``benchmarks/results/specdec_decode.json`` and ``specdec_decode.md``.

    python benchmarks/bench_specdec.py [--quick] [--max-tokens 128] [--samples 600] ...
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Copyright (c) 2001 Python Software Foundation",
    "Permission is hereby granted",
    "import os\nimport sys\n",
    "Hello, my name is",
    "In the beginning",
    "for i in range(10):",
]
BATCHES = (1, 8)
STOCK, PLUGIN = "stock vLLM", "plugin (host target)"


# ------------------------------------------------------------------ worker (one vLLM process)


def spec_counters(llm) -> dict:
    totals: dict = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            if hasattr(metric, "values"):
                old = totals.get(metric.name, [0] * len(metric.values))
                totals[metric.name] = [a + b for a, b in zip(old, metric.values, strict=True)]
            else:
                totals[metric.name] = totals.get(metric.name, 0) + metric.value
    return totals


def counter_delta(after: dict, before: dict) -> dict:
    delta = {}
    for name, value in after.items():
        old = before.get(name)
        if isinstance(value, list):
            delta[name] = [a - b for a, b in zip(value, old or [0] * len(value), strict=True)]
        else:
            delta[name] = value - (old or 0)
    return delta


def worker(args: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["model"], dtype=args["dtype"], max_model_len=args["max_model_len"],
              enforce_eager=True, seed=0, disable_log_stats=False,
              gpu_memory_utilization=0.05, **args.get("llm", {}))
    runs = {}
    for batch in args["batches"]:
        prompts = PROMPTS[:batch]

        def generate(n: int, prompts=prompts):
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start, outputs

        generate(8)  # warm-up
        before = spec_counters(llm)
        # Medians of several repeats: the machine may be shared.
        t_one = statistics.median(generate(1)[0] for _ in range(args["repeats"]))
        timed = [generate(args["max_tokens"]) for _ in range(args["repeats"])]
        t_all = statistics.median(t for t, _ in timed)
        outputs = timed[-1][1]
        counters = counter_delta(spec_counters(llm), before)
        runs[str(batch)] = {
            "seconds_1": t_one,
            "seconds_n": t_all,
            "seconds_n_all": [t for t, _ in timed],
            "decode_tokens_per_s": batch * (args["max_tokens"] - 1) / (t_all - t_one),
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
            "spec_decode": counters,
        }
    return {"runs": runs}


def proposer_worker(args: dict) -> dict:
    """Our heads' propose() against vLLM's Medusa model on the same checkpoint, in-process."""
    import socket
    from types import SimpleNamespace

    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models.medusa import Medusa
    from vllm.transformers_utils.configs.medusa import MedusaConfig

    from ascend_specdec.medusa import load_heads
    from ascend_specdec.medusa.checkpoint import iter_safetensors

    dtype = getattr(torch, args["dtype"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
        hf_config = MedusaConfig.from_pretrained(args["heads"])
        torch.set_default_dtype(dtype)  # vLLM builds its layers in the model's dtype
        theirs = Medusa(vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(
            draft_model_config=SimpleNamespace(hf_config=hf_config))))
        theirs.load_weights(iter_safetensors(args["heads"]))
        torch.set_default_dtype(torch.float32)
        for module in theirs.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
        ours = load_heads(args["heads"], dtype=dtype)

        def vllms(hidden):
            logits = theirs.compute_logits(theirs(hidden))
            return torch.stack([head.argmax(-1) for head in logits], dim=1)

        out = {}
        generator = torch.Generator().manual_seed(0)
        for batch in args["batches"]:
            hidden = torch.randn(batch, hf_config.hidden_size, generator=generator).to(dtype)
            row = {}
            with torch.inference_mode():
                row["same_drafts"] = bool(torch.equal(vllms(hidden), ours.propose(hidden)))
                for name, fn in (("vllm_ms", vllms), ("ours_ms", ours.propose)):
                    for _ in range(20):
                        fn(hidden)
                    times = []
                    for _ in range(200):
                        start = time.perf_counter()
                        fn(hidden)
                        times.append(time.perf_counter() - start)
                    row[name] = 1000 * statistics.median(times)
            out[str(batch)] = row
    return out


# ------------------------------------------------------------------ driver


def run_config(name: str, stack: str, model: str, options: argparse.Namespace,
               llm: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"})
    if stack == PLUGIN:
        env["VLLM_ASCEND_TARGET"] = "host"
    args = {"model": model, "dtype": options.dtype, "max_model_len": options.max_model_len,
            "max_tokens": options.max_tokens, "batches": list(BATCHES), "llm": llm or {},
            "repeats": options.repeats}
    print(f"[bench_specdec] {name} ({stack})...", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=options.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
            result.update(name=name, stack=stack, wall_s=time.monotonic() - started)
            return result
    raise RuntimeError(f"{name} ({stack}) failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def first_differences(tokens: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per request, the first position where the tokens differ from the reference (or None)."""
    out = []
    for mine, theirs in zip(tokens, reference, strict=True):
        diff = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
        out.append(diff[0] if diff else None)
    return out


def run_proposers(heads: str, options: argparse.Namespace) -> dict:
    args = {"heads": heads, "dtype": options.dtype, "batches": list(BATCHES)}
    print("[bench_specdec] proposers alone...", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, __file__, "--proposer-worker", json.dumps(args)],
                          capture_output=True, text=True, timeout=options.timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"proposer comparison failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def acceptance_length(counters: dict) -> float | None:
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    if not drafts:
        return None
    return 1 + counters["vllm:spec_decode_num_accepted_tokens"] / drafts


def count_parameters(folder: Path) -> int:
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (not a mapping)
                if name != "token_map":
                    total += math.prod(reader.get_slice(name).get_shape())
    return total


def machine() -> str:
    return host_machine.describe()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--proposer-worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="a 2-layer base model and few training samples (smoke test)")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--initializer-range", type=float, default=0.0006)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=3, help="speculative tokens (all methods)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations (median)")
    parser.add_argument("--timeout", type=float, default=1800)
    options = parser.parse_args()
    if options.worker:
        print("RESULT " + json.dumps(worker(json.loads(options.worker))), flush=True)
        return
    if options.proposer_worker:
        print("RESULT " + json.dumps(proposer_worker(json.loads(options.proposer_worker))),
              flush=True)
        return
    if options.quick:
        options.layers, options.samples, options.steps, options.max_tokens = 2, 64, 100, 32

    from ascend_plugin.tiny_models import ensure_model
    from ascend_specdec.medusa import TrainOptions, ensure_medusa_heads

    started = time.monotonic()
    heads_count = options.hidden_size // 64
    base_args = dict(hidden_size=options.hidden_size, num_layers=options.layers,
                     num_heads=heads_count, num_kv_heads=max(1, heads_count // 4),
                     intermediate_size=options.hidden_size * 11 // 4, dtype=options.dtype,
                     initializer_range=options.initializer_range)
    base = str(ensure_model("llama", **base_args))
    train = TrainOptions(heads=options.k, samples=options.samples, steps=options.steps,
                         continuation_tokens=min(options.max_tokens, 64), share_lm_head=True,
                         batch_size=128, generation_batch=64, seed=0)
    trained = time.monotonic()
    heads = str(ensure_medusa_heads(base, train))
    trained = time.monotonic() - trained
    report = json.loads((Path(heads) / "training.json").read_text())

    medusa = {"method": "medusa", "model": heads, "num_speculative_tokens": options.k}
    ngram = {"method": "ngram", "num_speculative_tokens": options.k, "prompt_lookup_min": 2,
             "prompt_lookup_max": 4}
    configs = [
        ("no speculation", STOCK, None),
        ("no speculation", PLUGIN, None),
        ("n-gram", PLUGIN, {"speculative_config": ngram}),
        ("Medusa (ours)", PLUGIN, {"speculative_config": medusa}),
        ("Medusa (vLLM's)", STOCK, {"speculative_config": medusa}),
    ]
    results = [run_config(name, stack, base, options, llm) for name, stack, llm in configs]
    proposer_only = run_proposers(heads, options)

    def find(name, stack):
        return next(r for r in results if r["name"] == name and r["stack"] == stack)

    rows = []
    for result in results:
        baseline = find("no speculation", result["stack"])
        for batch in BATCHES:
            run = result["runs"][str(batch)]
            base_run = baseline["runs"][str(batch)]
            rows.append({
                "method": result["name"], "stack": result["stack"], "batch": batch,
                "decode_tokens_per_s": run["decode_tokens_per_s"],
                "vs_no_speculation": run["decode_tokens_per_s"]
                / base_run["decode_tokens_per_s"],
                "acceptance_length": acceptance_length(run["spec_decode"]),
                "drafts": run["spec_decode"].get("vllm:spec_decode_num_drafts", 0),
                "greedy_equal_to_no_speculation": run["token_ids"] == base_run["token_ids"],
                "first_difference": first_differences(run["token_ids"], base_run["token_ids"]),
            })
    ours_vs_stock = {
        str(batch): find("Medusa (ours)", PLUGIN)["runs"][str(batch)]["decode_tokens_per_s"]
        / find("Medusa (vLLM's)", STOCK)["runs"][str(batch)]["decode_tokens_per_s"]
        for batch in BATCHES
    }
    base_params = count_parameters(Path(base))
    head_params = count_parameters(Path(heads))
    vocab = json.loads((Path(base) / "config.json").read_text())["vocab_size"]
    summary = {
        "machine": machine(),
        "base_model": {"path": base, "arguments": base_args, "parameters": base_params},
        "medusa_heads": {"path": heads, "parameters": head_params, "train_options":
                         report["options"], "held_out": report["final"],
                         "train_seconds_this_run": trained},
        "k": options.k, "max_tokens": options.max_tokens, "rows": rows,
        "medusa_ours_vs_stock": ours_vs_stock,
        "proposer_alone_ms": proposer_only,
        "configs": [{k: v for k, v in r.items() if k != "runs"}
                    | {"runs": {b: {k: v for k, v in run.items() if k != "token_ids"}
                                for b, run in r["runs"].items()}} for r in results],
        "total_seconds": time.monotonic() - started,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "specdec_decode.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        "# Speculative decoding on the host target: decode tokens/s",
        "",
        f"Machine: {summary['machine']}",
        "",
        f"Base: random Llama, {base_params / 1e6:.0f}M parameters, {options.dtype}, "
        f"hidden {options.hidden_size}, {options.layers} layers, vocabulary "
        f"{vocab}, initializer_range {options.initializer_range}. "
        f"Medusa: {options.k} heads ({head_params / 1e6:.1f}M parameters, one shared LM head), "
        f"self-distilled from {train.samples} greedy continuations, {train.steps} steps; "
        f"held-out acceptance length {report['final']['acceptance_length']:.2f}. "
        f"k = {options.k} for every method; {options.max_tokens} tokens per request; "
        "decode tokens/s = batch x (N - 1) / (t(N) - t(1)).",
        "",
        "| method | stack | batch | decode tok/s | vs no speculation (same stack) "
        "| acceptance length | drafting steps | greedy = no speculation |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        length = row["acceptance_length"]
        same = "yes" if row["greedy_equal_to_no_speculation"] else (
            "no, first differences at " + str([d for d in row["first_difference"]
                                               if d is not None]))
        lines.append(f"| {row['method']} | {row['stack']} | {row['batch']} | "
                     f"{row['decode_tokens_per_s']:.1f} | {row['vs_no_speculation']:.2f}x | "
                     f"{'-' if length is None else f'{length:.2f}'} | {row['drafts']} | "
                     f"{same} |")
    lines += [
        "",
        "Our Medusa against vLLM's Medusa (same heads, each on its own stack): " + ", ".join(
            f"batch {b}: {ratio:.2f}x" for b, ratio in ours_vs_stock.items()),
        "",
        "The proposers alone (one propose() on random hidden states, median of 200, in one "
        "process; vLLM's Medusa model against our heads, same checkpoint): " + ", ".join(
            f"batch {b}: vLLM {r['vllm_ms']:.3f} ms, ours {r['ours_ms']:.3f} ms "
            f"({r['vllm_ms'] / r['ours_ms']:.2f}x), same drafts: {r['same_drafts']}"
            for b, r in proposer_only.items()) + ". The end-to-end gap between the two Medusa "
        "rows follows the gap between the two stacks without speculation.",
        "",
        "Acceptance length = 1 + accepted / drafting steps, from vLLM's counters (n-gram drafts "
        "only where the context repeats, so few steps draft). In bfloat16 the logits of this "
        "model are small (std about 0.02) and near-ties are common: verifying several tokens "
        "at once rounds differently from one-token steps, so a speculative run can leave the "
        "no-speculation path at a tie; in float32 (tests/e2e/test_medusa.py) outputs are equal.",
        "",
    ]
    (RESULTS / "specdec_decode.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
