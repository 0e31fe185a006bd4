"""Package contract: usable on its own, registration idempotent, no vLLM at import."""

import subprocess
import sys
from importlib.metadata import version

import ascend_specdec


def test_version_matches_the_installed_distribution():
    assert ascend_specdec.__version__ == version("ascend-specdec")


def test_import_and_register_pull_in_no_vllm():
    code = ("import sys, ascend_specdec; ascend_specdec.register(); ascend_specdec.register(); "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
