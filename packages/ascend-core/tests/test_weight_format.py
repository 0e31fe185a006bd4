"""weight_nz_mode / VLLM_ASCEND_ENABLE_NZ (ascend_core.worker.weight_format) on the reference
torch_npu: which weights the npu runner casts to FRACTAL_NZ after loading."""

from __future__ import annotations

import socket

import pytest
import torch

from ascend_core import envs
from ascend_core.config import AscendConfig, AscendConfigError
from ascend_core.worker.weight_format import cast_weights_to_nz, nz_mode

from npu_reference import reference_torch_npu

NZ = 29


@pytest.mark.parametrize(("key", "env", "mode"), [
    (None, None, 1),  # the documented default: quantized weights only
    (None, "2", 2),
    (None, "0", 0),
    (2, "0", 2),  # additional_config takes precedence
    (0, "2", 0),
])
def test_the_key_takes_precedence_over_the_variable(monkeypatch, key, env, mode):
    if env is None:
        monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", env)
    config = AscendConfig.from_dict({} if key is None else {"weight_nz_mode": key})
    assert nz_mode(config) == mode


def test_bad_values_are_refused_with_the_allowed_ones(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "3")
    with pytest.raises(envs.EnvVarError, match="VLLM_ASCEND_ENABLE_NZ"):
        nz_mode(AscendConfig.from_dict({}))
    with pytest.raises(AscendConfigError, match=r"'weight_nz_mode' must be one of 0, 1, 2, "
                                                r"got 3"):
        AscendConfig.from_dict({"weight_nz_mode": 3})


@pytest.fixture(scope="module")
def reference_npu():
    with reference_torch_npu() as module:
        yield module


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


class QuantizedLayer(torch.nn.Module):
    """Stands in for an ascend-quant layer: it lists the tensor its matmul takes in NZ."""

    ascend_nz_weights = ("ascend_npu_qweight",)

    def __init__(self) -> None:
        super().__init__()
        self.ascend_npu_qweight = torch.nn.Parameter(
            torch.randint(-8, 8, (32, 16), dtype=torch.int8), requires_grad=False)
        self.ascend_weight_scale = torch.nn.Parameter(torch.rand(16), requires_grad=False)


def model_on(device):
    from vllm.model_executor.layers.linear import ReplicatedLinear

    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(10, 32)
    model.proj = ReplicatedLinear(32, 16, bias=True, prefix="proj")
    model.quantized = QuantizedLayer()
    # vLLM's linear layers allocate their weights empty (the loader fills them): give them
    # values, or the outputs compared below can hold NaN, which never equals itself.
    torch.nn.init.normal_(model.proj.weight)
    torch.nn.init.normal_(model.proj.bias)
    return model.to(device)


def nz_names(model, torch_npu):
    return sorted(name for name, p in model.named_parameters()
                  if torch_npu.get_npu_format(p) == NZ)


@pytest.mark.parametrize(("mode", "quantized", "float_weights"), [
    (0, [], []),
    (1, ["quantized.ascend_npu_qweight"], []),
    (2, ["quantized.ascend_npu_qweight"], ["proj.weight"]),
])
def test_each_mode_casts_its_weights_and_outputs_stay(reference_npu, vllm_context, mode,
                                                      quantized, float_weights):
    model = model_on("npu")
    x = torch.randn(3, 32).npu()
    # What vLLM's UnquantizedLinearMethod computes on the npu platform.
    def proj():
        return torch.nn.functional.linear(x, model.proj.weight, model.proj.bias).cpu()

    before = proj()
    cast = cast_weights_to_nz(model, mode, reference_npu)
    assert (cast.quantized, cast.float) == (quantized, float_weights)
    assert nz_names(model, reference_npu) == sorted(quantized + float_weights)
    assert torch.equal(proj(), before)  # F.linear reads the NZ weight


def test_weights_off_the_npu_are_left_alone(reference_npu, vllm_context):
    cast = cast_weights_to_nz(model_on("cpu"), 2, reference_npu)
    assert (cast.quantized, cast.float) == ([], [])
