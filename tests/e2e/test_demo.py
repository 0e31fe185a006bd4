"""The README's main job: the demo serves through the plugin and prints answers."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_serves_and_answers(tmp_path, llama_dir):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    proc = subprocess.run([sys.executable, "-m", "ascend_plugin.demo", "--max-tokens", "8",
                           "--log", str(tmp_path / "server.log")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert out.count("/v1/completions  prompt:") == 2
    assert out.count("/v1/chat/completions  user:") == 2
    answers = [line for line in out.splitlines() if line.startswith("  -> ")]
    assert len(answers) == 4 and all(len(a) > len("  -> ''") for a in answers)
    log = (tmp_path / "server.log").read_text()
    assert "Ascend plugin active: host target (AscendHostPlatform)" in log
    assert llama_dir in log  # the demo model is the cached tiny Llama
