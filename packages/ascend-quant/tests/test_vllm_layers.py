"""The vLLM glue on real vLLM linear layers (no engine): weight creation, loading through
vLLM's loaders with our checks, post-load processing and apply (needs vLLM)."""

import socket

import pytest
import torch

from ascend_quant.errors import QuantConfigError
from ascend_quant.export import (
    ct_format,
    ct_scheme,
    export_compressed_tensors,
    export_modelslim,
)
from ascend_quant.formats.compressed_tensors import CompressedTensorsFormat
from ascend_quant.formats.modelslim import ModelSlimDescription

H, HEADS, KV_HEADS, HEAD = 64, 4, 2, 16
PREFIX = "model.layers.0"


@pytest.fixture(scope="module")
def vllm_context():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def modelslim_config(entries):
    from ascend_quant.vllm.config import AscendModelSlimConfig

    config = AscendModelSlimConfig(ModelSlimDescription(entries))
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                     "gate_up_proj": ["gate_proj", "up_proj"]}
    return config


def ct_config(groups):
    from ascend_quant.vllm.config import AscendCompressedTensorsConfig

    raw = {"quant_method": "compressed-tensors", "format": "mixed-precision",
           "config_groups": {f"g{i}": {**s.model_dump(), "format": f}
                             for i, (s, f) in enumerate(groups)}, "ignore": ["lm_head"]}
    config = AscendCompressedTensorsConfig(CompressedTensorsFormat.from_dict(raw))
    config.packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"],
                                     "gate_up_proj": ["gate_proj", "up_proj"]}
    return config


def qkv_layer(config):
    from vllm.model_executor.layers.linear import QKVParallelLinear

    return QKVParallelLinear(H, HEAD, HEADS, KV_HEADS, bias=True, quant_config=config,
                             prefix=f"{PREFIX}.self_attn.qkv_proj")


def load(layer, name, tensor, shard=None):
    param = getattr(layer, name)
    if shard is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard)


QKV_ROWS = {"q": HEADS * HEAD, "k": KV_HEADS * HEAD, "v": KV_HEADS * HEAD}


def qkv_tensors(kind):
    weights = {s: torch.randn(rows, H, generator=gen(i)) * 0.05
               for i, (s, rows) in enumerate(QKV_ROWS.items())}
    stored = {s: export_modelslim(kind, w) for s, w in weights.items()}
    return weights, stored


def test_fused_qkv_loads_processes_and_applies(vllm_context):
    from ascend_quant.vllm.linear import AscendQuantLinearMethod

    entries = {f"{PREFIX}.self_attn.{s}_proj.weight": "W8A8_DYNAMIC" for s in "qkv"}
    layer = qkv_layer(modelslim_config(entries))
    assert isinstance(layer.quant_method, AscendQuantLinearMethod)
    weights, stored = qkv_tensors("W8A8_DYNAMIC")
    for shard, tensors in stored.items():
        for name, tensor in tensors.items():
            load(layer, name, tensor, shard)
    bias = torch.randn(sum(QKV_ROWS.values()), generator=gen(9))
    layer.bias.data.copy_(bias)
    layer.quant_method.process_weights_after_loading(layer)
    assert {n for n, _ in layer.named_parameters()} == {
        "bias", "ascend_qweight", "ascend_weight_scale"}
    assert layer.ascend_qweight.dtype == torch.int8
    x = torch.randn(5, H, generator=gen(7))
    y, _ = layer(x)
    y_float = x @ torch.cat(list(weights.values())).t() + bias
    assert (y - y_float).abs().max() < 0.02 * y_float.abs().max()


def test_missing_scale_of_one_shard_is_refused(vllm_context):
    entries = {f"{PREFIX}.self_attn.{s}_proj.weight": "W8A8_DYNAMIC" for s in "qkv"}
    layer = qkv_layer(modelslim_config(entries))
    _, stored = qkv_tensors("W8A8_DYNAMIC")
    for shard, tensors in stored.items():
        for name, tensor in tensors.items():
            if not (shard == "k" and name == "weight_scale"):
                load(layer, name, tensor, shard)
    with pytest.raises(QuantConfigError) as err:
        layer.quant_method.process_weights_after_loading(layer)
    assert f"lacks {PREFIX}.self_attn.k_proj.weight_scale" in str(err.value)
    assert "uninitialised" in str(err.value)


@pytest.mark.parametrize("name,tensor,message", [
    ("weight_scale", torch.ones(QKV_ROWS["k"] + 1, 1), "k_proj.weight_scale has shape (33, 1)"),
    ("weight_scale", torch.ones(QKV_ROWS["k"]), "k_proj.weight_scale has shape (32,)"),
    ("weight", torch.ones(QKV_ROWS["k"], H), "k_proj.weight is torch.float32"),
])
def test_misshaped_or_mistyped_tensors_are_refused_at_load(vllm_context, name, tensor, message):
    entries = {f"{PREFIX}.self_attn.{s}_proj.weight": "W8A8_DYNAMIC" for s in "qkv"}
    layer = qkv_layer(modelslim_config(entries))
    with pytest.raises(QuantConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load(layer, name, tensor, "k")


def test_packed_int4_with_zero_points_in_a_merged_layer(vllm_context):
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    inter = 96
    scheme = ct_scheme("W4A16", ["Linear"], group_size=32, symmetric=False)
    fmt = ct_format("W4A16")
    layer = MergedColumnParallelLinear(H, [inter, inter], bias=False,
                                       quant_config=ct_config([(scheme, fmt)]),
                                       prefix=f"{PREFIX}.mlp.gate_up_proj")
    weights = [torch.randn(inter, H, generator=gen(20 + i)) * 0.05 for i in range(2)]
    for shard, w in enumerate(weights):
        for name, tensor in export_compressed_tensors(scheme, fmt, w).items():
            load(layer, name, tensor, shard)
    layer.quant_method.process_weights_after_loading(layer)
    assert layer.ascend_qweight_int4.dtype == torch.uint8
    x = torch.randn(3, H, generator=gen(30))
    y, _ = layer(x)
    y_float = x @ torch.cat(weights).t()
    assert (y - y_float).abs().max() < 0.15 * y_float.abs().max()


def test_weight_shape_that_disagrees_with_the_layer_is_refused(vllm_context):
    from vllm.model_executor.layers.linear import RowParallelLinear

    scheme = ct_scheme("W4A16", ["Linear"], group_size=32)
    fmt = ct_format("W4A16")
    layer = RowParallelLinear(H, H, bias=False, quant_config=ct_config([(scheme, fmt)]),
                              prefix=f"{PREFIX}.self_attn.o_proj")
    tensors = export_compressed_tensors(scheme, fmt, torch.randn(H, H, generator=gen(40)))
    with pytest.raises(QuantConfigError, match=r"weight_shape says the weight is \(64, 96\)"):
        load(layer, "weight_shape", torch.tensor([H, 96]))
    for name in ("weight_packed", "weight_scale"):
        load(layer, name, tensors[name])
    with pytest.raises(QuantConfigError, match="lacks .*o_proj.weight_shape"):
        layer.quant_method.process_weights_after_loading(layer)


def test_static_w8a8_row_parallel_with_bias(vllm_context):
    from vllm.model_executor.layers.linear import RowParallelLinear

    from ascend_quant.export import ActivationStats

    scheme = ct_scheme("W8A8", ["Linear"], act_symmetric=False)
    fmt = ct_format("W8A8")
    layer = RowParallelLinear(H, H, bias=True, quant_config=ct_config([(scheme, fmt)]),
                              prefix=f"{PREFIX}.self_attn.o_proj")
    w = torch.randn(H, H, generator=gen(50)) * 0.05
    for name, tensor in export_compressed_tensors(scheme, fmt, w,
                                                  ActivationStats(-4.5, 4.5)).items():
        load(layer, name, tensor)
    layer.bias.data.fill_(0.5)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, H, generator=gen(51))
    y, _ = layer(x)
    y_float = x @ w.t() + 0.5
    assert (y - y_float).abs().max() < 0.03 * y_float.abs().max()
