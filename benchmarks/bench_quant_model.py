"""Quantization quality on the trained demo model: perplexity and top-1 agreement vs bf16.

The way quantization papers report it: every ascend-quant scheme is applied to all linear
layers of pycoder-26m (compressed-tensors checkpoints written by ``ascend_quant.writers``;
the LM head and embeddings stay bf16; static W8A8 is calibrated on the dev half of the
held-out files), each checkpoint is served through the plugin on the host target in bf16, and
on the test half of the held-out files (text the model never saw) we read, for every position,
the log-probability of the true next token (perplexity) and the model's top-1 prediction
(agreement with the bf16 model's top-1 at the same position). One process per checkpoint
(vLLM picks its platform once per process), all in one run.

Results: ``benchmarks/results/quant_model.json`` and ``quant_model.md``.

    python benchmarks/bench_quant_model.py [--texts 24]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"
# label, scheme, group size
SCHEMES = [
    ("W8A8 static (per-tensor act.)", "W8A8", None),
    ("W8A8 dynamic", "W8A8_DYNAMIC", None),
    ("W8A16 channel", "W8A16", None),
    ("W4A16 g128", "W4A16", 128),
    ("W4A8 dynamic channel", "W4A8_DYNAMIC", None),
    ("W4A8 dynamic g128", "W4A8_DYNAMIC", 128),
    ("W4A4 dynamic channel", "W4A4_DYNAMIC", None),
]


def worker(args: dict) -> dict:
    """In its own process: serve one checkpoint, score the texts with prompt logprobs."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["model"], dtype="bfloat16", max_model_len=1024, enforce_eager=True,
              gpu_memory_utilization=0.05, seed=0)
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    started = time.monotonic()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in args["token_ids"]], params,
                           use_tqdm=False)
    seconds = time.monotonic() - started
    true_logprobs, top1 = [], []
    for ids, out in zip(args["token_ids"], outputs, strict=True):
        for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
            true_logprobs.append(entry[ids[position]].logprob)
            top1.append(max(entry.items(), key=lambda kv: kv[1].logprob)[0])
    return {"true_logprobs": true_logprobs, "top1": top1, "seconds": seconds}


def run_worker(model: str, token_ids: list[list[int]]) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump({"model": model, "token_ids": token_ids}, handle)
    env = {**os.environ, "VLLM_ASCEND_TARGET": "host", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--worker", handle.name], env=env,
                          capture_output=True, text=True, timeout=1800)
    os.unlink(handle.name)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"worker for {model} failed (exit {proc.returncode}):\n"
                       f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def texts_to_ids(folder: Path, split: str, count: int, max_tokens: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from ascend_plugin.demo_model import held_out_texts

    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    samples = held_out_texts(folder, split=split)[:count]
    return [tokenizer(s["text"], add_special_tokens=False).input_ids[:max_tokens]
            for s in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--texts", type=int, default=24, help="held-out samples scored")
    parser.add_argument("--max-tokens", type=int, default=384, help="tokens per sample")
    parser.add_argument("--out", default="quant_model")
    options = parser.parse_args()
    if options.worker:
        print("RESULT " + json.dumps(worker(json.loads(Path(options.worker).read_text()))),
              flush=True)
        return

    import torch

    from ascend_plugin.demo_model import demo_model_dir
    from ascend_quant.writers import Group, write_compressed_tensors

    model = demo_model_dir()
    token_ids = texts_to_ids(model, "test", options.texts, options.max_tokens)
    calibration = [ids[:128] for ids in texts_to_ids(model, "dev", 8, 128)]
    calibration_ids = torch.tensor([ids for ids in calibration if len(ids) == 128])
    print(f"[bench_quant_model] {len(token_ids)} held-out texts, "
          f"{sum(len(t) - 1 for t in token_ids)} scored positions", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        runs = [("bf16 (unquantized)", str(model))]
        for label, scheme, group_size in SCHEMES:
            out = Path(tmp) / scheme.lower() / str(group_size)
            write_compressed_tensors(model, out, [Group(r".*_proj", scheme, group_size)],
                                     calibration_ids=calibration_ids)
            runs.append((label, str(out)))
        reference = None
        for label, path in runs:
            result = run_worker(path, token_ids)
            if reference is None:
                reference = result
            nll = -sum(result["true_logprobs"]) / len(result["true_logprobs"])
            pairs = zip(result["top1"], reference["top1"], strict=True)
            agree = sum(a == b for a, b in pairs) / len(result["top1"])
            rows.append({"scheme": label, "perplexity": math.exp(nll), "nll": nll,
                         "top1_agreement_vs_bf16": agree, "seconds": result["seconds"]})
            print(f"[bench_quant_model] {label}: perplexity {math.exp(nll):.3f}, top-1 "
                  f"agreement with bf16 {agree:.4f} ({result['seconds']:.1f} s)", flush=True)
    summary = {"machine": host_machine.describe(), "model": str(model),
               "texts": len(token_ids), "positions": len(reference["top1"]), "rows": rows}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{options.out}.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["# Quantization quality on the trained demo model (pycoder-26m)", "",
             f"Machine: {summary['machine']}", "",
             f"{summary['texts']} samples of the test half of the held-out files, "
             f"{summary['positions']} scored positions, each checkpoint served in bf16 through "
             "the plugin (host target). Perplexity of the true next tokens; top-1 agreement: "
             "share of positions where the scheme's most likely token is the bf16 model's. "
             "All linear layers quantized (compressed-tensors); embeddings and LM head bf16.",
             "", "| scheme | perplexity | vs bf16 | top-1 agreement with bf16 |",
             "|---|---|---|---|"]
    base = rows[0]["perplexity"]
    for row in rows:
        lines.append(f"| {row['scheme']} | {row['perplexity']:.3f} | "
                     f"{row['perplexity'] / base:.3f}x | {row['top1_agreement_vs_bf16']:.4f} |")
    (RESULTS / f"{options.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
