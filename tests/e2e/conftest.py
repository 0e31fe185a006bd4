"""Shared fixtures for the host end-to-end tests.

Engine starts are the cost here (about 30 s each on 2 cores), so each
configuration runs once per test session and tests share the results.
"""

from __future__ import annotations

import pytest

from vllm_runs import PROMPTS, RUN_LLM, pin_xdist_worker_to_one_core, run_script, run_vllm


def pytest_configure(config) -> None:
    pin_xdist_worker_to_one_core()


@pytest.fixture(scope="session")
def llama_dir() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("llama"))


@pytest.fixture(scope="session")
def stock_llama(llama_dir) -> dict:
    """Stock vLLM with the plugin installed but no target active; "log": its whole output."""
    result, log = run_script(RUN_LLM, {"model": llama_dir, "prompts": PROMPTS})
    return {**result, "log": log}


@pytest.fixture(scope="session")
def plugin_llama(llama_dir) -> dict:
    return run_vllm({"model": llama_dir, "prompts": PROMPTS}, {"VLLM_ASCEND_TARGET": "host"})


@pytest.fixture(scope="session")
def model() -> str:
    """The trained demo model (pycoder-26m)."""
    from ascend_plugin.demo_model import demo_model_dir

    return str(demo_model_dir())
