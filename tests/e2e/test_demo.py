"""The README's main job: the demo serves through the plugin and prints answers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def run_demo(*args: str, log) -> str:
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    proc = subprocess.run([sys.executable, "-m", "ascend_plugin.demo", "--log", str(log), *args],
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


# The plain and --pd demos run as a user runs them (vLLM compiles the model; --pd must give
# the plain run's answers, and an eager bf16 forward rounds apart from the compiled one);
# the --medusa run passes vLLM's --enforce-eager after "--": compiling the model with its
# heads costs that run about 60 s of a 2-core machine.
EAGER = ("--", "--enforce-eager")


def answers_of(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("  -> ")]


@pytest.fixture(scope="module")
def plain_demo(tmp_path_factory) -> tuple[str, Path]:
    log = tmp_path_factory.mktemp("demo") / "server.log"
    return run_demo("--max-tokens", "8", log=log), log


def test_demo_serves_and_answers(plain_demo):
    from ascend_plugin.demo_model import demo_model_dir

    out, log_path = plain_demo
    assert out.count("/v1/completions  prompt:") == 2
    assert out.count("/v1/chat/completions  user:") == 2
    answers = answers_of(out)
    assert len(answers) == 4 and all(len(a) > len("  -> ''") for a in answers)
    log = log_path.read_text()
    assert "Ascend plugin active: host target (AscendHostPlatform)" in log
    assert str(demo_model_dir()) in log  # the demo model is the committed pycoder-26m
    # It writes Python: the completion of "def fibonacci(n):" opens an indented body.
    assert answers[0].startswith("  -> '\\n    ")


def test_demo_with_pd_answers_what_the_plain_demo_answers(plain_demo, tmp_path):
    out = run_demo("--pd", "--max-tokens", "8", log=tmp_path / "server.log")
    assert re.search(r"\[demo\] prefill http://127\.0\.0\.1:\d+, decode http://127\.0\.0\.1:\d+, "
                     r"proxy http://127\.0\.0\.1:\d+ ready", out), out[-2000:]
    assert answers_of(out) == answers_of(plain_demo[0])
    assert ("the decode instance pulled the KV blocks of 4 prompts from the prefill instance "
            "(0 pulls failed and were recomputed)") in out
    for name in ("prefill-0", "decode-0", "proxy"):
        assert (tmp_path / f"{name}.log").is_file()
    assert "Ascend plugin active: host target" in (tmp_path / "prefill-0.log").read_text()


def test_demo_with_medusa_reports_acceptance(tmp_path):
    from ascend_plugin.demo_model import demo_medusa_dir, demo_model_dir

    base, heads = str(demo_model_dir()), str(demo_medusa_dir())
    out = run_demo("--medusa", "--max-tokens", "32", *EAGER, log=tmp_path / "server.log")
    assert out.count("  -> ") == 4
    found = re.search(r"Medusa: (\d+) drafts, (\d+) of (\d+) draft tokens accepted, "
                      r"mean acceptance length ([0-9.]+) \(([0-9.]+) draft tokens per draft, "
                      r"at most k=3\)", out)
    assert found, out[-2000:]
    drafts, accepted, proposed = (int(found.group(i)) for i in (1, 2, 3))
    assert drafts > 0 and drafts <= proposed <= 3 * drafts and 0 < accepted <= proposed
    assert float(found.group(4)) == round(1 + accepted / drafts, 2)
    assert float(found.group(5)) == round(proposed / drafts, 2)
    # The plugin's /metrics histogram of the lengths verified agrees with vLLM's counters.
    lengths = re.search(r"draft lengths requests were verified with \(requests x steps\): "
                        r"([0-9: ,]+)\n", out)
    assert lengths, out[-2000:]
    histogram = {int(k): int(v) for k, v in
                 (pair.split(": ") for pair in lengths.group(1).split(", "))}
    assert sum(n for k, n in histogram.items() if k) == drafts
    assert sum(k * n for k, n in histogram.items()) == proposed
    assert set(histogram) <= {0, 1, 2, 3}
    log = (tmp_path / "server.log").read_text()
    assert "Ascend plugin active: host target" in log
    assert heads in log and base in log


def test_training_the_demo_model_without_a_gpu_says_how_to_train_on_the_cpu(tmp_path):
    script = Path(__file__).resolve().parents[2] / "tools" / "train_demo_model.py"
    proc = subprocess.run([sys.executable, str(script), "train", "--corpus", "unused",
                           "--out", str(tmp_path / "model")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    assert "no CUDA GPU is visible" in proc.stderr and "--device cpu" in proc.stderr
    assert not (tmp_path / "model").exists()
