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
        load_plugins_by_group,
    )

    for group in (PLATFORM_PLUGINS_GROUP, DEFAULT_PLUGINS_GROUP):
        names = [ep.name for ep in entry_points(group=group)]
        if "ascend" not in load_plugins_by_group(group):
            fail(f"vLLM does not load an 'ascend' plugin from {group} (found {names})")
        print(f"ok  vLLM loads 'ascend' from {group}")

    expectations = {"host": "ascend_core.platform.host.AscendHostPlatform",
                    "auto": "vllm.platforms.cpu.CpuPlatform"}
    for target, expected in expectations.items():
        env = dict(os.environ, VLLM_ASCEND_TARGET=target)
        out = subprocess.run([sys.executable, "-c", PLATFORM_PROBE], env=env,
                             capture_output=True, text=True, check=True).stdout.split()
        if not out or out[-1] != expected:
            fail(f"VLLM_ASCEND_TARGET={target}: current platform {out[-1:]} != {expected}")
        print(f"ok  VLLM_ASCEND_TARGET={target} -> {expected}")
    print("installed wheels: all checks passed")


if __name__ == "__main__":
    main()
