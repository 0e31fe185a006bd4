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


def mixed_prompts() -> list[str]:
    """32 prompts: 8 short ones, 16 of about 100 tokens from the held-out files, 8 long
    ones (three blocks and more) that share LONG_PROMPT's first two blocks."""
    from ascend_plugin.demo_model import held_out_prompts

    shared = [LONG_PROMPT + f"def variant_{k}(items):\n    return [item + {k} for item in items]"
              for k in range(7)]
    return [*PROMPTS, *held_out_prompts(16), LONG_PROMPT, *shared]
MAX_TOKENS = 16
COUNTERS = ["vllm:ascend_pd_pulls", "vllm:ascend_pd_failed_pulls",
            "vllm:ascend_pd_expired_leases", "vllm:ascend_pd_pulled_bytes",
            "vllm:ascend_pd_pull_seconds"]


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


def wait_for(condition, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{what} within {timeout} s")

