"""Heads checkpoints: safetensors with vLLM's names, read back exactly, bad files refused."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ascend_specdec.medusa import MedusaConfigError, load_heads, save_heads

from medusa_cases import random_heads


@pytest.mark.parametrize("fields", [{}, {"original_lm_head": True, "truncated_vocab_size": 12},
                                    {"num_hidden_layers": 2, "medusa_fc_bias": True}])
def test_round_trip(tmp_path, fields):
    heads = random_heads(**fields)
    save_heads(heads, tmp_path)
    loaded = load_heads(tmp_path)
    assert loaded.config == heads.config
    for (name, mine), (other, theirs) in zip(heads.state_dict().items(),
                                             loaded.state_dict().items()):
        assert name == other and torch.equal(mine, theirs)
    hidden = torch.randn(5, 16)
    assert torch.equal(loaded.propose(hidden), heads.propose(hidden))


def test_tensor_names_are_the_ones_vllms_medusa_loads(tmp_path):
    save_heads(random_heads(num_hidden_layers=2, medusa_fc_bias=True), tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert names == {f"blocks.{h}.layers.{n}.{p}" for h in range(3) for n in range(2)
                     for p in ("weight", "bias")} | {f"lm_heads.{h}.weight" for h in range(3)}
    save_heads(random_heads(original_lm_head=True, truncated_vocab_size=12), tmp_path)
    names = set(load_file(tmp_path / "model.safetensors"))
    assert {"lm_head.weight", "token_map"} <= names
    assert not any(name.startswith("lm_heads") for name in names)


def test_saved_in_the_requested_dtype(tmp_path):
    save_heads(random_heads(truncated_vocab_size=12), tmp_path, dtype=torch.bfloat16)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["lm_heads.0.weight"].dtype == torch.bfloat16
    assert tensors["token_map"].dtype == torch.long
    assert load_heads(tmp_path, dtype=torch.bfloat16).lm_heads[0].weight.dtype == torch.bfloat16


def test_faster_decoding_names_and_prefix_are_read(tmp_path):
    heads = random_heads(num_hidden_layers=1)
    heads.config.save(tmp_path)
    renamed = {}
    for name, tensor in heads.state_dict().items():
        parts = name.split(".")
        if parts[0] == "blocks":  # blocks.{h}.layers.0.weight -> {h}.0.linear.weight
            renamed[f"medusa_heads.{parts[1]}.{parts[3]}.linear.{parts[4]}"] = tensor
        else:  # lm_heads.{h}.weight -> {h}.1.weight
            renamed[f"{parts[1]}.1.weight"] = tensor
    save_file(renamed, str(tmp_path / "model.safetensors"))
    hidden = torch.randn(4, 16)
    assert torch.equal(load_heads(tmp_path).propose(hidden), heads.propose(hidden))


def test_whole_vocabulary_lm_head_is_cut_by_the_token_map(tmp_path):
    # vLLM's loader slices LM-head rows with token_map when the checkpoint has every row.
    heads = random_heads(original_lm_head=True, truncated_vocab_size=12)
    heads.config.save(tmp_path)
    full = torch.randn(40, 16)
    full[heads.token_map] = heads.lm_head.weight.detach()
    tensors = {k: v for k, v in heads.state_dict().items() if k != "lm_head.weight"}
    save_file({**tensors, "lm_head.weight": full}, str(tmp_path / "model.safetensors"))
    loaded = load_heads(tmp_path)
    assert torch.equal(loaded.lm_head.weight, heads.lm_head.weight)


def test_missing_weights_are_named(tmp_path):
    heads = random_heads()
    heads.config.save(tmp_path)
    tensors = {k: v for k, v in heads.state_dict().items() if not k.startswith("blocks.2.")}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MedusaConfigError, match=r"no weights for \['blocks.2.layers.0.weight'"):
        load_heads(tmp_path)


def _vllm_format_folder(folder, heads, config_fields: dict, drop=()) -> None:
    """A heads folder as other tools write it: config.json with only the given fields."""
    config = {"architectures": ["MedusaModel"], "hidden_size": 16, "vocab_size": 40,
              "num_heads": 3, **config_fields}
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v for k, v in heads.state_dict().items() if not k.endswith(drop or "-")},
              str(folder / "model.safetensors"))


def test_a_config_without_medusa_fc_bias_and_blocks_without_bias_loads(tmp_path):
    heads = random_heads()  # no bias, vLLM's default
    _vllm_format_folder(tmp_path, heads, {})
    loaded = load_heads(tmp_path)
    assert not loaded.config.medusa_fc_bias
    hidden = torch.randn(5, 16)
    assert torch.equal(loaded.propose(hidden), heads.propose(hidden))


def test_bias_tensors_the_config_does_not_declare_are_refused(tmp_path):
    _vllm_format_folder(tmp_path, random_heads(medusa_fc_bias=True), {})
    with pytest.raises(MedusaConfigError, match=r"residual-block biases \['blocks.0.layers.0.bias'"
                                                 r".*set \"medusa_fc_bias\": true"):
        load_heads(tmp_path)


def test_a_declared_bias_missing_from_the_weights_is_refused(tmp_path):
    _vllm_format_folder(tmp_path, random_heads(medusa_fc_bias=True), {"medusa_fc_bias": True},
                        drop=".bias")
    with pytest.raises(MedusaConfigError, match=r"medusa_fc_bias: true\) but the weights have "
                                                 r"none for \['blocks.0.layers.0.bias'"):
        load_heads(tmp_path)


def test_truncated_config_without_token_map_is_refused(tmp_path):
    heads = random_heads(original_lm_head=True, truncated_vocab_size=12)
    heads.config.save(tmp_path)
    tensors = {k: v for k, v in heads.state_dict().items() if k != "token_map"}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(MedusaConfigError, match="needs a 'token_map' tensor"):
        load_heads(tmp_path)


def test_wrong_shapes_are_refused(tmp_path):
    save_heads(random_heads(medusa_fc_bias=True), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "hidden_size": 32}))
    with pytest.raises(MedusaConfigError, match=r"bias has shape \(16,\), expected \(32,\)"):
        load_heads(tmp_path)


def test_pickled_weights_are_never_loaded(tmp_path):
    heads = random_heads()
    heads.config.save(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(MedusaConfigError, match=r"no \*.safetensors.*pytorch_model.bin.*pickled"):
        load_heads(tmp_path)
