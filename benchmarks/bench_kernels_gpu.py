"""ascend-kernels' Triton ops on a CUDA GPU against torch eager and torch.compile.

For each memory-bound op (rms_norm, add_rms_norm, silu_and_mul, neox rotary_embedding,
l2norm, dynamic_per_token_quant, add_rms_norm_quant) at tokens {1, 64, 4096, 32768} x hidden
{4096, 8192} in bfloat16, the script

1. checks the Triton op against the torch reference and stops with an error if they differ;
2. times, side by side in this process, the Triton op (the public op with
   ``backend="triton"``, Python dispatch included), the reference in eager mode and
   ``torch.compile`` of the reference: above 64 tokens the median time per call of
   CUDA-graph replays, each call on its own copy of the inputs (the copies together three
   times the L2 cache, so no call finds its inputs cached; ``--timer do_bench`` instead
   uses ``triton.testing.do_bench``, which empties the L2 before every rep); at 64 tokens
   or fewer, where every variant is bound by launch latency, the median per-call time of
   back-to-back calls (what an eager decode step pays), best of three interleaved rounds;
3. converts times to achieved bandwidth from the minimal bytes each op must move (every
   input read once, every output written once) and reports it as a fraction of the card's
   device-to-device copy bandwidth, measured in the same run (``dst.copy_(src)`` of 1 GiB);
4. writes ``kernels_gpu.json`` and ``kernels_gpu.md`` (with the GPU's name and the torch and
   Triton versions) into ``--out`` (default ``benchmarks/results``).

gated_delta_rule (Qwen3-Next's gated delta-net attention) runs decode batches of ``tokens``
sequences, one token each, 16 query / key heads and ``hidden / 128`` value heads of 128, its
float32 state cache read and written in place; its stored run is
``benchmarks/results/kernels_gpu_gdn.*`` (``--ops gated_delta_rule --tokens 1,64,256,1024``).

gated_delta_rule_verify (its speculative-verification form) runs batches of ``tokens``
sequences of 3 tokens each (a token and 2 MTP drafts), each sequence resuming from the second
of its 3 state slots and writing the state after each token to its own slot; its stored run
is ``benchmarks/results/kernels_gpu_gdn_verify.*`` (``--ops gated_delta_rule_verify --out
DIR``, the files renamed).

causal_conv1d_update (the short convolution in front of those heads: their q, k and v
channels, width 4, SiLU) runs the same decode batches over vLLM's conv state cache layout
(``[slots, 3, channels]`` viewed as ``[slots, channels, 3]``); its stored run is
``benchmarks/results/kernels_gpu_conv.*`` (``--ops causal_conv1d_update --out DIR``, the files
renamed).

mrope (multimodal RoPE, Qwen2.5-VL's T / H / W sections 16 / 24 / 24 of 128-wide heads, the
heads of rotary_embedding, ``[3, tokens]`` positions) has its stored run in
``benchmarks/results/kernels_gpu_mrope.*`` (``--ops mrope --out DIR``, the files renamed).

The multi-LoRA ops (lora_shrink, lora_expand) run a batch spread over 4 adapter slots of rank
16 and no adapter (token t in slot ``t % 5 - 1``, -1 = none): shrink ``[tokens, hidden]`` to a
float32 ``[tokens, 16]``, expand that back into ``[tokens, hidden]`` (added in place); their
bytes are the activations, the used slots' weights and the outputs. Their stored run is
``benchmarks/results/kernels_gpu_lora.*`` (``--ops lora_shrink,lora_expand --out DIR``, the
files renamed).

Shapes: ``hidden`` is the row width of the norms and quant ops; silu_and_mul reads
``[tokens, 2 * hidden]`` and writes ``[tokens, hidden]``; rotary_embedding rotates 32 query
+ 8 key heads of 128 at hidden 4096 and 64 + 8 at 8192 (out of place, whole heads, a
bfloat16 cos/sin cache).

Needs torch with CUDA and Triton; neither vLLM nor an installed ascend-kernels (the script
puts ``packages/ascend-kernels/src`` on ``sys.path``). Run from anywhere:

    python benchmarks/bench_kernels_gpu.py                 # the full grid
    python benchmarks/bench_kernels_gpu.py --quick         # a fast subset
    python benchmarks/bench_kernels_gpu.py --ops rms_norm,rotary_embedding --tokens 4096
    python benchmarks/bench_kernels_gpu.py --dry-run-cpu   # correctness only, CPU interpreter

Without a CUDA device (and without ``--dry-run-cpu``) it says so and exits 0, so that a
bench session on a CPU machine passes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KERNELS_SRC = REPO / "packages" / "ascend-kernels" / "src"
DEFAULT_OUT = REPO / "benchmarks" / "results"

FULL_TOKENS = (1, 64, 4096, 32768)
FULL_HIDDEN = (4096, 8192)
QUICK_TOKENS = (1, 4096)
QUICK_HIDDEN = (4096,)
DRY_TOKENS = (1, 3)
DRY_HIDDEN = (64, 96)
OPS = ("rms_norm", "add_rms_norm", "silu_and_mul", "rotary_embedding", "l2norm",
       "dynamic_per_token_quant", "add_rms_norm_quant", "lora_shrink", "lora_expand", "mrope",
       "gated_delta_rule", "causal_conv1d_update", "gated_delta_rule_verify")
EPS = 1e-6
# Goals of issue 6: at LARGE_TOKENS and more, at least as fast as torch.compile and this
# fraction of copy bandwidth; at SMALL_TOKENS and fewer, no slower than eager.
LARGE_TOKENS = 4096
SMALL_TOKENS = 64
BANDWIDTH_GOAL = 0.8
LORA_SLOTS, LORA_RANK = 4, 16
CONV_WIDTH = 4  # Qwen3-Next's linear_conv_kernel_dim
VERIFY_QUERY = 3  # gated_delta_rule_verify: a token and 2 MTP drafts per sequence


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Time ascend-kernels' Triton ops against torch eager and torch.compile "
                    "on a CUDA GPU.")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"directory for kernels_gpu.json/.md (default {DEFAULT_OUT}; "
                             "with --dry-run-cpu nothing is written unless given)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a fast subset: tokens {QUICK_TOKENS}, hidden {QUICK_HIDDEN}, "
                             "shorter timing")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="check every Triton op against its reference on tiny CPU shapes "
                             "in Triton's interpreter (TRITON_INTERPRET=1); no timing")
    parser.add_argument("--ops", type=_names, default=OPS,
                        help=f"comma-separated subset of {','.join(OPS)}")
    parser.add_argument("--tokens", type=_ints, default=None, help="comma-separated token counts")
    parser.add_argument("--hidden", type=_ints, default=None, help="comma-separated hidden sizes")
    parser.add_argument("--timer", choices=("graph", "do_bench"), default="graph",
                        help="above 64 tokens: CUDA-graph replays over rotating input sets "
                             "(default), or do_bench with the L2 emptied before each rep")
    parser.add_argument("--no-compile", action="store_true",
                        help="skip torch.compile (faster; no comparison with it)")
    parser.add_argument("--warmup-ms", type=float, default=None,
                        help="do_bench warm-up per measurement (default 25, --quick 10)")
    parser.add_argument("--rep-ms", type=float, default=None,
                        help="do_bench timing budget per measurement (default 200, --quick 50)")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens = args.tokens or QUICK_TOKENS
        args.hidden = args.hidden or QUICK_HIDDEN
    if args.dry_run_cpu:
        args.tokens = args.tokens or DRY_TOKENS
        args.hidden = args.hidden or DRY_HIDDEN
    args.tokens = args.tokens or FULL_TOKENS
    args.hidden = args.hidden or FULL_HIDDEN
    args.warmup_ms = args.warmup_ms or (10.0 if args.quick else 25.0)
    args.rep_ms = args.rep_ms or (50.0 if args.quick else 200.0)
    return args


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of ints") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive ints such as 1,4096")
    return values


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in names if name not in OPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown op(s) {unknown}; choose from {','.join(OPS)}")
    return names


# --- the ops under test -------------------------------------------------------------------


@dataclass
class Case:
    """One op at one shape: its argument sets (several, to rotate through so that the L2
    cache never holds the next call's inputs), how to call the Triton op and the
    reference on one set, and how many bytes a call must move."""

    op: str
    tokens: int
    hidden: int
    arg_sets: list
    triton: Callable[[tuple], object]
    reference: Callable[..., object]
    bytes_moved: int
    compare: Callable[[object, object], None]


def rope_geometry(hidden: int) -> tuple[int, int, int]:
    """(query heads, key heads, head size): Llama-like GQA, 128-wide heads with 8 key
    heads at real sizes, 16-wide heads with 2 key heads for the tiny dry-run sizes."""
    head_size, heads_k = (128, 8) if hidden >= 1024 else (16, 2)
    return hidden // head_size, heads_k, head_size


def build_case(op: str, tokens: int, hidden: int, device, dtype, copies: int = 1) -> Case:
    """``copies`` independent argument sets of ``op`` at ``[tokens, hidden]``."""
    import torch

    import ascend_kernels as ak
    from ascend_kernels import activation, conv, gdn, lora, norm, quant, rope

    torch.manual_seed(tokens * 31 + hidden)
    elem = dtype.itemsize
    weight = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    heads_q, heads_k, head_size = rope_geometry(hidden)
    max_position = 8192
    cache = (torch.rand(max_position, head_size, device=device) * 2 - 1).to(dtype)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=device, dtype=dtype) * scale

    def arg_set() -> tuple:
        if op == "rms_norm":
            return (randn(tokens, hidden), weight, EPS)
        if op in ("add_rms_norm", "add_rms_norm_quant"):
            return (randn(tokens, hidden), randn(tokens, hidden), weight, EPS)
        if op == "silu_and_mul":
            return (randn(tokens, 2 * hidden),)
        if op == "rotary_embedding":
            positions = torch.randint(0, max_position, (tokens,), device=device)
            return (positions, randn(tokens, heads_q * head_size),
                    randn(tokens, heads_k * head_size), cache, head_size, True)
        if op == "mrope":
            positions = torch.randint(0, max_position, (3, tokens), device=device)
            return (positions, randn(tokens, heads_q * head_size),
                    randn(tokens, heads_k * head_size), cache, head_size, mrope_section, True)
        if op == "gated_delta_rule":  # a decode batch: one token per sequence
            state = torch.randn(tokens, gdn_heads[1], gdn_dim, gdn_dim, device=device) * 0.1
            slots = torch.arange(tokens, device=device, dtype=torch.int32)
            return (randn(tokens, gdn_heads[0], gdn_dim), randn(tokens, gdn_heads[0], gdn_dim),
                    randn(tokens, gdn_heads[1], gdn_dim),
                    torch.nn.functional.logsigmoid(randn(tokens, gdn_heads[1])),
                    torch.sigmoid(randn(tokens, gdn_heads[1])), state,
                    torch.arange(tokens + 1, device=device, dtype=torch.int32), slots, None,
                    True)
        if op == "gated_delta_rule_verify":  # sequences of VERIFY_QUERY tokens
            rows_n = tokens * VERIFY_QUERY
            state = torch.randn(rows_n, gdn_heads[1], gdn_dim, gdn_dim, device=device) * 0.1
            slots = torch.arange(rows_n, device=device, dtype=torch.int32).view(tokens, -1)
            return (randn(rows_n, gdn_heads[0], gdn_dim), randn(rows_n, gdn_heads[0], gdn_dim),
                    randn(rows_n, gdn_heads[1], gdn_dim),
                    torch.nn.functional.logsigmoid(randn(rows_n, gdn_heads[1])),
                    torch.sigmoid(randn(rows_n, gdn_heads[1])), state,
                    torch.arange(0, rows_n + 1, VERIFY_QUERY, device=device,
                                 dtype=torch.int32), slots,
                    torch.full((tokens,), 2, device=device, dtype=torch.int32),
                    gdn_dim ** -0.5, True, EPS)
        if op == "causal_conv1d_update":  # a decode batch: one token per sequence
            # vLLM's conv state cache [slots, W - 1, dim], viewed as [slots, dim, W - 1].
            states = randn(tokens, CONV_WIDTH - 1, conv_dim).transpose(1, 2)
            return (randn(tokens, conv_dim), randn(conv_dim, CONV_WIDTH, scale=0.5), None,
                    states, torch.arange(tokens, device=device, dtype=torch.int32), "silu")
        if op == "l2norm":
            return (randn(tokens, hidden), EPS)
        if op == "dynamic_per_token_quant":
            return (randn(tokens, hidden, scale=3.0),)
        if op == "lora_shrink":
            return (randn(tokens, hidden), randn(LORA_SLOTS, LORA_RANK, hidden, scale=0.02),
                    torch.empty(tokens, LORA_RANK, device=device), token_lora, 0.5)
        if op == "lora_expand":
            return (torch.randn(tokens, LORA_RANK, device=device),
                    randn(LORA_SLOTS, hidden, LORA_RANK, scale=0.02), randn(tokens, hidden),
                    token_lora, 0, True)
        raise ValueError(f"unknown op {op!r}")

    # Gated delta-net (Qwen3-Next: 16 query / key heads, 32 value heads of 128 at hidden
    # 4096; twice the value heads at 8192; small heads in the dry run).
    gdn_dim = 128 if hidden >= 1024 else 16
    gdn_heads = (16, hidden // 128) if hidden >= 1024 else (2, 4)
    # The conv in front of those heads: q, k and v channels together.
    conv_dim = (2 * gdn_heads[0] + gdn_heads[1]) * gdn_dim
    # Qwen2.5-VL's T / H / W pairs for 128-wide heads (scaled down for the dry-run heads).
    mrope_section = (16, 24, 24) if head_size == 128 else (2, 3, 3)
    token_lora = torch.arange(tokens, device=device) % (LORA_SLOTS + 1) - 1
    slot_weights = min(tokens, LORA_SLOTS) * LORA_RANK * hidden * elem

    rows = tokens * hidden
    float_close = _float_close(dtype)
    table = {
        # op: (Triton call on one argument set, reference, bytes moved, comparison)
        "rms_norm": (lambda a: ak.rms_norm(*a, backend="triton"), norm.rms_norm_reference,
                     2 * rows * elem + hidden * elem, float_close),
        "add_rms_norm": (lambda a: ak.add_rms_norm(*a, backend="triton"),
                         norm.add_rms_norm_reference, 4 * rows * elem + hidden * elem,
                         _all(float_close)),
        "silu_and_mul": (lambda a: ak.silu_and_mul(*a, backend="triton"),
                         activation.silu_and_mul_reference, 3 * rows * elem, float_close),
        "rotary_embedding": (lambda a: ak.rotary_embedding(*a, backend="triton"),
                             rope.rotary_embedding_reference,
                             # q and k read and written, a cos/sin row and a position per token
                             2 * tokens * (heads_q + heads_k) * head_size * elem
                             + tokens * (head_size * elem + 8), _all(float_close)),
        "mrope": (lambda a: ak.mrope(*a, backend="triton"), rope.mrope_reference,
                  # q and k read and written, three positions and a cos/sin row per token
                  2 * tokens * (heads_q + heads_k) * head_size * elem
                  + tokens * (head_size * elem + 3 * 8), _all(float_close)),
        "gated_delta_rule": (lambda a: ak.gated_delta_rule(*a, backend="triton"),
                             gdn.gated_delta_rule_decode_reference,
                             # the float32 states read and written; q, k, v, out, g, beta
                             tokens * gdn_heads[1] * gdn_dim * gdn_dim * 4 * 2
                             + tokens * (2 * gdn_heads[0] + 2 * gdn_heads[1]) * gdn_dim * elem
                             + tokens * gdn_heads[1] * 2 * elem, float_close),
        "gated_delta_rule_verify": (lambda a: ak.gated_delta_rule_verify(*a, backend="triton"),
                                    gdn.gated_delta_rule_verify_reference,
                                    # float32 states: one slot read, one written per token
                                    tokens * gdn_heads[1] * gdn_dim * gdn_dim * 4
                                    * (1 + VERIFY_QUERY)
                                    + tokens * VERIFY_QUERY * (
                                        (2 * gdn_heads[0] + 2 * gdn_heads[1]) * gdn_dim * elem
                                        + gdn_heads[1] * 2 * elem), float_close),
        "causal_conv1d_update": (lambda a: ak.causal_conv1d_update(*a, backend="triton"),
                                 conv.causal_conv1d_update_reference,
                                 # x read, out written, the states read and written, weights
                                 tokens * conv_dim * elem * (2 + 2 * (CONV_WIDTH - 1))
                                 + conv_dim * CONV_WIDTH * elem, float_close),
        "l2norm": (lambda a: ak.l2norm(*a, backend="triton"), norm.l2norm_reference,
                   2 * rows * elem, float_close),
        "dynamic_per_token_quant": (lambda a: ak.dynamic_per_token_quant(*a, backend="triton"),
                                    quant.dynamic_per_token_quant_reference,
                                    rows * (elem + 1) + tokens * 4, _quant_close),
        "add_rms_norm_quant": (lambda a: ak.add_rms_norm_quant(*a, backend="triton"),
                               quant.add_rms_norm_quant_reference,
                               rows * (3 * elem + 1) + hidden * elem + tokens * 4,
                               _quant_close),
        "lora_shrink": (lambda a: ak.lora_shrink(*a, backend="triton"),
                        lora.lora_shrink_reference,
                        rows * elem + slot_weights + tokens * (LORA_RANK * 4 + 8),
                        # float32 sums of bfloat16 products: the matrix units' accumulation
                        # order and rounding differ from the reference's matmul.
                        _float_close(torch.float16)),
        "lora_expand": (lambda a: ak.lora_expand(*a, backend="triton"),
                        lora.lora_expand_reference,
                        2 * rows * elem + slot_weights + tokens * (LORA_RANK * 4 + 8),
                        float_close),
    }
    if op not in table:
        raise ValueError(f"unknown op {op!r}")
    triton_call, reference, moved, compare = table[op]
    return Case(op, tokens, hidden, [arg_set() for _ in range(copies)], triton_call,
                reference, moved, compare)


def _float_close(dtype):
    import torch

    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]

    def close(got, want):
        torch.testing.assert_close(got.float(), want.float(), atol=tol * 2, rtol=tol)

    return close


def _all(close):
    def each(got, want):
        assert len(got) == len(want), f"{len(got)} outputs, expected {len(want)}"
        for g, w in zip(got, want, strict=True):
            close(g, w)

    return each


def _quant_close(got, want):
    """int8 outputs may differ by one step on rounding boundaries (the GPU's reciprocal
    of the scale may round differently from torch's); scales and float outputs must match."""
    import torch

    q, q_ref = got[0], want[0]
    assert q.dtype == torch.int8 and q.shape == q_ref.shape
    diff = (q.int() - q_ref.int()).abs()
    if diff.numel():
        assert diff.max().item() <= 1, f"int8 values differ by {diff.max().item()}"
        share = (diff > 0).float().mean().item()
        assert share <= 0.01, f"{share:.2%} of int8 values differ by one step"
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-4)
    for g, w in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=4e-2, rtol=2e-2)


def check(case: Case) -> None:
    # Each side on its own copy of the inputs: the LoRA ops write into an argument.
    def fresh() -> tuple:
        return tuple(a.clone() if hasattr(a, "clone") else a for a in case.arg_sets[0])

    got, want = case.triton(fresh()), case.reference(*fresh())
    try:
        case.compare(got, want)
    except AssertionError as error:
        raise SystemExit(
            f"FAIL: Triton {case.op} differs from its reference at tokens={case.tokens}, "
            f"hidden={case.hidden}:\n{error}"
        ) from None


# --- timing ---------------------------------------------------------------------------------


def bench_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds of ``fn`` per call, L2 emptied before each rep."""
    try:
        from triton.testing import do_bench
    except ImportError:
        return _bench_with_events(fn, warmup_ms, rep_ms)
    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _bench_with_events(fn, warmup_ms, rep_ms) -> float:
    import torch

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    times = []
    for _ in range(max(10, int(rep_ms / estimate))):
        flush.zero_()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def latency_ms(fn: Callable[[], object], warmup_ms: float, rep_ms: float) -> float:
    """Median milliseconds per call of back-to-back calls (no cache flush): the cost of a
    small op as a model step sees it, max(host-side launch work, device time)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        fn()
    end.record()
    torch.cuda.synchronize()
    estimate = max(start.elapsed_time(end) / 10, 1e-3)
    inner = max(1, min(1000, int(1.0 / estimate)))  # about 1 ms of calls per sample
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn()
    samples = []
    for _ in range(max(10, int(rep_ms / (inner * estimate)))):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def copy_bandwidth_gbps(warmup_ms: float, rep_ms: float) -> float:
    import torch

    nbytes = 1 << 30
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), warmup_ms, rep_ms)
    src = dst = None  # free the 2 GiB before the ops are measured
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def _compile(reference):
    import torch
    import torch._dynamo

    # Every (op, shape) is compiled statically: give each its own graph.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    return torch.compile(reference, dynamic=False)


def graph_ms(calls: list[Callable[[], object]], rep_ms: float) -> float:
    """Median milliseconds per call of CUDA-graph replays running ``calls`` in turn.

    The graph removes host-side launch work from the measurement (above 64 tokens the
    question is bandwidth, and a model's large steps run ahead of the host), and each call
    works on its own argument set, together more than the L2 cache, so no call finds its
    inputs cached by the one before.
    """
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for fn in calls:  # warm-up outside the graph: compilation, allocator
        fn()
    end.record()
    torch.cuda.synchronize()
    per_call = max(start.elapsed_time(end) / len(calls), 1e-3)
    rounds = max(1, min(64, int(2.0 / (per_call * len(calls)))))  # about 2 ms a replay
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for fn in calls:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    total = rounds * len(calls)
    samples = []
    for _ in range(max(10, min(200, int(rep_ms / (per_call * total))))):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) / total)
    del graph
    return statistics.median(samples)


def input_copies(case_bytes: int, tokens: int) -> int:
    """Argument sets to rotate through: together at least three times the L2 cache."""
    import torch

    if tokens <= SMALL_TOKENS:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 64 << 20)
    return max(2, min(16, -(-3 * l2 // max(case_bytes, 1))))


def _timers(case: Case, args) -> list[tuple[str, Callable]]:
    """The timers to try for ``case``, in order (the next one if one fails)."""
    if case.tokens <= SMALL_TOKENS:
        first = [("latency", lambda calls: latency_ms(calls[0], args.warmup_ms, args.rep_ms))]
    elif args.timer == "graph":
        first = [("graph", lambda calls: graph_ms(calls, args.rep_ms))]
    else:
        first = []
    return first + [("do_bench", lambda calls: bench_ms(calls[0], args.warmup_ms, args.rep_ms))]


def measure(case: Case, args, copy_gbps: float) -> dict:
    row = {"op": case.op, "tokens": case.tokens, "hidden": case.hidden,
           "bytes": case.bytes_moved, "input_sets": len(case.arg_sets)}
    variants = {"triton": [partial(case.triton, a) for a in case.arg_sets],
                "eager": [partial(case.reference, *a) for a in case.arg_sets]}
    if not args.no_compile:
        compiled = _compile(case.reference)
        variants["compile"] = [partial(compiled, *a) for a in case.arg_sets]
    # Launch-bound sizes are timed in three interleaved rounds and the best median kept:
    # host-side noise (another process, a compile worker) then hits no variant alone.
    rounds = 3 if case.tokens <= SMALL_TOKENS else 1
    best: dict[str, float] = {}
    chosen: dict[str, list] = {}
    for _ in range(rounds):
        for name, calls in variants.items():
            timers = chosen.get(name, _timers(case, args))
            if not timers:
                continue  # every timer failed in an earlier round
            for timer_name, timer in timers:
                try:
                    ms = timer(calls)
                except Exception as error:  # a peer that fails to run is reported, not fatal
                    row.setdefault(f"{name}_errors", []).append(
                        f"{timer_name}: {type(error).__name__}: {error}"[:300])
                    continue
                chosen[name] = [(timer_name, timer)]
                row[f"{name}_timer"] = timer_name
                best[name] = min(ms, best.get(name, ms))
                break
            else:
                chosen[name] = []
    for name in variants:
        ms = best.get(name)
        if ms is None:
            row[f"{name}_us"] = None
            continue
        gbps = case.bytes_moved / (ms * 1e-3) / 1e9
        row[f"{name}_us"] = round(ms * 1e3, 2)
        row[f"{name}_gbps"] = round(gbps, 1)
        row[f"{name}_of_copy"] = round(gbps / copy_gbps, 3)
    row.update(goal(row))
    return row


def goal(row: dict) -> dict:
    """Whether the row meets issue 6's performance goal (None where it sets none)."""
    triton_us, eager_us, compile_us = (row.get(f"{n}_us") for n in ("triton", "eager",
                                                                     "compile"))
    if triton_us is None:
        return {"goal_met": False, "goal": "Triton op failed to run"}
    if row["tokens"] >= LARGE_TOKENS:
        reasons = []
        if row.get("triton_of_copy", 0) < BANDWIDTH_GOAL:
            reasons.append(f"{row.get('triton_of_copy', 0):.2f} of copy bandwidth < "
                           f"{BANDWIDTH_GOAL}")
        if compile_us is not None and triton_us > compile_us:
            reasons.append(f"slower than torch.compile ({triton_us} > {compile_us} us)")
        return {"goal_met": not reasons, "goal": "; ".join(reasons) or "met"}
    if row["tokens"] <= SMALL_TOKENS:
        if eager_us is not None and triton_us > eager_us:
            return {"goal_met": False,
                    "goal": f"slower than eager ({triton_us} > {eager_us} us)"}
        return {"goal_met": True, "goal": "met"}
    return {"goal_met": None, "goal": "no goal at this size"}


# --- report ---------------------------------------------------------------------------------


def machine(dry_run: bool) -> dict:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    info = {"torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if dry_run:
        info["device"] = "CPU (Triton interpreter, correctness only)"
    else:
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["device_memory_gib"] = round(
            torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    return info


TIMER_TEXT = {
    "graph": "median time per call of CUDA-graph replays, each call on its own input set "
             "(the sets together three times the L2 cache), so no host launch cost and no "
             "cached inputs",
    "do_bench": "median of triton.testing.do_bench reps, L2 emptied before each",
}


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# ascend-kernels Triton ops on a GPU",
        "",
        f"Machine: {m['device']}; torch {m['torch']}, Triton {m['triton']}, "
        f"CUDA {m.get('cuda')}, Python {m['python']}; {m['date']}.",
        f"Device-to-device copy bandwidth (1 GiB `copy_`): "
        f"{report.get('copy_gbps') or 'n/a'} GB/s. Dtype {report['dtype']}. Above "
        f"{SMALL_TOKENS} tokens: {TIMER_TEXT[report.get('timer', 'graph')]}; at "
        f"{SMALL_TOKENS} tokens or fewer: median per-call time of back-to-back calls "
        f"(launch cost included, L2 warm), the best of three interleaved rounds. Bandwidth "
        f"from the minimal bytes moved.",
        "",
        "| op | tokens | hidden | MB moved | Triton us | eager us | compile us | Triton GB/s "
        "| Triton / copy | compile / copy | eager / copy | vs compile | vs eager | goal |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def cell(value, fmt="{}"):
        return "n/a" if value is None else fmt.format(value)

    for r in report["results"]:
        vs_compile = (r["compile_us"] / r["triton_us"]
                      if r.get("compile_us") and r.get("triton_us") else None)
        vs_eager = (r["eager_us"] / r["triton_us"]
                    if r.get("eager_us") and r.get("triton_us") else None)
        lines.append(
            f"| {r['op']} | {r['tokens']} | {r['hidden']} | {r['bytes'] / 1e6:.2f} "
            f"| {cell(r.get('triton_us'))} | {cell(r.get('eager_us'))} "
            f"| {cell(r.get('compile_us'))} | {cell(r.get('triton_gbps'))} "
            f"| {cell(r.get('triton_of_copy'), '{:.2f}')} "
            f"| {cell(r.get('compile_of_copy'), '{:.2f}')} "
            f"| {cell(r.get('eager_of_copy'), '{:.2f}')} "
            f"| {cell(vs_compile, '{:.2f}x')} | {cell(vs_eager, '{:.2f}x')} "
            f"| {r.get('goal', 'n/a')} |")
    missed = [r for r in report["results"] if r.get("goal_met") is False]
    lines += ["", f"Goal (issue 6): at {LARGE_TOKENS}+ tokens at least as fast as "
              f"torch.compile and >= {BANDWIDTH_GOAL:.0%} of copy bandwidth; at "
              f"{SMALL_TOKENS} tokens or fewer no slower than eager. Missed: {len(missed)} of "
              f"{len(report['results'])} rows."]
    return "\n".join(lines) + "\n"


def write(report: dict, out: Path, stem: str, quiet: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(report))
    if not quiet:
        print(f"wrote {out / (stem + '.json')} and {out / (stem + '.md')}")


# --- main -----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run_cpu:
        # Triton decides interpreter or compiler when a kernel module is first imported.
        os.environ["TRITON_INTERPRET"] = "1"
    if str(KERNELS_SRC) not in sys.path:
        sys.path.insert(0, str(KERNELS_SRC))
    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print("bench_kernels_gpu: no CUDA device here, nothing to measure; "
              "--dry-run-cpu checks the kernels in Triton's interpreter instead.")
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("bench_kernels_gpu: triton is not installed; it is what this script measures.")
        return 1

    device = "cpu" if args.dry_run_cpu else "cuda"
    dtype = torch.float32 if args.dry_run_cpu else torch.bfloat16
    dtypes = [torch.float32, torch.bfloat16, torch.float16] if args.dry_run_cpu else [dtype]
    report = {"machine": machine(args.dry_run_cpu), "dtype": str(dtype).replace("torch.", ""),
              "timer": args.timer,
              "ops": list(args.ops), "tokens": list(args.tokens), "hidden": list(args.hidden),
              "results": []}
    if not args.dry_run_cpu:
        report["copy_gbps"] = round(copy_bandwidth_gbps(args.warmup_ms, args.rep_ms), 1)
        print(f"device-to-device copy: {report['copy_gbps']} GB/s on {report['machine']['device']}")

    for op in args.ops:
        for hidden in args.hidden:
            for tokens in args.tokens:
                for case_dtype in dtypes:
                    case = build_case(op, tokens, hidden, device, case_dtype)
                    check(case)
                if not args.dry_run_cpu:
                    copies = input_copies(case.bytes_moved, tokens)
                    if copies > 1:
                        case = build_case(op, tokens, hidden, device, dtype, copies)
                if args.dry_run_cpu:
                    report["results"].append({"op": op, "tokens": tokens, "hidden": hidden,
                                              "bytes": case.bytes_moved, "checked": True,
                                              "goal": "correctness only"})
                    print(f"ok  {op:24s} tokens={tokens:<6d} hidden={hidden}")
                    continue
                row = measure(case, args, report["copy_gbps"])
                report["results"].append(row)
                # Written after every row, so that a run cut short keeps what it measured.
                write(report, args.out or DEFAULT_OUT, "kernels_gpu", quiet=True)
                print(f"{op:24s} tokens={tokens:<6d} hidden={hidden:<5d} "
                      f"triton {row.get('triton_us')} us ({row.get('triton_of_copy')} of copy) "
                      f"eager {row.get('eager_us')} us  compile {row.get('compile_us')} us  "
                      f"[{row['goal']}]")
                del case
                torch.cuda.empty_cache()

    if args.dry_run_cpu:
        print(f"dry run: {len(report['results'])} op/shape cases match their references "
              "(float32, bfloat16, float16) in Triton's interpreter")
        if args.out is not None:
            write(report, args.out, "kernels_gpu_dryrun")
        return 0
    write(report, args.out or DEFAULT_OUT, "kernels_gpu")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
