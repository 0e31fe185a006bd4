"""What ascend_quant.register() puts into ascend-core's registries."""

import ascend_quant
from ascend_core import registry
from ascend_core.registry import QUANT_CONFIGS, QUANT_SCHEMES, Registry
from ascend_quant.hooks import select_checkpoint_quantization
from ascend_quant.lookup import supported_names
from ascend_quant.schemes import COMPRESSED_TENSORS, MODELSLIM, W4A16, MoEW8A8Dynamic


def test_schemes_and_configs_are_registered_by_name():
    ascend_quant.register()
    ascend_quant.register()  # idempotent
    for name in ("W8A8", "W8A8_DYNAMIC", "W8A16", "W4A16", "W4A8_DYNAMIC", "W4A4_DYNAMIC"):
        assert QUANT_SCHEMES.get(name).name == name
    assert QUANT_SCHEMES.get("W4A16") is W4A16
    assert QUANT_SCHEMES.get("moe:W8A8_DYNAMIC") is MoEW8A8Dynamic
    assert QUANT_CONFIGS.get("compressed-tensors").endswith("AscendCompressedTensorsConfig")
    assert QUANT_CONFIGS.get("ascend").endswith("AscendModelSlimConfig")


def test_supported_lists_per_layout():
    assert "W4A16" in supported_names(COMPRESSED_TENSORS)
    assert "W4A16" not in supported_names(MODELSLIM)
    assert supported_names(MODELSLIM, moe=True) == ["W8A8_DYNAMIC"]


def test_config_hook_is_registered_when_core_offers_the_registry(monkeypatch):
    hooks = Registry("vLLM config hook")
    monkeypatch.setattr(registry, "CONFIG_HOOKS", hooks, raising=False)
    ascend_quant.register()
    assert hooks.get(ascend_quant.CONFIG_HOOK_NAME) is select_checkpoint_quantization
