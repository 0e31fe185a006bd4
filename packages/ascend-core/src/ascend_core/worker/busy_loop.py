"""How long a vLLM worker process spins after its last message before it sleeps."""

from __future__ import annotations

import inspect


def worker_busy_loop_s() -> float:
    """vLLM's worker busy-loop window (``SpinCondition``'s ``busy_loop_s``, 1 s in vLLM
    0.32): a worker woken within it spins on ``sched_yield`` instead of sleeping."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    busy_loop = inspect.signature(SpinCondition.__init__).parameters.get("busy_loop_s")
    return float(busy_loop.default) if busy_loop is not None else 1.0
