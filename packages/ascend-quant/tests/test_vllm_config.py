"""The vLLM quantization configs: registration, method selection, start-up checks of
msModelSlim folders (needs vLLM)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from ascend_quant.errors import QuantConfigError
from ascend_quant.export import export_modelslim

REGISTRATION_PROBE = """
import vllm
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.model_executor.layers.quantization import get_quantization_config, QUANTIZATION_METHODS
print(get_quantization_config("compressed-tensors").__module__, "ascend" in QUANTIZATION_METHODS)
"""


def probe(target):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    if target:
        env["VLLM_ASCEND_TARGET"] = target
    out = subprocess.run([sys.executable, "-c", REGISTRATION_PROBE], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_host_target_serves_compressed_tensors_and_ascend_with_our_configs():
    assert probe("host") == "ascend_quant.vllm.config True"


def test_inactive_plugin_leaves_vllm_compressed_tensors_alone():
    module, has_ascend = probe(None).split()
    assert module.startswith("vllm.") and has_ascend == "False"


def test_method_selection_from_the_checkpoint_config():
    from ascend_quant.vllm.config import AscendCompressedTensorsConfig, AscendModelSlimConfig

    assert AscendModelSlimConfig.override_quantization_method({"quant_method": ""}, None) \
        == "ascend"
    assert AscendModelSlimConfig.override_quantization_method(
        {"quant_method": "compressed-tensors"}, None) is None
    # vLLM refuses a built-in name that overrides, so ours never does.
    assert AscendCompressedTensorsConfig.override_quantization_method(
        {"quant_method": "compressed-tensors"}, None) is None
    assert torch.float32 in AscendCompressedTensorsConfig.from_config(
        {"config_groups": {}}).get_supported_act_dtypes()


def folder(tmp_path, description=True, mismatch=False):
    w = torch.randn(8, 16)
    tensors = {f"model.layers.0.mlp.down_proj.{k}": v
               for k, v in export_modelslim("W8A16", w).items()}
    desc = {"model_quant_type": "W8A16", **{k: "W8A16" for k in tensors}}
    if mismatch:
        tensors["model.layers.0.mlp.down_proj.weight_scale"] = torch.ones(9, 1)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    if description:
        (tmp_path / "quant_model_description.json").write_text(json.dumps(desc))
    return str(tmp_path)


def test_modelslim_description_is_read_and_checked_at_start_up(tmp_path):
    from ascend_quant.vllm.config import AscendModelSlimConfig

    config = AscendModelSlimConfig.from_config({"quant_method": "ascend"})
    config.maybe_update_config(folder(tmp_path))
    assert config.description.entries["model.layers.0.mlp.down_proj.weight"] == "W8A16"


def test_modelslim_folder_without_description(tmp_path):
    from ascend_quant.vllm.config import AscendModelSlimConfig

    with pytest.raises(QuantConfigError, match="needs quant_model_description.json"):
        AscendModelSlimConfig().maybe_update_config(folder(tmp_path, description=False))


def test_modelslim_description_not_matching_the_weights(tmp_path):
    from ascend_quant.vllm.config import AscendModelSlimConfig

    with pytest.raises(QuantConfigError, match=r"weight_scale has shape \(9, 1\)"):
        AscendModelSlimConfig().maybe_update_config(folder(tmp_path, mismatch=True))


def test_detection_of_modelslim_folders(tmp_path):
    from ascend_quant.vllm.detect import detect_method

    assert detect_method(folder(tmp_path)) == "ascend"
    assert detect_method(str(tmp_path / "nowhere")) is None


DETECTION_PROBE = """
import sys
from vllm.engine.arg_utils import EngineArgs
from ascend_quant.hooks import select_checkpoint_quantization
config = EngineArgs(model=sys.argv[1], dtype="float32", max_model_len=128,
                    enforce_eager=True, skip_tokenizer_init=True).create_engine_config()
before = type(config.quant_config).__name__
select_checkpoint_quantization(config)
print(before, config.model_config.quantization, type(config.quant_config).__name__,
      len(config.quant_config.description.entries))
"""


def test_host_platform_hook_selects_ascend_for_a_modelslim_folder(tmp_path):
    """The host platform's check_and_update_config runs the hook (core's CONFIG_HOOKS), so
    the engine config of an msModelSlim folder already has our config; running the hook
    again changes nothing."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from ascend_quant.writers import Group, write_modelslim

    config = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, vocab_size=256)
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path / "float"))
    model = write_modelslim(tmp_path / "float", tmp_path / "ms",
                            [Group(r".*_proj", "W8A8_DYNAMIC")])
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    env["VLLM_ASCEND_TARGET"] = "host"
    out = subprocess.run([sys.executable, "-c", DETECTION_PROBE, str(model)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, method, config, entries = out.stdout.strip().splitlines()[-1].split()
    assert (before, method, config) == ("AscendModelSlimConfig", "ascend",
                                        "AscendModelSlimConfig")
    assert int(entries) > 0
