"""Run prefill instances, decode instances and the proxy (xPyD, 1P1D by default) on this
machine.

Used by the demo (``--pd``), the end-to-end tests and the benchmark. Every instance serves
the same model with ``MooncakeConnectorV1`` over TCP on 127.0.0.1; the proxy fronts them.
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
class Instance:
    name: str  # prefill-0, decode-1, ...
    url: str
    log: str
    process: subprocess.Popen


@dataclass(frozen=True)
class PDDeployment:
    prefills: tuple[Instance, ...]
    decodes: tuple[Instance, ...]
    proxy: str  # base URL
    proxy_log: str

    # The first instance of each kind (all there is in 1P1D).
    @property
    def prefill(self) -> str:
        return self.prefills[0].url

    @property
    def decode(self) -> str:
        return self.decodes[0].url

    @property
    def prefill_log(self) -> str:
        return self.prefills[0].log

    @property
    def decode_log(self) -> str:
        return self.decodes[0].log


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
def running_pd(model: str, log_dir: str, *, num_prefill: int = 1, num_decode: int = 1,
               extra_args: Sequence[str] = (), prefill_extra: dict | None = None,
               decode_extra: dict | None = None, cpus: Sequence[str | None] | None = None,
               env: dict[str, str] | None = None, prefill_tp: int = 1,
               prefill_env: dict[str, str] | None = None, decode_args: Sequence[str] = (),
               timeout: float = 600) -> Iterator[PDDeployment]:
    """Start ``num_prefill`` prefill and ``num_decode`` decode instances (in parallel; the
    i-th of them, prefills first, pinned to ``cpus[i % len(cpus)]`` if given), then the
    proxy; stop them all when the block ends. ``*_extra`` go to each instance's
    ``kv_connector_extra_config``; ``prefill_tp`` > 1 runs the prefill instances with that
    tensor-parallel size (decode keeps 1)."""
    # The connector advertises this address in kv_transfer_params and listens on it.
    env = {"VLLM_HOST_IP": LOCALHOST, **(env or {})}
    specs = []  # (name, kv_transfer_config, extra args, env)
    for index in range(num_prefill):
        config = kv_transfer_config("kv_producer", kv_port=_free_ports(prefill_tp),
                                    engine_id=f"prefill-{index}", extra=prefill_extra,
                                    prefill_tp=prefill_tp)
        args = ["--tensor-parallel-size", str(prefill_tp)] if prefill_tp > 1 else []
        specs.append((f"prefill-{index}", config, args, {**env, **(prefill_env or {})}))
    for index in range(num_decode):
        config = kv_transfer_config("kv_consumer", kv_port=free_port(),
                                    engine_id=f"decode-{index}", extra=decode_extra,
                                    prefill_tp=prefill_tp, kv_load_failure_policy="recompute")
        specs.append((f"decode-{index}", config, list(decode_args), env))
    procs: list[subprocess.Popen] = []
    handles = []
    try:
        instances = []
        for index, (name, config, args, instance_env) in enumerate(specs):
            log = os.path.join(log_dir, f"{name}.log")
            handles.append(open(log, "w"))  # noqa: SIM115
            port = free_port()
            procs.append(launch_server(
                model, port, extra_args=[*extra_args, *args, "--kv-transfer-config", config],
                env=instance_env, log=handles[-1],
                cpus=cpus[index % len(cpus)] if cpus else None))
            instances.append(Instance(name, f"http://{LOCALHOST}:{port}", log, procs[-1]))
        for instance in instances:
            wait_until_healthy(instance.url, instance.process, timeout, instance.log)
        prefills = tuple(i for i in instances if i.name.startswith("prefill"))
        decodes = tuple(i for i in instances if i.name.startswith("decode"))
        proxy_log = os.path.join(log_dir, "proxy.log")
        proxy_url = f"http://{LOCALHOST}:{free_port()}"
        handles.append(open(proxy_log, "w"))  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ascend_plugin.pd_proxy",
             "--prefill", *(i.url for i in prefills), "--decode", *(i.url for i in decodes),
             "--host", LOCALHOST, "--port", proxy_url.rsplit(":", 1)[1]],
            stdout=handles[-1], stderr=subprocess.STDOUT))
        _wait_for_proxy(proxy_url, procs[-1], 60)
        yield PDDeployment(prefills, decodes, proxy_url, proxy_log)
    finally:
        for proc in procs:
            stop_server(proc)
        for handle in handles:
            handle.close()
