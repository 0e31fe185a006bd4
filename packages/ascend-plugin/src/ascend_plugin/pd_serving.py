"""Run one prefill instance, one decode instance and the proxy (1P1D) on this machine.

Used by the demo (``--pd``) and the end-to-end tests. Both instances serve the same
model with ``MooncakeConnectorV1`` over TCP on 127.0.0.1; the proxy fronts them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ascend_plugin.serving import free_port, launch_server, stop_server, wait_until_healthy

LOCALHOST = "127.0.0.1"


def kv_transfer_config(role: str, *, kv_port: int, engine_id: str,
                       extra: dict | None = None, prefill_tp: int = 1, decode_tp: int = 1,
                       **fields) -> str:
    """The ``--kv-transfer-config`` JSON of a MooncakeConnectorV1 instance."""
    config = {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": kv_port,
              "engine_id": engine_id,
              "kv_connector_extra_config": {"prefill": {"dp_size": 1, "tp_size": prefill_tp},
                                            "decode": {"dp_size": 1, "tp_size": decode_tp},
                                            **(extra or {})},
              **fields}
    return json.dumps(config)


def _free_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports (a prefill rank listens on kv_port +
    its TP rank)."""
    import socket

    for _ in range(100):
        base = free_port()
        sockets = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((LOCALHOST, base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {LOCALHOST}")


@dataclass(frozen=True)
class PDDeployment:
    prefill: str  # base URLs
    decode: str
    proxy: str
    prefill_log: str
    decode_log: str
    proxy_log: str


def _wait_for_proxy(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the pd proxy exited with {proc.returncode} before it was ready")
        with contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError):
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        time.sleep(0.5)
    raise TimeoutError(f"the pd proxy at {url} was not ready after {timeout} s")


@contextlib.contextmanager
def running_pd(model: str, log_dir: str, *, extra_args: Sequence[str] = (),
               prefill_extra: dict | None = None, decode_extra: dict | None = None,
               cpus: tuple[str | None, str | None] | None = None,
               env: dict[str, str] | None = None, prefill_tp: int = 1,
               prefill_env: dict[str, str] | None = None, decode_args: Sequence[str] = (),
               timeout: float = 600) -> Iterator[PDDeployment]:
    """Start prefill and decode (in parallel, each pinned to ``cpus`` if given), then the
    proxy; stop all three when the block ends. ``*_extra`` go to each instance's
    ``kv_connector_extra_config``; ``prefill_tp`` > 1 runs the prefill instance with that
    tensor-parallel size (decode keeps 1)."""
    # The connector advertises this address in kv_transfer_params and listens on it.
    env = {"VLLM_HOST_IP": LOCALHOST, **(env or {})}
    logs = {name: os.path.join(log_dir, f"{name}.log") for name in ("prefill", "decode",
                                                                    "proxy")}
    ports = {name: free_port() for name in ("prefill", "decode", "proxy")}
    configs = {
        "prefill": kv_transfer_config("kv_producer", kv_port=_free_ports(prefill_tp),
                                      engine_id="prefill-0", extra=prefill_extra,
                                      prefill_tp=prefill_tp),
        "decode": kv_transfer_config("kv_consumer", kv_port=free_port(), engine_id="decode-0",
                                     extra=decode_extra, prefill_tp=prefill_tp,
                                     kv_load_failure_policy="recompute"),
    }
    args = {"prefill": ["--tensor-parallel-size", str(prefill_tp)] if prefill_tp > 1 else [],
            "decode": list(decode_args)}
    envs = {"prefill": {**env, **(prefill_env or {})}, "decode": env}
    procs: dict[str, subprocess.Popen] = {}
    handles = {}
    try:
        for index, name in enumerate(("prefill", "decode")):
            handles[name] = open(logs[name], "w")  # noqa: SIM115
            procs[name] = launch_server(
                model, ports[name], extra_args=[*extra_args, *args[name],
                                                "--kv-transfer-config", configs[name]],
                env=envs[name], log=handles[name], cpus=cpus[index] if cpus else None)
        urls = {name: f"http://{LOCALHOST}:{port}" for name, port in ports.items()}
        for name in ("prefill", "decode"):
            wait_until_healthy(urls[name], procs[name], timeout, logs[name])
        handles["proxy"] = open(logs["proxy"], "w")  # noqa: SIM115
        procs["proxy"] = subprocess.Popen(
            [sys.executable, "-m", "ascend_plugin.pd_proxy", "--prefill", urls["prefill"],
             "--decode", urls["decode"], "--host", LOCALHOST, "--port", str(ports["proxy"])],
            stdout=handles["proxy"], stderr=subprocess.STDOUT)
        _wait_for_proxy(urls["proxy"], procs["proxy"], 60)
        yield PDDeployment(urls["prefill"], urls["decode"], urls["proxy"], logs["prefill"],
                           logs["decode"], logs["proxy"])
    finally:
        for proc in procs.values():
            stop_server(proc)
        for handle in handles.values():
            handle.close()
