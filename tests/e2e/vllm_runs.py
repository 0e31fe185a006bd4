"""Running vLLM in a fresh process per configuration, for the host end-to-end tests."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent
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

BASE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # collective_rpc ships run_llm.probe_worker to the workers by value.
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
    # The engine core in the LLM's own process: a separate one costs a second interpreter
    # importing vLLM and torch, 18 s of a 30 s run on one core here. `vllm serve` (the
    # server and prefill/decode tests) keeps vLLM's separate engine process.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}


def vllm_environment(env: dict | None) -> dict:
    # Without VLLM_ASCEND_TARGET (the default, auto) the plugin is installed but must
    # stay inactive on this machine, which has no NPU: that is the stock vLLM run.
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    return {**full_env, **BASE_ENV, **(env or {})}


RUN_LLM = HERE / "run_llm.py"

# Speculation at the configured draft length every step, as vLLM does: for the tests that
# measure a proposer at a fixed length (acceptance lengths, drafts against stock vLLM's, a
# replay of the drafts), whatever the default. The draft-length controller is tested on its
# own (test_draft_length.py).
FIXED_DRAFT_LENGTH = {"draft_length_config": {"dynamic": False}}

# Every core this test session may use. Under pytest-xdist each worker pins itself, and so the
# engines it starts, to one of them (conftest.py): two engines whose OpenMP threads spin on the
# same two cores slow each other down, and a test process training Medusa heads beside an
# engine took ten times its time alone. Runs with several workers take every core back.
ALL_CPUS = frozenset(os.sched_getaffinity(0))


def pin_xdist_worker_to_one_core() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and len(ALL_CPUS) > 1:
        cpus = sorted(ALL_CPUS)
        os.sched_setaffinity(0, {cpus[int(worker[2:]) % len(cpus)]})


def cores_for(llm: dict, env: dict | None):
    """A ``preexec_fn`` giving a run every core when it has several workers (tensor or
    pipeline parallel, or vLLM's CPU threads bound to several cores), else None (the
    caller's cores)."""
    bind = (env or {}).get("VLLM_CPU_OMP_THREADS_BIND", "")
    ranks = llm.get("tensor_parallel_size", 1) * llm.get("pipeline_parallel_size", 1)
    if ranks > 1 or "|" in bind:
        return lambda: os.sched_setaffinity(0, ALL_CPUS)
    return None


def run_script(script: str | os.PathLike, args: dict, env: dict | None = None,
               timeout: float = 600) -> tuple[dict, str]:
    """Run an engine script (it prints ``RESULT <json>``) with ``args`` in a fresh process;
    its result and its whole output, or fail with the output's end. The process must exit
    cleanly: a crash at shutdown fails the run too."""
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)],
                          env=vllm_environment(env), capture_output=True, text=True,
                          timeout=timeout, preexec_fn=cores_for(args.get("llm", {}), env))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT ") and proc.returncode == 0:
            return json.loads(line[len("RESULT "):]), proc.stdout + proc.stderr
    raise AssertionError(
        f"vLLM run failed (exit {proc.returncode}) for {args} with {env}:\n"
        f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )


def run_vllm(args: dict, env: dict | None = None, timeout: float = 600) -> dict:
    """Run run_llm.py in a fresh process; return its JSON result or fail with its log."""
    return run_script(RUN_LLM, args, env, timeout)[0]


def start_failure(args: dict, env: dict, timeout: float = 300,
                  script: str | os.PathLike = RUN_LLM) -> str:
    """Run a configuration that must fail at start-up; return its combined output."""
    proc = subprocess.run([sys.executable, str(script), json.dumps(args)],
                          env=vllm_environment(env), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode != 0, f"expected a start-up failure, got:\n{proc.stdout[-2000:]}"
    return proc.stdout + proc.stderr
