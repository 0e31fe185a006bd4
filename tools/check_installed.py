"""Smoke test of the installed wheels, run by the nox `install` session.

Run outside the checkout: every module must come from site-packages, vLLM must
discover both entry points, and with VLLM_ASCEND_TARGET=host the current
platform must be the plugin's host platform.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from importlib.metadata import entry_points, version

PACKAGES = {
    "ascend-kernels": "ascend_kernels",
    "ascend-core": "ascend_core",
    "ascend-quant": "ascend_quant",
    "ascend-specdec": "ascend_specdec",
    "ascend-eplb": "ascend_eplb",
    "ascend-plugin": "ascend_plugin",
}

PLATFORM_PROBE = (
    "from vllm.platforms import current_platform; "
    "print(type(current_platform).__module__ + '.' + type(current_platform).__name__)"
)


def fail(message: str) -> None:
    print(f"FAIL: {message}")
    sys.exit(1)


def main() -> None:
    for dist, module_name in PACKAGES.items():
        module = importlib.import_module(module_name)
        if "site-packages" not in (module.__file__ or ""):
            fail(f"{module_name} imported from {module.__file__}, not from the installed wheel")
        if module.__version__ != version(dist):
            fail(f"{module_name}.__version__ {module.__version__} != wheel {version(dist)}")
        print(f"ok  {dist} {version(dist)} from {module.__file__}")

    from vllm.plugins import (
        DEFAULT_PLUGINS_GROUP,
        PLATFORM_PLUGINS_GROUP,
        STAT_LOGGER_PLUGINS_GROUP,
        load_plugins_by_group,
    )

    for group in (PLATFORM_PLUGINS_GROUP, DEFAULT_PLUGINS_GROUP):
        names = [ep.name for ep in entry_points(group=group)]
        if "ascend" not in load_plugins_by_group(group):
            fail(f"vLLM does not load an 'ascend' plugin from {group} (found {names})")
        print(f"ok  vLLM loads 'ascend' from {group}")
    if "ascend_draft_length" not in load_plugins_by_group(STAT_LOGGER_PLUGINS_GROUP):
        fail(f"vLLM does not load the 'ascend_draft_length' stat logger from "
             f"{STAT_LOGGER_PLUGINS_GROUP}")
    print(f"ok  vLLM loads 'ascend_draft_length' from {STAT_LOGGER_PLUGINS_GROUP}")

    expectations = {"host": "ascend_core.platform.host.AscendHostPlatform",
                    "auto": "vllm.platforms.cpu.CpuPlatform"}
    for target, expected in expectations.items():
        env = dict(os.environ, VLLM_ASCEND_TARGET=target)
        out = subprocess.run([sys.executable, "-c", PLATFORM_PROBE], env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        if not out or out[-1] != expected:
            fail(f"VLLM_ASCEND_TARGET={target}: current platform {out[-1:]} != {expected}")
        print(f"ok  VLLM_ASCEND_TARGET={target} -> {expected}")
    serve_one_request()
    print("installed wheels: all checks passed")


def serve_one_request() -> None:
    """The README's own-environment command: the installed ``ascend-vllm serve`` on the host
    target answers one completion (the demo model, eager to keep the check short)."""
    import shutil
    import tempfile

    from ascend_plugin.demo_model import demo_model_dir
    from ascend_plugin.serving import (
        HOST_DEFAULTS,
        complete,
        free_port,
        stop_server,
        wait_until_healthy,
    )

    script = shutil.which("ascend-vllm", path=os.path.dirname(sys.executable))
    if script is None:
        fail(f"no ascend-vllm command beside {sys.executable}")
    model, port = str(demo_model_dir()), free_port()
    log_path = os.path.join(tempfile.mkdtemp(), "server.log")
    command = [script, "serve", model, "--host", "127.0.0.1", "--port", str(port),
               "--max-model-len", "512", "--gpu-memory-utilization", "0.2", "--enforce-eager"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(command, env={**HOST_DEFAULTS, **os.environ}, stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            wait_until_healthy(f"http://127.0.0.1:{port}", proc, 600, log_path)
            reply = complete(f"http://127.0.0.1:{port}", model, "def fibonacci(n):", 8)
        finally:
            stop_server(proc)
    text = reply["choices"][0]["text"]
    if not text:
        fail(f"ascend-vllm serve answered an empty completion (log: {log_path})")
    print(f"ok  ascend-vllm serve (host target) answered {text!r}")


if __name__ == "__main__":
    main()
