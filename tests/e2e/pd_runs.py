"""Shared by the prefill/decode end-to-end tests: the model, prompts and requests."""

from __future__ import annotations

import pathlib
import time

from ascend_plugin.serving import counter_totals, post_json

from vllm_runs import PROMPTS

MODEL = str(pathlib.Path(__file__).resolve().parents[2] / "models" / "pycoder-26m")
LONG_PROMPT = "".join(f"def function_{i}(value):\n    return value * {i}\n\n"
                      for i in range(24))  # about 300 tokens: three blocks to pull
ALL_PROMPTS = [*PROMPTS, LONG_PROMPT]
MAX_TOKENS = 16
COUNTERS = ["vllm:ascend_pd_pulls", "vllm:ascend_pd_failed_pulls",
            "vllm:ascend_pd_expired_leases", "vllm:ascend_pd_pulled_bytes"]


def completion(url: str, prompt: str, **fields) -> dict:
    return post_json(url + "/v1/completions",
                     {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                      "temperature": 0.0, **fields})


def text(reply: dict) -> str:
    return reply["choices"][0]["text"]


def counters(url: str) -> dict[str, float]:
    return counter_totals(url, COUNTERS)


def kv_cache_usage(url: str) -> float:
    return counter_totals(url, ["vllm:kv_cache_usage_perc"])["vllm:kv_cache_usage_perc"]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"{what} within {timeout} s")
