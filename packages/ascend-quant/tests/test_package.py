"""Package contract: usable on its own, registration idempotent, no vLLM at import."""

import subprocess
import sys
from importlib.metadata import version

import ascend_quant


def test_version_matches_the_installed_distribution():
    assert ascend_quant.__version__ == version("ascend-quant")


def test_import_and_register_pull_in_no_vllm():
    code = ("import sys, ascend_quant; ascend_quant.register(); ascend_quant.register(); "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
