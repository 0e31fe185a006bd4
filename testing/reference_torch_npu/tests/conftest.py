"""Fixtures of the reference torch_npu's own tests: the reference first on ``sys.path`` for a
test module, imported from there, and taken off again (its npu device uninstalled) after."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

REFERENCE_PATH = str(Path(__file__).resolve().parents[1])
# The reference's settings; cleared by ``fresh_torch_npu`` so a test starts from the defaults.
ENV_VARS = (
    "TORCH_NPU_REFERENCE_DEVICE_COUNT",
    "TORCH_NPU_REFERENCE_TOTAL_MEMORY",
    "TORCH_NPU_REFERENCE_DEVICE_NAME",
    "ASCEND_RT_VISIBLE_DEVICES",
)


@pytest.fixture(scope="module")
def reference_on_path():
    sys.path.insert(0, REFERENCE_PATH)
    importlib.invalidate_caches()
    yield
    if "torch_npu" in sys.modules:
        importlib.import_module("torch_npu._reference").uninstall()
    sys.path.remove(REFERENCE_PATH)


@pytest.fixture(scope="module")
def torch_npu(reference_on_path):
    """The reference torch_npu, imported once for the module's tests."""
    module = importlib.import_module("torch_npu")
    module._reference.reset_state()
    return module


@pytest.fixture
def fresh_torch_npu(reference_on_path, monkeypatch):
    """The reference with its settings cleared and its state reset around one test."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    module = importlib.import_module("torch_npu")
    module._reference.reset_state()
    yield module
    module._reference.reset_state()
