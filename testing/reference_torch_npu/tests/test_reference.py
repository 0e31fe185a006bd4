"""The reference torch_npu against plain torch math and its documented argument rules."""

from __future__ import annotations

import importlib
import math
import sys
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

GiB = 1024**3


@pytest.fixture
def torch_npu(fresh_torch_npu):
    return fresh_torch_npu


# --- registration -----------------------------------------------------------------------


def test_import_registers_torch_npu_and_the_npu_device(torch_npu):
    assert torch.npu is torch_npu.npu
    assert sys.modules["torch.npu"] is torch_npu.npu
    assert torch.device("npu:1").type == "npu"
    assert torch._C._get_privateuse1_backend_name() == "npu"


def test_tensors_live_on_the_npu_device(torch_npu):
    tensor = torch.zeros(2, device="npu:0")
    assert tensor.device == torch.device("npu", 0) and tensor.is_npu
    assert torch.npu.memory_allocated() == 8


def test_hccl_backend_runs_collectives_on_cpu_tensors(torch_npu):
    assert dist.is_backend_available("hccl")
    dist.init_process_group("hccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "hccl"
        tensor = torch.arange(4.0)
        dist.all_reduce(tensor)
        assert torch.equal(tensor, torch.arange(4.0))
    finally:
        dist.destroy_process_group()


def test_uninstall_leaves_no_npu_and_a_new_import_reinstalls(torch_npu):
    torch_npu._reference.uninstall()
    assert "torch_npu" not in sys.modules
    assert not torch.npu.is_available()
    assert not torch.accelerator.is_available()
    with pytest.raises(RuntimeError, match="uninstalled"):
        torch.zeros(2, device="npu:0")
    again = importlib.import_module("torch_npu")
    assert again is not torch_npu
    assert torch.npu is again.npu and torch.npu.is_available()


# --- devices ------------------------------------------------------------------------------


def test_device_count_defaults_to_one(torch_npu):
    assert torch.npu.device_count() == 1
    assert torch.npu.is_available()


def test_device_count_follows_the_modelled_machine_and_visible_devices(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "4")
    assert torch.npu.device_count() == 4
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1,3")
    assert torch.npu.device_count() == 2
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    assert torch.npu.device_count() == 0
    assert not torch.npu.is_available()
    with pytest.raises(RuntimeError, match="No NPU is visible"):
        torch.npu.current_device()


def test_bad_visible_devices_raise(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "2")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,5")
    with pytest.raises(RuntimeError, match="names NPU 5"):
        torch.npu.device_count()
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,x")
    with pytest.raises(ValueError, match="'x'"):
        torch.npu.device_count()
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "two")
    with pytest.raises(ValueError, match="TORCH_NPU_REFERENCE_DEVICE_COUNT"):
        torch.npu.device_count()


def test_set_device_accepts_index_string_and_device(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "3")
    assert torch.npu.current_device() == 0
    torch.npu.set_device(2)
    assert torch.npu.current_device() == 2
    torch.npu.set_device("npu:1")
    assert torch.npu.current_device() == 1
    torch.npu.set_device(torch.device("npu", 0))
    assert torch.npu.current_device() == 0
    with torch.npu.device(2):
        assert torch.npu.current_device() == 2
    assert torch.npu.current_device() == 0


def test_set_device_refuses_devices_it_does_not_have(torch_npu):
    with pytest.raises(RuntimeError, match="Invalid npu device index 1"):
        torch.npu.set_device(1)
    with pytest.raises(ValueError, match="Expected an npu device"):
        torch.npu.set_device(torch.device("cpu"))
    with pytest.raises(TypeError):
        torch.npu.set_device(1.0)


def test_device_name_and_properties(torch_npu, monkeypatch):
    assert torch.npu.get_device_name() == "Ascend910B-reference"
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_NAME", "Ascend910B3")
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(32 * GiB))
    props = torch.npu.get_device_properties(0)
    assert props.name == "Ascend910B3"
    assert props.total_memory == 32 * GiB
    assert props.cube_core_num == 20 and props.vector_core_num == 40
    assert torch.npu.get_device_capability() is None
    assert torch.npu.is_bf16_supported()
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_NAME", "Ascend310P3")
    assert not torch.npu.is_bf16_supported()


# --- memory -------------------------------------------------------------------------------


def test_mem_get_info_reports_the_configured_total(torch_npu, monkeypatch):
    assert torch.npu.mem_get_info() == (64 * GiB, 64 * GiB)
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(8 * GiB))
    assert torch.npu.mem_get_info(0) == (8 * GiB, 8 * GiB)


def test_memory_follows_a_caching_allocator(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(8 * GiB))
    ref = torch_npu._reference
    ref.simulate_allocation(3 * GiB)
    assert torch.npu.memory_allocated() == 3 * GiB
    assert torch.npu.mem_get_info() == (5 * GiB, 8 * GiB)
    ref.simulate_free(2 * GiB)
    assert torch.npu.memory_allocated() == 1 * GiB
    assert torch.npu.memory_reserved() == 3 * GiB  # cached, still taken from the device
    assert torch.npu.mem_get_info()[0] == 5 * GiB
    ref.simulate_allocation(1 * GiB)  # served from the cache
    assert torch.npu.memory_reserved() == 3 * GiB
    torch.npu.empty_cache()
    assert torch.npu.memory_reserved() == 2 * GiB
    assert torch.npu.mem_get_info()[0] == 6 * GiB
    assert torch.npu.max_memory_allocated() == 3 * GiB
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == 2 * GiB
    assert torch.npu.max_memory_reserved() == 2 * GiB


def test_memory_is_per_device_and_bounded(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "2")
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(4 * GiB))
    torch_npu._reference.simulate_allocation(3 * GiB, device="npu:1")
    assert torch.npu.memory_allocated(1) == 3 * GiB
    assert torch.npu.memory_allocated(0) == 0
    with pytest.raises(RuntimeError, match="NPU out of memory"):
        torch_npu._reference.simulate_allocation(2 * GiB, device=1)
    with pytest.raises(ValueError, match="Cannot free"):
        torch_npu._reference.simulate_free(1, device=0)


# --- streams, events, seeds ---------------------------------------------------------------


def test_stream_context_makes_a_stream_current_and_restores(torch_npu):
    default = torch.npu.current_stream()
    assert default == torch.npu.default_stream()
    side = torch.npu.Stream()
    assert side != default and side.device == torch.device("npu", 0)
    with torch.npu.stream(side):
        assert torch.npu.current_stream() == side
    assert torch.npu.current_stream() == default
    with torch.npu.stream(None):
        assert torch.npu.current_stream() == default
    side.wait_stream(default)
    assert side.query()


def test_stream_and_event_refuse_unmodelled_arguments(torch_npu):
    with pytest.raises(TypeError, match="does not model"):
        torch.npu.Stream(graph_stream=True)
    with pytest.raises(NotImplementedError, match="interprocess"):
        torch.npu.Event(interprocess=True)
    with pytest.raises(TypeError):
        torch.npu.current_stream().wait_event("not an event")


def test_event_elapsed_time_measures_between_records(torch_npu):
    start = torch.npu.Event(enable_timing=True)
    end = torch.npu.Event(enable_timing=True)
    start.record()
    time.sleep(0.02)
    end.record()
    end.synchronize()
    assert 15.0 <= start.elapsed_time(end) < 2000.0
    recorded = torch.npu.current_stream().record_event()
    assert recorded.query()


def test_event_elapsed_time_needs_timing_and_records(torch_npu):
    untimed, timed = torch.npu.Event(), torch.npu.Event(enable_timing=True)
    untimed.record()
    timed.record()
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        untimed.elapsed_time(timed)
    with pytest.raises(RuntimeError, match="recorded"):
        timed.elapsed_time(torch.npu.Event(enable_timing=True))


def test_seeds_are_recorded_and_torch_manual_seed_reaches_the_npu(torch_npu):
    torch.npu.manual_seed_all(123)
    assert torch.npu.initial_seed() == 123
    torch.manual_seed(77)  # torch seeds a registered PrivateUse1 device module too
    assert torch.npu.initial_seed() == 77
    with pytest.raises(TypeError):
        torch.npu.manual_seed_all("7")


# --- npu_rms_norm -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)],
)
def test_rms_norm_matches_torch_rms_norm(torch_npu, dtype, atol):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64).to(dtype)
    gamma = torch.randn(64).to(dtype)
    y, rstd = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-5)
    expected = F.rms_norm(x.float(), (64,), weight=gamma.float(), eps=1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.float(), expected, atol=atol, rtol=atol)
    assert rstd.dtype == torch.float32 and rstd.shape == (5, 3, 1)
    expected_rstd = 1.0 / torch.sqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(rstd, expected_rstd)


def test_rms_norm_over_several_trailing_dims(torch_npu):
    torch.manual_seed(1)
    x = torch.randn(4, 6, 8)
    gamma = torch.randn(6, 8)
    y, rstd = torch_npu.npu_rms_norm(x, gamma)
    expected = F.rms_norm(x, (6, 8), weight=gamma, eps=1e-6)
    torch.testing.assert_close(y, expected)
    assert rstd.shape == (4, 1, 1)


def test_rms_norm_default_epsilon_is_1e_6(torch_npu):
    x = torch.full((2, 4), 1e-3)
    y, _ = torch_npu.npu_rms_norm(x, torch.ones(4))
    assert math.isclose(y[0, 0].item(), 1e-3 / math.sqrt(1e-6 + 1e-6), rel_tol=1e-4)


def test_rms_norm_accepts_float32_gamma_with_half_input(torch_npu):
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    y, _ = torch_npu.npu_rms_norm(x, torch.ones(16))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("x", "gamma", "kwargs", "error", "match"),
    [
        (torch.ones(2, 4, dtype=torch.int32), torch.ones(4, dtype=torch.int32), {}, RuntimeError,
         "supported dtypes"),
        (torch.ones(2, 4), torch.ones(4, dtype=torch.float16), {}, RuntimeError, "must match"),
        (torch.ones(2, 4, dtype=torch.float16), torch.ones(4, dtype=torch.bfloat16), {},
         RuntimeError, "must match"),
        (torch.ones(2, 4), torch.ones(3), {}, RuntimeError, "trailing dims"),
        (torch.ones(2, 4), torch.ones(2, 2, 4), {}, RuntimeError, "trailing dims"),
        (torch.ones(4, 2).t(), torch.ones(4), {}, RuntimeError, "not contiguous"),
        (torch.ones(0, 4), torch.ones(4), {}, RuntimeError, "empty"),
        (torch.ones([1] * 9), torch.ones(1), {}, RuntimeError, "1 to 8 dims"),
        (torch.ones(2, 4), torch.ones(4), {"epsilon": "1e-6"}, TypeError, "epsilon"),
        (torch.ones(2, 4), [1.0] * 4, {}, TypeError, "gamma must be a torch.Tensor"),
    ],
)
def test_rms_norm_refuses_what_the_docs_rule_out(torch_npu, x, gamma, kwargs, error, match):
    with pytest.raises(error, match=match):
        torch_npu.npu_rms_norm(x, gamma, **kwargs)


def test_rms_norm_refuses_unknown_arguments(torch_npu):
    with pytest.raises(TypeError):
        torch_npu.npu_rms_norm(torch.ones(2, 4), torch.ones(4), eps=1e-6)


# --- npu_swiglu ---------------------------------------------------------------------------


def _swiglu(x: torch.Tensor, dim: int) -> torch.Tensor:
    half = x.shape[dim] // 2
    a, b = x.float().narrow(dim, 0, half), x.float().narrow(dim, half, half)
    return a * torch.sigmoid(a) * b


@pytest.mark.parametrize("dim", [-1, 0, 1])
@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float32, 1e-6), (torch.float16, 2e-3), (torch.bfloat16, 2e-2)],
)
def test_swiglu_matches_swish_of_first_half_times_second(torch_npu, dim, dtype, atol):
    torch.manual_seed(2)
    x = torch.randn(4, 6, 8).to(dtype)
    out = torch_npu.npu_swiglu(x, dim=dim)
    expected = _swiglu(x, dim)
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=atol)


def test_swiglu_default_dim_is_last(torch_npu):
    x = torch.randn(3, 10)
    torch.testing.assert_close(torch_npu.npu_swiglu(x), _swiglu(x, -1))


@pytest.mark.parametrize(
    ("x", "kwargs", "error", "match"),
    [
        (torch.ones(2, 5), {}, RuntimeError, "divisible by 2"),
        (torch.ones(2, 4), {"dim": 2}, RuntimeError, "out of range"),
        (torch.ones(2, 4), {"dim": -3}, RuntimeError, "out of range"),
        (torch.ones(2, 4), {"dim": 1.0}, TypeError, "dim must be an int"),
        (torch.ones(4, 2).t(), {}, RuntimeError, "not contiguous"),
        (torch.ones(2, 0), {}, RuntimeError, "empty"),
        (torch.ones(2, 4, dtype=torch.float64), {}, RuntimeError, "supported dtypes"),
        (torch.ones([2] * 9), {}, RuntimeError, "1 to 8 dims"),
    ],
)
def test_swiglu_refuses_what_the_docs_rule_out(torch_npu, x, kwargs, error, match):
    with pytest.raises(error, match=match):
        torch_npu.npu_swiglu(x, **kwargs)


def test_unmodelled_op_that_libraries_import_raises_when_called(torch_npu):
    with pytest.raises(NotImplementedError, match="npu_fusion_attention is not modelled"):
        torch_npu.npu_fusion_attention(torch.ones(1), torch.ones(1), torch.ones(1), 1, "BNSD")
    assert not hasattr(torch_npu, "npu_mla_prolog_v2")


# --- the errors the ops raise -------------------------------------------------------------

_HALF = torch.float16


@pytest.mark.parametrize(("op", "args", "kwargs"), [
    ("npu_rms_norm", (torch.ones(2, 4, dtype=torch.int32), torch.ones(4)), {}),
    ("npu_swiglu", (torch.ones(2, 5),), {}),
    ("npu_add_rms_norm", (torch.ones(2, 4), torch.ones(2, 3), torch.ones(4)), {}),
    ("npu_dynamic_quant", (torch.ones(4, dtype=_HALF),), {}),
    ("npu_quantize", (torch.ones(2, 4), torch.ones(3), None, torch.qint8), {"axis": 1}),
    ("npu_moe_gating_top_k_softmax", (torch.ones(4, 8),), {"k": 9}),
    ("npu_top_k_top_p", (torch.ones(2, 8), torch.ones(2), torch.ones(2, dtype=torch.int64)),
     {}),
    ("npu_scatter_pa_kv_cache", (torch.ones(2, 1, 16, dtype=_HALF),) * 2
     + (torch.ones(1, 4, 1, 16, dtype=_HALF),) * 2 + (torch.tensor([0, 9]),),
     {"cache_mode": "Norm"}),
])
def test_argument_checks_raise_runtime_error(torch_npu, op, args, kwargs):
    # op-plugin's checks are TORCH_CHECKs, which reach Python as RuntimeError; a
    # ValueError or TypeError there would let code under test catch what the real op never
    # raises (and miss what it does).
    with pytest.raises(RuntimeError) as raised:
        getattr(torch_npu, op)(*args, **kwargs)
    assert type(raised.value) is RuntimeError


def test_python_argument_types_raise_type_error_as_the_binding_parser_does(torch_npu):
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        torch_npu.npu_swiglu([1.0, 2.0])
    with pytest.raises(TypeError, match="k must be an int"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.ones(4, 8), k=2.5)
    with pytest.raises(TypeError):
        torch_npu.npu_rms_norm(torch.ones(2, 4), torch.ones(4), no_such_argument=1)
