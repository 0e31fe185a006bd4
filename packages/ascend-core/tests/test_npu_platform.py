"""Contract of the npu target (platform, worker, detection), run on the reference torch_npu.

The reference (``testing/reference_torch_npu``) stands in for torch_npu, which cannot be
imported without CANN; it is put first on ``sys.path`` for this module only and removed,
with everything imported through it, afterwards.
"""

from __future__ import annotations

import importlib
import math
import os
import sys

import pytest
import torch
import vllm.platforms
from vllm.config import CacheConfig, ParallelConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode, CUDAGraphMode
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.utils.import_utils import resolve_obj_by_qualname
from vllm.v1.worker.gpu_worker import Worker

from ascend_core.config import reset_ascend_config

from npu_reference import REFERENCE_PATH, reference_on_path

GiB = 1024**3
ALLOC_CONF = "PYTORCH_NPU_ALLOC_CONF"
REFERENCE_ENV = (
    "TORCH_NPU_REFERENCE_DEVICE_COUNT",
    "TORCH_NPU_REFERENCE_TOTAL_MEMORY",
    "TORCH_NPU_REFERENCE_DEVICE_NAME",
    "ASCEND_RT_VISIBLE_DEVICES",
    ALLOC_CONF,
)
# Modules that hold on to torch_npu once imported; dropped when the module's tests end.
NPU_MODULES = (
    "ascend_core.platform.npu",
    "ascend_core.worker.npu_worker",
    "ascend_core.distributed.npu_communicator",
)


@pytest.fixture(scope="module")
def npu_module():
    """``ascend_core.platform.npu`` imported over the reference torch_npu."""
    with reference_on_path(forget=NPU_MODULES):
        yield importlib.import_module("ascend_core.platform.npu")


@pytest.fixture
def npu(npu_module, monkeypatch):
    """The platform module, with a fresh reference device and no reference variables set."""
    for name in REFERENCE_ENV:
        monkeypatch.delenv(name, raising=False)
    reference = importlib.import_module("torch_npu._reference")
    reference.reset_state()
    yield npu_module
    reference.reset_state()
    reset_ascend_config()


@pytest.fixture
def reference(npu):
    return importlib.import_module("torch_npu._reference")


@pytest.fixture
def on_npu_platform(npu, monkeypatch):
    """Make AscendPlatform vLLM's current platform, as the plugin's entry point does."""
    monkeypatch.setattr(vllm.platforms, "_current_platform", npu.AscendPlatform())
    return npu.AscendPlatform


# --- the platform's declaration -----------------------------------------------------------


def test_platform_declares_an_out_of_tree_npu_device(npu):
    platform = npu.AscendPlatform
    assert issubclass(platform, Platform)
    assert platform._enum is PlatformEnum.OOT
    assert platform().is_out_of_tree() and not platform().is_cuda_alike()
    assert (platform.device_name, platform.device_type) == ("npu", "npu")
    assert platform.dispatch_key == "PrivateUse1"
    assert platform.ray_device_key == "NPU"
    assert platform.dist_backend == "hccl"
    assert platform.device_control_env_var == "ASCEND_RT_VISIBLE_DEVICES"
    assert platform.simple_compile_backend == "eager"
    assert platform.get_compile_backend() == "eager"


def test_dotted_paths_name_real_classes(npu):
    communicator = resolve_obj_by_qualname(npu.AscendPlatform.get_device_communicator_cls())
    assert issubclass(communicator, DeviceCommunicatorBase)
    assert issubclass(resolve_obj_by_qualname(npu.NPU_WORKER), Worker)


def test_attention_backend_is_the_ascend_one(npu):
    # Selection and refusals in detail: tests/test_attention_npu.py.
    from vllm.v1.attention.selector import AttentionSelectorConfig

    config = AttentionSelectorConfig(head_size=64, dtype=torch.float16,
                                     kv_cache_dtype="auto", block_size=128)
    backend = resolve_obj_by_qualname(npu.AscendPlatform.get_attn_backend_cls(None, config))
    assert backend.get_name() == "ASCEND_ATTN"


# --- device queries go to torch.npu --------------------------------------------------------


def test_device_queries_answer_from_torch_npu(npu, monkeypatch):
    platform = npu.AscendPlatform
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "2")
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_NAME", "Ascend910B3")
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(32 * GiB))
    assert platform.get_device_name(1) == "Ascend910B3"
    assert platform.get_device_total_memory(1) == 32 * GiB
    platform.set_device(torch.device("npu", 1))
    assert torch.npu.current_device() == 1
    platform.manual_seed_all(2024)
    assert torch.npu.initial_seed() == 2024
    with pytest.raises(RuntimeError, match="Invalid npu device index 2"):
        platform.set_device(torch.device("npu", 2))


def test_inference_mode_is_torch_inference_mode(npu):
    with npu.AscendPlatform.inference_mode():
        assert torch.is_inference_mode_enabled()


def test_memory_functions_report_the_reference_numbers(npu, reference, monkeypatch):
    platform = npu.AscendPlatform
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(8 * GiB))
    reference.simulate_allocation(3 * GiB)
    assert platform.mem_get_info() == (5 * GiB, 8 * GiB)
    assert platform.get_current_memory_usage() == 3 * GiB
    reference.simulate_free(1 * GiB)
    assert platform.mem_get_info() == (5 * GiB, 8 * GiB)  # freed bytes stay cached
    platform.empty_cache()
    assert platform.mem_get_info() == (6 * GiB, 8 * GiB)
    platform.synchronize()
    assert platform.get_current_memory_usage(torch.device("npu", 0)) == 2 * GiB


def test_supported_dtypes(npu, monkeypatch):
    platform = npu.AscendPlatform
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        platform.check_if_supports_dtype(dtype)
    with pytest.raises(ValueError, match="not torch.float64"):
        platform.check_if_supports_dtype(torch.float64)
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_NAME", "Ascend310P3")
    with pytest.raises(ValueError, match="Ascend310P3 does not support bfloat16"):
        platform.check_if_supports_dtype(torch.bfloat16)
    platform.check_if_supports_dtype(torch.float16)


# --- check_and_update_config on real VllmConfigs -----------------------------------------


def test_config_defaults_on_the_npu_platform(on_npu_platform):
    config = VllmConfig()  # runs the current platform's check_and_update_config
    assert config.device_config.device_type == "npu"
    assert config.parallel_config.worker_cls == "ascend_core.worker.npu_worker.NPUWorker"
    assert config.cache_config.block_size == 128
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert "+RMSNorm" in config.compilation_config.custom_ops


def test_user_choices_are_kept(on_npu_platform):
    config = VllmConfig(
        cache_config=CacheConfig(block_size=64),
        parallel_config=ParallelConfig(worker_cls="my_package.MyWorker"),
    )
    assert config.cache_config.block_size == 64
    assert config.parallel_config.worker_cls == "my_package.MyWorker"


def test_check_and_update_config_on_a_config_built_elsewhere(npu):
    # Built under this process's own platform (CPU), then handed to AscendPlatform.
    config = VllmConfig()
    config.parallel_config.worker_cls = "auto"
    config.cache_config = CacheConfig()
    assert config.cache_config.block_size == CacheConfig.DEFAULT_BLOCK_SIZE
    npu.AscendPlatform.check_and_update_config(config)
    assert config.parallel_config.worker_cls == npu.NPU_WORKER
    assert config.cache_config.block_size == 128


def test_a_bad_nz_mode_variable_stops_the_config_check(npu, monkeypatch):
    from ascend_core.envs import EnvVarError

    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "on")
    with pytest.raises(EnvVarError, match="VLLM_ASCEND_ENABLE_NZ='on' is not an integer"):
        npu.AscendPlatform.check_and_update_config(VllmConfig())


def test_alloc_conf_is_set_when_the_user_did_not(on_npu_platform):
    VllmConfig()
    assert os.environ[ALLOC_CONF] == "expandable_segments:True"


def test_alloc_conf_set_by_the_user_is_kept(on_npu_platform, monkeypatch):
    monkeypatch.setenv(ALLOC_CONF, "garbage_collection_threshold:0.6")
    VllmConfig()
    assert os.environ[ALLOC_CONF] == "garbage_collection_threshold:0.6"


# --- without torch_npu -------------------------------------------------------------------


def test_import_without_torch_npu_raises_a_clear_error(npu, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # makes `import torch_npu` fail
    monkeypatch.delitem(sys.modules, "ascend_core.platform.npu")
    with pytest.raises(RuntimeError) as raised:
        importlib.import_module("ascend_core.platform.npu")
    message = str(raised.value)
    assert "could not import torch_npu" in message
    assert "import of torch_npu halted" in message  # the original error, verbatim
    assert "pip install ascend-plugin[npu]" in message
    assert "CANN" in message
    assert "VLLM_ASCEND_TARGET=host" in message
    assert isinstance(raised.value.__cause__, ImportError)


# --- detection -----------------------------------------------------------------------------


def test_npu_is_visible_with_the_reference(npu, monkeypatch):
    from ascend_core.platform.detect import npu_is_visible

    assert npu_is_visible()
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    assert not npu_is_visible()
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES")
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "0")
    assert not npu_is_visible()


def test_npu_is_not_visible_without_torch_npu(npu, monkeypatch):
    from ascend_core.platform.detect import npu_is_visible

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != REFERENCE_PATH])
    monkeypatch.delitem(sys.modules, "torch_npu")
    assert not npu_is_visible()
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    assert not npu_is_visible()


def test_npu_is_not_visible_when_torch_npu_cannot_load_cann(npu, monkeypatch, tmp_path):
    from ascend_core.platform.detect import npu_is_visible

    broken = tmp_path / "torch_npu"
    broken.mkdir()
    (broken / "__init__.py").write_text(
        "raise OSError('libhccl.so: cannot open shared object file')\n"
    )
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if p != REFERENCE_PATH])
    monkeypatch.delitem(sys.modules, "torch_npu")
    importlib.invalidate_caches()
    assert not npu_is_visible()


# --- the worker ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    ).save_pretrained(path)
    return path


@pytest.fixture
def distributed_cleanup():
    yield
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def _worker_config(tiny_model_dir, utilization: float) -> VllmConfig:
    from vllm.config import ModelConfig

    model = ModelConfig(
        model=str(tiny_model_dir), skip_tokenizer_init=True, dtype="float32", seed=1234
    )
    return VllmConfig(
        model_config=model, cache_config=CacheConfig(gpu_memory_utilization=utilization)
    )


def _new_worker(config: VllmConfig, local_rank: int):
    from vllm.utils.network_utils import get_distributed_init_method, get_open_port

    from ascend_core.worker.npu_worker import NPUWorker

    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    return NPUWorker(config, local_rank=local_rank, rank=0, distributed_init_method=init_method)


def test_worker_sets_up_device_hccl_and_memory_then_builds_the_npu_runner(
    on_npu_platform, reference, monkeypatch, tiny_model_dir, distributed_cleanup
):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "4")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3")
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(8 * GiB))
    reference.simulate_allocation(1 * GiB, device=1)  # another process holds 1 GiB
    config = _worker_config(tiny_model_dir, utilization=0.5)
    assert config.parallel_config.worker_cls == "ascend_core.worker.npu_worker.NPUWorker"
    worker = _new_worker(config, local_rank=1)  # physical NPU 3 = visible npu:1

    with set_current_vllm_config(config):
        worker.init_device()

    from ascend_core.worker.npu_model_runner import NPUModelRunner

    assert type(worker.model_runner) is NPUModelRunner
    assert worker.model_runner.device == torch.device("npu", 1)

    assert worker.device == torch.device("npu", 1)
    assert torch.npu.current_device() == 1
    assert torch.distributed.get_backend() == "hccl"
    assert torch.npu.initial_seed() == 1234
    snapshot = worker.init_npu_snapshot
    assert (snapshot.free_memory, snapshot.total_memory) == (7 * GiB, 8 * GiB)
    assert snapshot.torch_allocated == 1 * GiB
    assert worker.requested_memory == math.ceil(8 * GiB * 0.5)

    # The communicator the platform names runs collectives over the worker's HCCL group.
    from vllm.distributed.parallel_state import get_world_group

    from ascend_core.distributed.npu_communicator import NPUCommunicator

    world = get_world_group()
    communicator = NPUCommunicator(world.cpu_group, worker.device, world.device_group)
    tensor = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(communicator.all_reduce(tensor.clone()), tensor)
    assert torch.equal(communicator.all_gather(tensor, dim=0), tensor)


def test_worker_refuses_an_npu_without_the_requested_memory(
    on_npu_platform, reference, monkeypatch, tiny_model_dir, distributed_cleanup
):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(8 * GiB))
    reference.simulate_allocation(6 * GiB)
    config = _worker_config(tiny_model_dir, utilization=0.5)
    worker = _new_worker(config, local_rank=0)
    with set_current_vllm_config(config), pytest.raises(ValueError, match="less than"):
        worker.init_device()


# --- graph mode -------------------------------------------------------------------------------


def _graph_request(npu, mode, *, enforce_eager=False, world_size=1, max_num_seqs=8,
                   speculative_tokens=None):
    """``_configure_graphs`` on a config as vLLM hands it over (built on this process's CPU
    platform, the user's graph mode put back, a model stand-in with ``enforce_eager``)."""
    from types import SimpleNamespace

    config = VllmConfig()
    config.compilation_config.cudagraph_mode = mode
    # vLLM's optimization levels turn fusion passes on for CUDA; the npu platform must not
    # keep them for its compilation.
    config.compilation_config.pass_config.fuse_norm_quant = True
    config.compilation_config.pass_config.fuse_act_quant = True
    config.model_config = SimpleNamespace(enforce_eager=enforce_eager)
    config.parallel_config.world_size = world_size
    config.scheduler_config.max_num_seqs = max_num_seqs
    config.scheduler_config.max_num_batched_tokens = 2048
    config.cache_config.block_size = 128
    config.speculative_config = (None if speculative_tokens is None else
                                 SimpleNamespace(num_speculative_tokens=speculative_tokens))
    npu._configure_graphs(config)
    return config.compilation_config


@pytest.mark.parametrize("mode", [CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY])
def test_full_graphs_asked_for_give_full_decode_graphs_of_the_planned_sizes(npu, mode):
    compilation = _graph_request(npu, mode, max_num_seqs=20)
    assert compilation.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert compilation.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 20]
    assert compilation.max_cudagraph_capture_size == 20
    assert compilation.mode == CompilationMode.NONE


def test_full_decode_graphs_with_tensor_parallel(npu):
    # HCCL collectives are captured in the graph (npu_graph_capture stands in for vLLM's
    # graph_capture, which takes CUDA/XPU communicators only).
    compilation = _graph_request(npu, CUDAGraphMode.FULL, world_size=2)
    assert compilation.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    assert compilation.cudagraph_capture_sizes == [1, 2, 4, 8]
    # PIECEWISE too: vLLM's collectives are opaque custom ops for Dynamo on this platform.
    compilation = _graph_request(npu, CUDAGraphMode.FULL_AND_PIECEWISE, world_size=2)
    assert compilation.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE
    assert compilation.mode == CompilationMode.VLLM_COMPILE
    assert npu.AscendPlatform.use_custom_op_collectives()


def test_graph_sizes_count_speculative_tokens_and_stop_at_one_kv_block(npu):
    # 3 tokens per request; 48 requests would be 144 tokens, more than a 128-token block.
    compilation = _graph_request(npu, CUDAGraphMode.FULL_DECODE_ONLY, max_num_seqs=48,
                                 speculative_tokens=2)
    assert compilation.cudagraph_capture_sizes == [3, 6, 12, 24, 48, 72, 96, 120]


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE])
def test_piecewise_graphs_compile_with_the_eager_backend(npu, mode):
    compilation = _graph_request(npu, mode, max_num_seqs=20)
    assert compilation.cudagraph_mode == mode
    assert compilation.mode == CompilationMode.VLLM_COMPILE
    assert compilation.backend == "eager"  # Dynamo's split graph, no Inductor
    assert compilation.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 20]
    assert compilation.max_cudagraph_capture_size == 20
    # No fusion pass is left on: they rewrite the graph for CUDA kernels.
    assert not compilation.pass_config.fuse_norm_quant
    assert not compilation.pass_config.fuse_act_quant
    assert not compilation.pass_config.fuse_allreduce_rms


def test_piecewise_pieces_are_wrapped_by_vllms_graph_wrapper(npu):
    assert npu.AscendPlatform.opaque_attention_op()  # the split points
    wrapper = resolve_obj_by_qualname(npu.AscendPlatform.get_static_graph_wrapper_cls())
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    assert wrapper is CUDAGraphWrapper


@pytest.mark.parametrize(("mode", "kwargs"), [
    (CUDAGraphMode.PIECEWISE, {"enforce_eager": True}),
    (CUDAGraphMode.FULL_DECODE_ONLY, {"enforce_eager": True}),
    (CUDAGraphMode.NONE, {}),
])
def test_everything_else_runs_eagerly(npu, mode, kwargs):
    compilation = _graph_request(npu, mode, **kwargs)
    assert compilation.cudagraph_mode == CUDAGraphMode.NONE
    assert compilation.cudagraph_capture_sizes == []
    assert compilation.mode == CompilationMode.NONE


def test_graph_sizes_follow_the_block_size_the_attention_backend_chose(npu):
    """vLLM sets the block size the backends prefer after the model loads (16 for the MLA
    backend, where check_and_update_config saw 128): captured batches stay within one
    block, so padding tokens write only the null block; none left means eager."""
    from types import SimpleNamespace

    compilation = _graph_request(npu, CUDAGraphMode.FULL_DECODE_ONLY, max_num_seqs=8,
                                 speculative_tokens=3)
    assert compilation.cudagraph_capture_sizes == [4, 8, 16, 32]
    config = SimpleNamespace(compilation_config=compilation,
                             cache_config=SimpleNamespace(block_size=16))
    npu._cap_capture_sizes_at_one_block(config)
    assert compilation.cudagraph_capture_sizes == [4, 8, 16]
    assert compilation.max_cudagraph_capture_size == 16
    assert compilation.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    config.cache_config.block_size = 2  # smaller than one request's 4 tokens
    npu._cap_capture_sizes_at_one_block(config)
    assert compilation.cudagraph_capture_sizes == []
    assert compilation.cudagraph_mode == CUDAGraphMode.NONE
