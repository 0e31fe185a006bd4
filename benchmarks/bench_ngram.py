"""The n-gram proposer: ours (batched numpy) against vLLM's ``NgramProposer`` (numba), one run.

vLLM's own benchmark setting (benchmarks/benchmark_ngram_proposer.py, batched mode): 128
requests of 1500 tokens drawn uniformly from a vocabulary of 20, prompt_lookup_min 3,
prompt_lookup_max 5, 7, 10, 15, 20, 3 speculative tokens. Both proposers get the same arrays
through the same call (``propose(k, sampled_token_ids, num_tokens_no_spec, token_ids_cpu)``, as
vLLM's model runner calls it) and must return the same drafts. vLLM's numba kernel is compiled
before timing (its constructor runs one warm-up batch; one more untimed call follows here), and
so is ours (one untimed call). Times are medians of ``--iterations`` calls.

A second workload, periodic histories (each request repeats a random period of 2..8 tokens),
is where the candidate filtering of ours does the most work: every earlier place of the last
token extends up to max_n tokens.

    python benchmarks/bench_ngram.py [--iterations 50] [--quick]

Results: ``benchmarks/results/ngram.json`` and ``ngram.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"


def vllm_config(min_n, max_n, k, max_model_len, max_num_seqs):
    # What both proposers read of vLLM's config.
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="ngram", prompt_lookup_min=min_n,
                                           prompt_lookup_max=max_n, num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def workload(kind, num_req, num_token, vocab, k, seed=0):
    rng = np.random.default_rng(seed)
    width = num_token + k
    if kind == "uniform":
        token_ids = rng.integers(0, vocab, size=(num_req, width))
    else:
        token_ids = np.stack([np.resize(rng.integers(0, vocab, size=int(rng.integers(2, 9))),
                                        width) for _ in range(num_req)])
    num_tokens = np.full(num_req, num_token, dtype=np.int32)
    return [[0]] * num_req, num_tokens, token_ids.astype(np.int32)


def median_us(fn, iterations):
    times = []
    for _ in range(iterations):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-req", type=int, default=128)
    parser.add_argument("--num-token", type=int, default=1500)
    parser.add_argument("--vocab", type=int, default=20)
    parser.add_argument("--min-n", type=int, default=3)
    parser.add_argument("--max-n", type=int, nargs="+", default=[5, 7, 10, 15, 20])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="few iterations, no files written")
    args = parser.parse_args()
    iterations = 5 if args.quick else args.iterations

    from vllm.v1.spec_decode.ngram_proposer import NgramProposer

    from ascend_specdec.vllm.ngram_proposer import AscendNgramProposer

    rows = []
    for kind in ("uniform", "periodic"):
        batch = workload(kind, args.num_req, args.num_token, args.vocab, args.k)
        for max_n in args.max_n:
            config = vllm_config(args.min_n, max_n, args.k, args.num_token + args.k,
                                 args.num_req)
            theirs = NgramProposer(config)  # compiles and warms its numba kernel
            ours = AscendNgramProposer(config)
            their_drafts = theirs.propose(args.k, *batch)  # one more untimed call each
            our_drafts = ours.propose(args.k, *batch)
            vllm_us = median_us(lambda p=theirs, b=batch: p.propose(args.k, *b), iterations)
            ours_us = median_us(lambda p=ours, b=batch: p.propose(args.k, *b), iterations)
            row = {"workload": kind, "max_n": max_n, "vllm_us": round(vllm_us, 1),
                   "ours_us": round(ours_us, 1), "speedup": round(vllm_us / ours_us, 2),
                   "same_drafts": our_drafts == their_drafts,
                   "requests_with_drafts": sum(1 for d in our_drafts if d)}
            rows.append(row)
            print(json.dumps(row), flush=True)

    result = {
        "machine": host_machine.describe(),
        "setting": {"num_req": args.num_req, "num_token": args.num_token, "vocab": args.vocab,
                    "min_n": args.min_n, "k": args.k, "iterations": iterations},
        "rows": rows,
    }
    if args.quick:
        return
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ngram.json").write_text(json.dumps(result, indent=2) + "\n")
    setting = result["setting"]
    lines = [
        "# N-gram proposer: ours (batched numpy) against vLLM's NgramProposer (numba)",
        "",
        f"Machine: {result['machine']}",
        "",
        f"{setting['num_req']} requests x {setting['num_token']} tokens, vocabulary "
        f"{setting['vocab']}, min_n {setting['min_n']}, k {setting['k']}; one propose() call "
        f"for the whole batch, median of {setting['iterations']}; numba compiled and warmed "
        "before timing. 'uniform' is vLLM's own benchmark setting; 'periodic' repeats a random "
        "period of 2..8 tokens per request.",
        "",
        "| workload | max_n | vLLM (us) | ours (us) | vLLM / ours | same drafts | requests "
        "with a draft |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(f"| {row['workload']} | {row['max_n']} | {row['vllm_us']:.0f} | "
                     f"{row['ours_us']:.0f} | {row['speedup']:.2f}x | "
                     f"{'yes' if row['same_drafts'] else 'NO'} | {row['requests_with_drafts']} |")
    (RESULTS / "ngram.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
