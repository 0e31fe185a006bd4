"""Checkpoint formats: compressed-tensors configs (read with the library) and msModelSlim
descriptions, including the refusals a user sees at start-up."""

import json

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file

from ascend_quant.errors import QuantConfigError
from ascend_quant.export import ct_scheme, export_modelslim
from ascend_quant.formats.compressed_tensors import CompressedTensorsFormat, classify
from ascend_quant.formats.modelslim import (
    ModelSlimDescription,
    check_against_checkpoint,
    read_checkpoint_headers,
)


def linear(out=8, inp=16):
    return torch.nn.Linear(inp, out, device="meta")


@pytest.mark.parametrize("name,kw,fmt", [
    ("W8A8", {}, "int-quantized"),
    ("W8A8_DYNAMIC", {}, "int-quantized"),
    ("W8A16", {"group_size": 128}, "pack-quantized"),
    ("W8A16", {}, "naive-quantized"),
    ("W4A16", {"group_size": 128, "symmetric": False}, "pack-quantized"),
    ("W4A8_DYNAMIC", {"group_size": 128}, "pack-quantized"),
    ("W4A4_DYNAMIC", {}, "int-quantized"),
])
def test_compressed_tensors_schemes_are_classified(name, kw, fmt):
    choice = classify(ct_scheme(name, ["Linear"], **kw), fmt, "layer")
    assert choice.name == name
    assert choice.options.group_size == kw.get("group_size")
    assert choice.options.weight_symmetric == kw.get("symmetric", True)
    assert choice.options.packed == (fmt == "pack-quantized")


def _args(**kw):
    return QuantizationArgs(**kw)


@pytest.mark.parametrize("scheme,fmt,why", [
    (QuantizationScheme(targets=["Linear"], weights=_args(num_bits=8, type="float"),
                        input_activations=_args(num_bits=8, type="float", strategy="token",
                                                dynamic=True)),
     "float-quantized", "float weights"),
    (QuantizationScheme(targets=["Linear"], weights=_args(num_bits=2, strategy="channel")),
     "pack-quantized", "2-bit weights"),
    (QuantizationScheme(targets=["Linear"], weights=_args(num_bits=8, strategy="block",
                                                          block_structure=[128, 128])),
     "int-quantized", "weight strategy 'block'"),
    (QuantizationScheme(targets=["Linear"], weights=_args(num_bits=8, strategy="channel"),
                        input_activations=_args(num_bits=8, strategy="token", dynamic=True,
                                                symmetric=False)),
     "int-quantized", "asymmetric dynamic activations"),
    (QuantizationScheme(targets=["Linear"], weights=_args(num_bits=4, strategy="channel"),
                        input_activations=_args(num_bits=8, strategy="tensor")),
     "int-quantized", "4-bit weights with 8-bit static"),
    (QuantizationScheme(targets=["Linear"], weights=_args(num_bits=8, strategy="channel")),
     "marlin-24", "storage format 'marlin-24'"),
])
def test_unsupported_compressed_tensors_schemes_are_named(scheme, fmt, why):
    with pytest.raises(QuantConfigError) as err:
        classify(scheme, fmt, "model.layers.0.mlp.down_proj")
    text = str(err.value)
    assert "'model.layers.0.mlp.down_proj'" in text and why in text
    assert "Supported: W8A8:" in text and "W4A4_DYNAMIC:" in text


def ct_config(groups, ignore=("lm_head",), **extra):
    return {"quant_method": "compressed-tensors", "format": "mixed-precision",
            "config_groups": {f"g{i}": {**g.model_dump(), "format": fmt}
                              for i, (g, fmt) in enumerate(groups)},
            "ignore": list(ignore), **extra}


def test_compressed_tensors_matching_follows_the_library():
    raw = ct_config([(ct_scheme("W8A8_DYNAMIC", ["Linear"]), "int-quantized"),
                     (ct_scheme("W4A16", ["re:.*down_proj"], group_size=32),
                      "pack-quantized"),
                     (ct_scheme("W8A16", ["model.layers.1.mlp.down_proj"]), "naive-quantized")],
                    ignore=["lm_head", "re:.*layers\\.3\\..*"], total_num_heads=4)
    fmt = CompressedTensorsFormat.from_dict(raw)
    resolve = lambda name: fmt.resolve(name, [name], linear())  # noqa: E731
    assert resolve("model.layers.0.self_attn.o_proj").name == "W8A8_DYNAMIC"
    assert resolve("model.layers.0.mlp.down_proj").name == "W4A16"     # regex over class
    assert resolve("model.layers.1.mlp.down_proj").name == "W8A16"     # exact over regex
    assert resolve("model.layers.3.mlp.down_proj") is None             # ignored
    assert fmt.resolve("lm_head", ["lm_head"], linear()) is None


def test_fused_shards_with_different_schemes_are_refused():
    raw = ct_config([(ct_scheme("W8A8_DYNAMIC", ["re:.*(q|k)_proj"]), "int-quantized"),
                     (ct_scheme("W8A16", ["re:.*v_proj"]), "naive-quantized")])
    fmt = CompressedTensorsFormat.from_dict(raw)
    shards = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    with pytest.raises(QuantConfigError) as err:
        fmt.resolve("model.layers.0.self_attn.qkv_proj", shards, linear())
    text = str(err.value)
    assert "'model.layers.0.self_attn.qkv_proj' fuses shards quantized differently" in text
    assert "v_proj: W8A16" in text and "q_proj: W8A8_DYNAMIC" in text


def test_a_shard_left_unquantized_is_refused_too():
    raw = ct_config([(ct_scheme("W8A8_DYNAMIC", ["re:.*gate_proj"]), "int-quantized")])
    fmt = CompressedTensorsFormat.from_dict(raw)
    with pytest.raises(QuantConfigError, match="up_proj: unquantized"):
        fmt.resolve("m.gate_up_proj", ["m.gate_proj", "m.up_proj"], linear())


def test_compressed_tensors_features_without_a_path_are_refused():
    kv = ct_config([(ct_scheme("W8A8_DYNAMIC", ["Linear"]), "int-quantized")],
                   kv_cache_scheme={"num_bits": 8, "type": "float", "strategy": "tensor"})
    with pytest.raises(QuantConfigError, match="kv_cache_scheme"):
        CompressedTensorsFormat.from_dict(kv)
    with pytest.raises(QuantConfigError, match="not a valid compressed-tensors"):
        CompressedTensorsFormat.from_dict({"config_groups": {"g": {"targets": 3}}})


# --------------------------------------------------------------------------- msModelSlim

N, K = 16, 32


def modelslim_folder(tmp_path, layers, extra_tensors=None, edit=None):
    """Write a tiny msModelSlim checkpoint: ``layers`` maps module -> type."""
    g = torch.Generator().manual_seed(0)
    tensors, desc = {}, {"model_quant_type": "W8A8_DYNAMIC", "version": "1.0.0"}
    for module, type_name in layers.items():
        w = torch.randn(N, K, generator=g)
        stored = {"weight": w} if type_name == "FLOAT" else export_modelslim(type_name, w)
        for local, value in stored.items():
            tensors[f"{module}.{local}"] = value
            desc[f"{module}.{local}"] = type_name
    tensors.update(extra_tensors or {})
    if edit:
        edit(tensors, desc)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "quant_model_description.json").write_text(json.dumps(desc))
    return ModelSlimDescription.from_file(tmp_path / "quant_model_description.json")


LAYERS = {"model.layers.0.self_attn.q_proj": "W8A8_DYNAMIC",
          "model.layers.0.self_attn.k_proj": "W8A8_DYNAMIC",
          "model.layers.0.mlp.down_proj": "W8A16",
          "model.layers.0.mlp.up_proj": "FLOAT"}


def test_matching_description_passes_and_resolves(tmp_path):
    desc = modelslim_folder(tmp_path, LAYERS)
    check_against_checkpoint(desc, read_checkpoint_headers(tmp_path))
    assert desc.choice_for("model.layers.0.mlp.down_proj").name == "W8A16"
    assert desc.choice_for("model.layers.0.mlp.up_proj") is None
    shards = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    assert desc.resolve("model.layers.0.self_attn.qk", shards).name == "W8A8_DYNAMIC"


@pytest.mark.parametrize("edit,message", [
    (lambda t, d: t.pop("model.layers.0.mlp.down_proj.weight_scale"),
     "described but not in the checkpoint: model.layers.0.mlp.down_proj.weight_scale"),
    (lambda t, d: (t.pop("model.layers.0.mlp.down_proj.weight_scale"),
                   d.pop("model.layers.0.mlp.down_proj.weight_scale")),
     "model.layers.0.mlp.down_proj.weight_scale is missing; W8A16 stores it"),
    (lambda t, d: t.__setitem__("model.layers.0.mlp.down_proj.weight_scale",
                                torch.ones(N + 1, 1)),
     "weight_scale has shape (17, 1); W8A16 stores (16, 1)"),
    (lambda t, d: t.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.ones(N, K)),
     "q_proj.weight is stored as torch.float32; W8A8_DYNAMIC stores torch.int8"),
    (lambda t, d: d.__setitem__("model.layers.0.mlp.up_proj.weight", "W8A8_DYNAMIC"),
     "up_proj.weight is stored as torch.float32"),
    (lambda t, d: t.__setitem__("model.layers.0.extra.weight", torch.ones(2)),
     "in the checkpoint but not described: model.layers.0.extra.weight"),
    (lambda t, d: d.__setitem__("model.layers.0.self_attn.k_proj.weight_scale", "W8A16"),
     "k_proj.weight_scale is described W8A16 but its weight"),
])
def test_description_that_does_not_match_the_weights_is_refused(tmp_path, edit, message):
    desc = modelslim_folder(tmp_path, LAYERS, edit=edit)
    with pytest.raises(QuantConfigError) as err:
        check_against_checkpoint(desc, read_checkpoint_headers(tmp_path))
    assert "does not match the checkpoint's weights" in str(err.value)
    assert message in str(err.value)


def test_unsupported_modelslim_type_is_named_with_the_supported_list(tmp_path):
    desc = modelslim_folder(
        tmp_path, LAYERS,
        edit=lambda t, d: d.update({k: "W8A8_MIX" for k in d if "down_proj" in k}))
    with pytest.raises(QuantConfigError) as err:
        check_against_checkpoint(desc, read_checkpoint_headers(tmp_path))
    text = str(err.value)
    assert "'model.layers.0.mlp.down_proj'" in text and "'W8A8_MIX'" in text
    assert "supported: W4A4_DYNAMIC, W4A8_DYNAMIC, W8A16, W8A8, W8A8_DYNAMIC" in text


def test_modelslim_fused_shards_must_agree(tmp_path):
    layers = dict(LAYERS, **{"model.layers.0.self_attn.k_proj": "W8A16"})
    desc = modelslim_folder(tmp_path, layers)
    shards = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    with pytest.raises(QuantConfigError, match="k_proj: W8A16"):
        desc.resolve("model.layers.0.self_attn.qkv_proj", shards)


def test_modelslim_layer_missing_from_the_description(tmp_path):
    desc = modelslim_folder(tmp_path, LAYERS)
    with pytest.raises(QuantConfigError, match="has no entry for 'model.layers.0.mlp.gate_proj"):
        desc.choice_for("model.layers.0.mlp.gate_proj")


def test_modelslim_experts(tmp_path):
    layers = {f"model.layers.0.mlp.experts.{e}.{p}": "W8A8_DYNAMIC"
              for e in range(3) for p in ("gate_proj", "up_proj", "down_proj")}
    desc = modelslim_folder(tmp_path, layers)
    check_against_checkpoint(desc, read_checkpoint_headers(tmp_path))
    assert desc.resolve_experts("model.layers.0.mlp.experts").name == "W8A8_DYNAMIC"
    desc.entries["model.layers.0.mlp.experts.2.up_proj.weight"] = "FLOAT"
    with pytest.raises(QuantConfigError, match="experts.2.up_proj: unquantized"):
        desc.resolve_experts("model.layers.0.mlp.experts")


def test_modelslim_unserved_features_and_bad_files(tmp_path):
    with pytest.raises(QuantConfigError, match="kv_cache_type='C8'"):
        ModelSlimDescription({"kv_cache_type": "C8", "a.weight": "FLOAT"})
    with pytest.raises(QuantConfigError, match="describes no tensors"):
        ModelSlimDescription({"model_quant_type": "W8A8"})
    bad = tmp_path / "quant_model_description.json"
    bad.write_text("{not json")
    with pytest.raises(QuantConfigError, match="not valid JSON"):
        ModelSlimDescription.from_file(bad)
