"""``ascend-eplb``: plan an expert placement from recorded loads, offline.

    ascend-eplb plan --loads loads.npy --ranks 64 --nodes 8 --groups 8 --redundant 64 \\
        --policy flashlb --out placement.json --plot loads.png

LOADS is a [layers, experts] array of per-expert loads: a ``.npy`` file (read without
pickles) or a ``.json`` file holding either the 2-D list or ``{"loads": [[...], ...]}``.
The placement is written as an expert map (see ``ascend_eplb.expert_map``); a summary
table goes to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import numpy as np
import torch

from ascend_eplb.validation import UnknownEplbPolicyError

__all__ = ["main"]

PROGRESS_CHUNK = 64  # layers planned per call, so that long runs report progress


class CliError(Exception):
    """A problem with the command's input: reported as one line, exit status 2."""


def main(
    argv: list[str] | None = None, *, stdout: TextIO | None = None, stderr: TextIO | None = None
) -> int:
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args, stdout, stderr)
    except CliError as err:
        print(f"ascend-eplb: error: {err}", file=stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ascend-eplb", description="Expert-parallel load balancing for MoE models."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser(
        "plan",
        help="plan a placement from per-expert loads",
        description="Plan a placement of experts onto ranks from [layers, experts] loads.",
    )
    plan.add_argument("--loads", required=True, type=Path, help=".npy or .json [layers, experts]")
    plan.add_argument("--ranks", required=True, type=int, help="EP ranks (GPUs / NPUs)")
    plan.add_argument("--nodes", type=int, default=1, help="nodes the ranks span (default 1)")
    plan.add_argument(
        "--groups",
        type=int,
        default=1,
        help="expert groups; hierarchical placement when divisible by --nodes (default 1)",
    )
    plan.add_argument("--redundant", type=int, default=0, help="redundant replicas (default 0)")
    plan.add_argument("--policy", default="default", help="default, flashlb or swift")
    plan.add_argument("--previous", type=Path, help="expert map in service (moves are counted)")
    plan.add_argument("--out", type=Path, help="write the placement as an expert map JSON")
    plan.add_argument("--plot", type=Path, help="write a before/after heat map (needs matplotlib)")
    plan.add_argument("--expert-bytes", type=int, help="bytes of one expert's weights")
    plan.add_argument("--max-moves-per-layer", type=int, help="swift: transfers per layer")
    plan.add_argument(
        "--threshold", type=float, help="swift: leave layers within this of the bound"
    )
    plan.add_argument("--quiet", action="store_true", help="no progress output")
    plan.set_defaults(run=_plan)
    return parser


def _plan(args: argparse.Namespace, stdout: TextIO, stderr: TextIO) -> int:
    import ascend_eplb
    from ascend_eplb.expert_map import ExpertMapError, load_expert_map, save_expert_map
    from ascend_eplb.metrics import balancedness, balancedness_upper_bound, rank_loads
    from ascend_eplb.transfer import plan_transfers

    def progress(message: str) -> None:
        if not args.quiet:
            print(f"[ascend-eplb] {message}", file=stderr, flush=True)

    if args.plot is not None:
        _require_matplotlib()
    weight = _read_loads(args.loads)
    num_layers, num_experts = weight.shape
    progress(f"read {num_layers} x {num_experts} loads from {args.loads}")
    if args.redundant < 0:
        raise CliError(f"--redundant must be >= 0, got {args.redundant}")
    num_replicas = num_experts + args.redundant

    previous = None
    if args.previous is not None:
        try:
            previous_map = load_expert_map(args.previous)
        except (ExpertMapError, OSError) as err:
            raise CliError(str(err)) from None
        if previous_map.phy2log.shape != (num_layers, num_replicas):
            raise CliError(
                f"--previous {args.previous} is a [{previous_map.num_layers} layers, "
                f"{previous_map.num_replicas} slots] placement; these loads need "
                f"[{num_layers}, {num_replicas}] (experts + --redundant)"
            )
        if previous_map.num_gpus != args.ranks:
            raise CliError(
                f"--previous {args.previous} spreads its slots over {previous_map.num_gpus} "
                f"ranks, not --ranks {args.ranks}"
            )
        previous = previous_map.phy2log

    options: dict[str, Any] = {}
    if args.max_moves_per_layer is not None:
        options["max_moves_per_layer"] = args.max_moves_per_layer
    if args.threshold is not None:
        options["threshold"] = args.threshold
    topology = (num_replicas, args.groups, args.nodes, args.ranks)

    started = time.perf_counter()
    parts = []
    for first in range(0, max(num_layers, 1), PROGRESS_CHUNK):
        last = min(first + PROGRESS_CHUNK, num_layers)
        chunk_options = dict(options)
        if previous is not None:
            chunk_options["previous"] = previous[first:last]
        try:
            phy2log, _, _ = ascend_eplb.rebalance_experts(
                weight[first:last], *topology, policy=args.policy, **chunk_options
            )
        except UnknownEplbPolicyError as err:
            raise CliError(str(err)) from None
        except (ValueError, TypeError) as err:
            raise CliError(str(err)) from None
        parts.append(phy2log)
        if num_layers > PROGRESS_CHUNK:
            progress(f"planned layers {first + 1}-{last} of {num_layers}")
    phy2log = torch.cat(parts) if parts else torch.zeros(0, num_replicas, dtype=torch.int64)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    progress(f"planned {num_layers} layers with policy {args.policy!r} in {elapsed_ms:.0f} ms")

    logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64).scatter_add_(
        -1, phy2log, torch.ones_like(phy2log)
    )
    before_loads = _round_robin_loads(weight, args.ranks)
    after_loads = rank_loads(weight, phy2log, logcnt, args.ranks)
    rows = [
        ("before: round-robin, no redundancy", _pooled(before_loads), _peak_ratio(before_loads)),
    ]
    previous_loads = None
    if previous is not None:
        previous_count = torch.zeros_like(logcnt).scatter_add_(
            -1, previous, torch.ones_like(previous)
        )
        previous_loads = rank_loads(weight, previous, previous_count, args.ranks)
        rows.append(("previous map", _pooled(previous_loads), _peak_ratio(previous_loads)))
    rows.append(
        (
            f"after: {args.policy}",
            balancedness(weight, phy2log, logcnt, args.ranks),
            _peak_ratio(after_loads),
        )
    )
    bound = balancedness_upper_bound(weight, num_replicas, args.ranks, args.groups, args.nodes)
    rows.append(("upper bound (no placement beats it)", bound, None))

    print(
        f"{num_layers} layers, {num_experts} experts, {num_replicas} slots on "
        f"{args.ranks} ranks ({args.nodes} node(s), {args.groups} group(s))",
        file=stdout,
    )
    print(f"{'placement':<38} {'balancedness':>12} {'peak/mean':>10}", file=stdout)
    for name, value, ratio in rows:
        ratio_text = f"{ratio:>10.3f}" if ratio is not None else f"{'':>10}"
        print(f"{name:<38} {value:>12.4f} {ratio_text}", file=stdout)
    if previous is not None:
        plan = plan_transfers(
            previous,
            phy2log,
            args.ranks,
            args.expert_bytes or 0,
            num_nodes=args.nodes,
            num_experts=num_experts,
        )
        phy2log = plan.phy2log
        bytes_text = (
            f", {plan.total_bytes} bytes ({plan.total_bytes / 2**30:.2f} GiB)"
            if args.expert_bytes
            else " (pass --expert-bytes for bytes)"
        )
        print(f"moves vs previous: {plan.num_moves} expert copies{bytes_text}", file=stdout)
    print(f"planning time: {elapsed_ms:.1f} ms", file=stdout)

    if args.out is not None:
        metadata = {
            "policy": args.policy,
            "num_nodes": args.nodes,
            "num_groups": args.groups,
            "num_redundant_experts": args.redundant,
            "loads": str(args.loads),
        }
        try:
            save_expert_map(
                args.out, phy2log, args.ranks, num_experts=num_experts, metadata=metadata
            )
        except OSError as err:
            raise CliError(f"cannot write {args.out}: {err}") from None
        progress(f"wrote the placement to {args.out}")
    if args.plot is not None:
        panels = [("before: round-robin, no redundancy", before_loads)]
        if previous_loads is not None:
            panels.append(("previous map", previous_loads))
        panels.append((f"after: {args.policy}", after_loads))
        _plot(args.plot, panels)
        progress(f"wrote the heat map to {args.plot}")
    return 0


def _read_loads(path: Path) -> torch.Tensor:
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            array = np.load(path, allow_pickle=False)
        elif suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                if "loads" not in data:
                    raise CliError(
                        f"{path}: a JSON object needs a 'loads' key holding [layers, experts]"
                    )
                data = data["loads"]
            array = np.asarray(data, dtype=np.float64)
        else:
            raise CliError(
                f"{path}: unsupported loads file type {suffix or '(none)'!r}; use .npy or .json"
            )
    except OSError as err:
        raise CliError(f"cannot read {path}: {err}") from None
    except json.JSONDecodeError as err:
        raise CliError(f"{path}: not valid JSON: {err.msg} at line {err.lineno}") from None
    except ValueError as err:  # ragged lists, pickled arrays, non-numbers
        raise CliError(f"{path}: not a numeric [layers, experts] array: {err}") from None
    if array.dtype.kind not in "iuf":
        raise CliError(f"{path}: loads must be numbers, got dtype {array.dtype}")
    if array.ndim != 2:
        raise CliError(f"{path}: loads must be 2-D [layers, experts], got shape {array.shape}")
    from ascend_eplb.validation import as_load_matrix

    try:
        return as_load_matrix(torch.from_numpy(np.ascontiguousarray(array, dtype=np.float64)))
    except ValueError as err:
        raise CliError(f"{path}: {err}") from None


def _round_robin_loads(weight: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """Rank loads when expert e sits alone on rank e % num_ranks."""
    rank = torch.arange(weight.size(1)) % num_ranks
    loads = torch.zeros(weight.size(0), num_ranks, dtype=torch.float64)
    return loads.index_add_(1, rank, weight)


def _pooled(loads: torch.Tensor) -> float:
    total_max = float(loads.amax(-1).sum()) if loads.numel() else 0.0
    return 1.0 if total_max == 0 else float(loads.mean(-1).sum()) / total_max


def _peak_ratio(loads: torch.Tensor) -> float:
    mean = float(loads.mean(-1).sum()) if loads.numel() else 0.0
    return 1.0 if mean == 0 else float(loads.amax(-1).sum()) / mean


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError(
            "--plot needs matplotlib, which is not installed: "
            "pip install 'ascend-eplb[plot]' (or pip install matplotlib)"
        ) from None


def _plot(path: Path, panels: list[tuple[str, torch.Tensor]]) -> None:
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    # Loads relative to each layer's mean (1 = perfectly balanced), on one logarithmic
    # colour scale for every panel so that panels compare directly.
    relative = []
    for _, loads in panels:
        mean = loads.mean(-1, keepdim=True)
        relative.append(torch.where(mean > 0, loads / mean.clamp(min=1e-300), 1.0).numpy())
    top = max([float(r.max()) for r in relative] + [2.0])
    norm = LogNorm(vmin=1 / top, vmax=top, clip=True)
    figure = Figure(figsize=(4.5 * len(panels) + 1, 4.5), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    image = None
    for ax, (title, loads), values in zip(axes, panels, relative, strict=True):
        image = ax.imshow(
            np.maximum(values, 1 / top),
            aspect="auto",
            interpolation="nearest",
            cmap="RdBu_r",
            norm=norm,
        )
        ax.set_title(f"{title}\nbalancedness {_pooled(loads):.3f}", fontsize=9)
        ax.set_xlabel("rank")
        ax.set_ylabel("layer")
    if image is not None:
        figure.colorbar(image, ax=list(axes), label="rank load / layer mean (log scale)")
    try:
        figure.savefig(path, dpi=110)
    except OSError as err:
        raise CliError(f"cannot write {path}: {err}") from None


if __name__ == "__main__":
    sys.exit(main())
