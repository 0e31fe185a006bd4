"""The host machine's description that every CPU benchmark stores with its results, and how
long a benchmark that takes turns between vLLM servers waits between rounds."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe() -> str:
    """CPU, cores, torch and its thread count, Python."""
    import torch

    return (f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")


def quiet_gap_s() -> float:
    """How long a vLLM worker spins on its queue after its engine's last step
    (``SpinCondition``'s ``busy_loop_s``), and a little more. A benchmark taking turns
    between servers (or engines in their own processes) waits this long before each round:
    started sooner, a round shares the cores with the previous one's still spinning worker
    (seen in an ad-hoc /proc look on 2 cores, not stored)."""
    from ascend_core.worker.busy_loop import worker_busy_loop_s

    return worker_busy_loop_s() + 0.5
