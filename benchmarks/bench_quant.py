"""ascend-quant schemes on the host path: error and speed against bfloat16.

For each scheme, on layers of 4096x4096 and 4096x14336 (in x out) with M = 1, 16, 256
tokens, in one process:

- error: the scheme's output against the dequantized reference (the float64 product of
  the fake-quantized activations and the dequantized weight: what the scheme should
  compute), and against the unquantized bfloat16-rounded layer (the quantization error,
  for context), both as max |diff| / max |reference|;
- speed: median time of the scheme's ``apply`` against ``torch.nn.functional.linear`` on
  the bfloat16 weight, and the ratio. For the int8-activation schemes the time of the int8
  GEMM alone with ``torch._int_mm`` is shown too (what the host could reach if
  ascend-kernels' CPU path of ``scaled_int8_mm`` used it).

Weights are quantized with the compressed-tensors library (``ascend_quant.export``).
Results: ``benchmarks/results/quant.json`` and ``quant.md``.

    python benchmarks/bench_quant.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from ascend_quant.export import ActivationStats, ct_format, ct_scheme, export_compressed_tensors
from ascend_quant.formats.compressed_tensors import classify
from ascend_quant.lookup import scheme_class
from ascend_quant.quantize import quantize_per_token, quantize_static
from ascend_quant.schemes import LayerShapes

import host_machine  # beside this script

RESULTS = Path(__file__).parent / "results"
SHAPES = [(4096, 4096), (4096, 14336)]
TOKENS = [1, 16, 256]
# name, options for ct_scheme, label
SCHEMES = [
    ("W8A8", {}, "W8A8 static"),
    ("W8A8_DYNAMIC", {}, "W8A8 dynamic"),
    ("W8A16", {}, "W8A16 channel"),
    ("W4A16", {"group_size": 128}, "W4A16 g128"),
    ("W4A8_DYNAMIC", {}, "W4A8 dynamic channel"),
    ("W4A8_DYNAMIC", {"group_size": 128}, "W4A8 dynamic g128"),
    ("W4A4_DYNAMIC", {}, "W4A4 dynamic channel"),
]
INT8_ACTIVATIONS = ("W8A8", "W8A8_DYNAMIC", "W4A8_DYNAMIC", "W4A4_DYNAMIC")


def timed(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def fake_quant(name: str, x: torch.Tensor, tensors: dict) -> torch.Tensor:
    if name in ("W8A16", "W4A16"):
        return x.double()
    if name == "W8A8":
        scale = tensors["input_scale"].float()
        return quantize_static(x, scale, None).double() * float(scale)
    q, s = quantize_per_token(x, 4 if name == "W4A4_DYNAMIC" else 8)
    return q.double() * s.double().unsqueeze(-1)


def reps_for(m: int, n: int, quick: bool) -> int:
    work = m * n
    if quick:
        return 2
    return 10 if work <= 16 * 4096 else 5 if work <= 16 * 14336 else 3


def bench(quick: bool) -> list[dict]:
    rows = []
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        weight = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
        xs = {m: torch.randn(m, k, generator=g).to(torch.bfloat16) for m in TOKENS}
        bf16_ms = {m: timed(lambda x=xs[m], w=weight: torch.nn.functional.linear(x, w),
                            reps_for(m, n, quick)) for m in TOKENS}
        for name, opts, label in SCHEMES:
            scheme_args = ct_scheme(name, ["Linear"], **opts)
            fmt = ct_format(name)
            stats = ActivationStats(-5.0, 5.0)
            tensors = export_compressed_tensors(scheme_args, fmt, weight.float(), stats)
            choice = classify(scheme_args, fmt, label)
            scheme = scheme_class(choice.name, choice.options.layout, label)(
                choice.options, label)
            wanted = {s.name for s in scheme.checkpoint_params(n, k)}
            runtime = scheme.process({a: b for a, b in tensors.items() if a in wanted},
                                     LayerShapes([n], k))
            ref_weight = scheme.dequantized_weight(runtime).double()
            for m in TOKENS:
                x = xs[m]
                y = scheme.apply(runtime, x).double()
                y_ref = fake_quant(name, x.float(), tensors) @ ref_weight.t()
                y_float = x.double() @ weight.double().t()
                reps = reps_for(m, n, quick)
                ms = timed(lambda x=x, op=scheme, w=runtime: op.apply(w, x), reps)
                row = {
                    "scheme": label, "name": name, "k": k, "n": n, "m": m,
                    "err_vs_dequant_ref": ((y - y_ref).abs().max()
                                           / y_ref.abs().max()).item(),
                    "err_vs_float": ((y - y_float).abs().max() / y_float.abs().max()).item(),
                    "ms": ms, "bf16_ms": bf16_ms[m], "speed_vs_bf16": bf16_ms[m] / ms,
                }
                if name in INT8_ACTIVATIONS:
                    a = torch.randint(-127, 127, (m, k), dtype=torch.int8)
                    b = torch.randint(-127, 127, (k, n), dtype=torch.int8)
                    row["int_mm_ms"] = timed(lambda a=a, b=b: torch._int_mm(a, b), reps)
                rows.append(row)
                print(f"{label:22s} {k}x{n} M={m:3d}: {ms:8.2f} ms (bf16 {bf16_ms[m]:7.2f} ms,"
                      f" x{row['speed_vs_bf16']:.2f}) err vs ref {row['err_vs_dequant_ref']:.2e}"
                      f" vs float {row['err_vs_float']:.2e}", flush=True)
    return rows


def machine() -> str:
    return host_machine.describe()


def markdown(rows: list[dict], where: str) -> str:
    lines = [f"# ascend-quant host path vs bfloat16\n\nMachine: {where}\n",
             "Error: max |diff| / max |reference|. Speed: bf16 time / scheme time "
             "(> 1 is faster than bf16).\n",
             "| scheme | in x out | M | ms | bf16 ms | speed vs bf16 | int8 GEMM alone "
             "(torch._int_mm) ms | err vs dequantized ref | err vs float |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        int_mm = f"{r['int_mm_ms']:.2f}" if "int_mm_ms" in r else "-"
        lines.append(f"| {r['scheme']} | {r['k']}x{r['n']} | {r['m']} | {r['ms']:.2f} | "
                     f"{r['bf16_ms']:.2f} | {r['speed_vs_bf16']:.2f} | {int_mm} | "
                     f"{r['err_vs_dequant_ref']:.1e} | {r['err_vs_float']:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions per point")
    args = parser.parse_args()
    where = machine()
    print(where)
    rows = bench(args.quick)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "quant.json").write_text(json.dumps({"machine": where, "rows": rows},
                                                   indent=2) + "\n")
    (RESULTS / "quant.md").write_text(markdown(rows, where))
    print(f"wrote {RESULTS / 'quant.json'} and {RESULTS / 'quant.md'}")


if __name__ == "__main__":
    main()
