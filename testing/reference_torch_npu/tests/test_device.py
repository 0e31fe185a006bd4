"""The reference's npu device: tensors in host memory behind torch's PrivateUse1 backend.

Every result is compared with the same computation on the CPU; memory numbers with the
bytes of the tensors that hold them.
"""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REFERENCE_PATH

NPU = None  # torch.device("npu", 0), once the reference has named the device


@pytest.fixture
def torch_npu(fresh_torch_npu):
    global NPU
    NPU = torch.device("npu", 0)
    return fresh_torch_npu


# --- tensors, arithmetic, copies ----------------------------------------------------------


def test_factories_put_tensors_on_the_npu(torch_npu):
    for tensor in (torch.empty(2, 3, device="npu"), torch.zeros(4, device=NPU),
                   torch.ones(2, device="npu:0"), torch.arange(5, device="npu"),
                   torch.full((2, 2), 7.0, device="npu"), torch.randn(3, device="npu"),
                   torch.empty_strided((2, 3), (1, 2), device="npu")):
        assert tensor.device == NPU and tensor.is_npu
    assert torch.equal(torch.arange(5, device="npu").cpu(), torch.arange(5))
    assert torch.equal(torch.full((2, 2), 7.0, device="npu").cpu(), torch.full((2, 2), 7.0))
    assert torch.empty_strided((2, 3), (1, 2), device="npu").stride() == (1, 2)


def test_default_dtype_rules_hold_on_the_npu(torch_npu):
    assert torch.empty(2, device="npu").dtype == torch.float32
    assert torch.arange(3, device="npu").dtype == torch.int64
    assert torch.tensor([1.5], device="npu").dtype == torch.float32
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert torch.zeros(1, device="npu").dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    mixed = torch.ones(2, dtype=torch.int32, device="npu") * 0.5
    assert mixed.dtype == torch.float32 and mixed.device == NPU


def test_copies_both_ways_keep_values_dtype_and_strides(torch_npu):
    torch.manual_seed(0)
    host = torch.randn(4, 6)
    npu = host.to("npu")
    assert npu.device == NPU and torch.equal(npu.cpu(), host)
    assert torch.equal(host.t().to("npu").cpu(), host.t())
    half = npu.to(torch.float16)
    assert half.device == NPU and torch.equal(half.cpu(), host.to(torch.float16))
    other = torch.empty(4, 6, device="npu")
    other.copy_(npu)  # npu -> npu
    assert torch.equal(other.cpu(), host)
    back = torch.empty(4, 6)
    back.copy_(npu)  # npu -> cpu into an existing tensor
    assert torch.equal(back, host)
    npu[1].copy_(torch.zeros(6))  # cpu -> npu into a view
    assert torch.equal(npu.cpu()[1], torch.zeros(6))
    assert torch.equal(npu.cpu()[0], host[0])
    assert other.data_ptr() != npu.data_ptr()


def test_arithmetic_matmul_and_reductions_match_the_cpu(torch_npu):
    torch.manual_seed(1)
    a, b = torch.randn(5, 7), torch.randn(7, 3)
    na, nb = a.to("npu"), b.to("npu")
    for npu_result, cpu_result in [
        (na @ nb, a @ b),
        (torch.matmul(na, nb), torch.matmul(a, b)),
        (na * 2 + 1, a * 2 + 1),
        (na.exp().sum(dim=1), a.exp().sum(dim=1)),
        (torch.softmax(na, -1), torch.softmax(a, -1)),
        (na.max(dim=0).values, a.max(dim=0).values),
        (torch.nn.functional.silu(na), torch.nn.functional.silu(a)),
        (torch.cat([na, na], 0), torch.cat([a, a], 0)),
        (torch.where(na > 0, na, torch.zeros_like(na)), torch.where(a > 0, a, 0.0)),
    ]:
        assert npu_result.device == NPU
        torch.testing.assert_close(npu_result.cpu(), cpu_result)
    assert (na.sum() - a.sum()).abs().item() < 1e-5  # .item() reads npu memory


def test_in_place_ops_and_views_act_on_the_npu_memory(torch_npu):
    npu = torch.zeros(3, 4, device="npu")
    row = npu[1]
    col = npu[:, 2]
    assert row.device == NPU and row.untyped_storage().data_ptr() == npu.data_ptr()
    row.fill_(5.0)
    col.add_(1.0)
    expected = torch.zeros(3, 4)
    expected[1] = 5.0
    expected[:, 2] += 1.0
    assert torch.equal(npu.cpu(), expected)
    t = npu.t()
    unfolded = npu.view(-1).unfold(0, 4, 4)  # a view op through the fallback
    assert t.untyped_storage().data_ptr() == npu.data_ptr()
    assert unfolded.untyped_storage().data_ptr() == npu.data_ptr()
    assert torch.equal(unfolded.cpu(), expected)
    unfolded[0, 0] = 9.0
    assert npu[0, 0].item() == 9.0


def test_indexing_reads_and_writes(torch_npu):
    host = torch.arange(20.0).reshape(4, 5)
    npu = host.to("npu")
    index = torch.tensor([3, 0])
    assert torch.equal(npu[index.to("npu")].cpu(), host[index])
    assert torch.equal(npu[index].cpu(), host[index])  # host indices, as on CUDA
    mask = host > 7
    assert torch.equal(npu[mask.to("npu")].cpu(), host[mask])
    npu[index.to("npu"), 1] = -1.0
    host[index, 1] = -1.0
    assert torch.equal(npu.cpu(), host)
    npu.index_fill_(1, torch.tensor([4], device="npu"), 0.5)
    host.index_fill_(1, torch.tensor([4]), 0.5)
    assert torch.equal(npu.cpu(), host)
    assert torch.equal(torch.gather(npu, 1, torch.zeros(4, 1, dtype=torch.long,
                                                        device="npu")).cpu(), host[:, :1])


def test_resize_set_and_out_arguments_reallocate_on_the_npu(torch_npu):
    tensor = torch.empty(0, device="npu")
    tensor.resize_(6)
    assert tensor.shape == (6,) and torch.npu.memory_allocated() == 24
    out = torch.empty(0, device="npu")
    torch.add(torch.ones(3, device="npu"), 1, out=out)  # out= resizes through the fallback
    assert out.device == NPU and torch.equal(out.cpu(), torch.full((3,), 2.0))
    assert torch.npu.memory_allocated() == 24 + 12
    other = torch.empty(0, device="npu").set_(tensor.untyped_storage(), 2, (2, 2), (2, 1))
    assert other.untyped_storage().data_ptr() == tensor.data_ptr()


def test_mixing_npu_and_cpu_tensors_fails_like_a_device(torch_npu):
    npu = torch.ones(3, device="npu")
    with pytest.raises(RuntimeError, match="same device.*npu:0 and cpu"):
        npu + torch.ones(3)
    with pytest.raises(RuntimeError, match="same device"):
        torch.matmul(torch.ones(2, 3, device="npu"), torch.ones(3, 2))
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([npu, torch.ones(3)])
    # A 0-dim CPU tensor is a scalar, as torch allows with any device.
    assert torch.equal((npu * torch.tensor(2.0)).cpu(), torch.full((3,), 2.0))


def test_tensors_of_two_npus_do_not_mix(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "2")
    first = torch.ones(2, device="npu:0")
    second = torch.ones(2, device="npu:1")
    assert second.device == torch.device("npu", 1)
    assert torch.npu.memory_allocated(1) == 8 and torch.npu.memory_allocated(0) == 8
    with pytest.raises(RuntimeError, match="same device.*npu:0 and npu:1"):
        first + second
    with torch.npu.device(1):
        assert torch.empty(1, device="npu").device == torch.device("npu", 1)
    with pytest.raises(RuntimeError, match="Invalid npu device index 2"):
        torch.empty(1, device="npu:2")


def test_custom_op_registered_only_for_cpu_runs_through_the_fallback(torch_npu):
    library = torch.library.Library("reference_npu_test", "DEF")
    try:
        library.define("scaled_add(Tensor x, Tensor y, float alpha) -> Tensor")
        library.define("double_(Tensor(a!) x) -> ()")

        def scaled_add(x, y, alpha):
            assert x.device.type == "cpu"  # the CPU kernel sees host views
            return x + alpha * y

        def double_(x):
            x.mul_(2)

        library.impl("scaled_add", scaled_add, "CPU")
        library.impl("double_", double_, "CPU")
        x, y = torch.randn(4), torch.randn(4)
        out = torch.ops.reference_npu_test.scaled_add(x.to("npu"), y.to("npu"), 0.5)
        assert out.device == NPU
        torch.testing.assert_close(out.cpu(), x + 0.5 * y)
        z = x.to("npu")
        torch.ops.reference_npu_test.double_(z)
        torch.testing.assert_close(z.cpu(), 2 * x)
    finally:
        library._destroy()


def test_linear_moved_to_the_npu_gives_the_cpu_result(torch_npu):
    torch.manual_seed(3)
    linear = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8)
    expected = linear(x)
    linear.to("npu")
    assert linear.weight.device == NPU
    with torch.no_grad():
        got = linear(x.to("npu"))
    assert got.device == NPU
    torch.testing.assert_close(got.cpu(), expected.detach())
    loss = linear(x.npu()).sum()
    loss.backward()  # autograd runs on the npu too
    assert linear.weight.grad.device == NPU
    torch.testing.assert_close(linear.weight.grad.cpu(), torch.ones(4, 1) * x.sum(0))


# --- memory -------------------------------------------------------------------------------


def test_memory_allocated_follows_real_tensors(torch_npu):
    assert torch.npu.memory_allocated() == 0
    first = torch.empty(1024, device="npu")  # 4096 bytes
    assert torch.npu.memory_allocated() == 4096
    second = torch.empty(256, dtype=torch.float16, device="npu")  # 512 bytes
    assert torch.npu.memory_allocated() == 4608
    assert torch.npu.max_memory_allocated() == 4608
    del first
    assert torch.npu.memory_allocated() == 512
    assert torch.npu.memory_reserved() == 4608  # cached until empty_cache
    assert torch.npu.mem_get_info()[0] == 64 * 1024**3 - 4608
    torch.npu.empty_cache()
    assert torch.npu.memory_reserved() == 512
    torch.npu.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == 512
    view = second[10:20]
    assert torch.npu.memory_allocated() == 512  # views allocate nothing
    del second, view
    assert torch.npu.memory_allocated() == 0


def test_simulated_bytes_add_to_real_ones(torch_npu):
    tensor = torch.empty(100, dtype=torch.uint8, device="npu")
    torch_npu._reference.simulate_allocation(1000)
    assert torch.npu.memory_allocated() == 1100
    torch_npu._reference.simulate_free(1000)
    assert torch.npu.memory_allocated() == 100
    del tensor
    assert torch.npu.memory_allocated() == 0


def test_allocation_past_the_npu_memory_is_out_of_memory(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(1 << 20))
    kept = torch.empty(1 << 19, dtype=torch.uint8, device="npu")
    with pytest.raises(torch.OutOfMemoryError, match="NPU out of memory"):
        torch.empty(1 << 20, dtype=torch.uint8, device="npu")
    assert torch.npu.memory_allocated() == kept.numel()


def test_reset_state_forgets_live_tensors_without_going_negative(torch_npu):
    tensor = torch.empty(10, device="npu")
    torch_npu._reference.reset_state()
    assert torch.npu.memory_allocated() == 0
    del tensor
    assert torch.npu.memory_allocated() == 0


# --- host memory, streams, modules --------------------------------------------------------


def test_pinned_host_memory(torch_npu):
    pinned = torch.empty(16, pin_memory=True)
    assert pinned.is_pinned() and pinned.device.type == "cpu"
    assert torch.ones(4).pin_memory().is_pinned()
    assert not torch.empty(16).is_pinned()
    assert torch.npu.memory_allocated() == 0  # host memory is not NPU memory
    pinned.copy_(torch.arange(16.0))
    npu = pinned.to("npu", non_blocking=True)
    assert torch.equal(npu.cpu(), torch.arange(16.0))
    with pytest.raises(RuntimeError, match="pinned"):
        torch.empty(2, device="npu", pin_memory=True)


def test_device_guards_and_torch_streams_follow_torch_npu(torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "2")
    torch.npu.set_device(1)
    assert torch.empty(1, device="npu").device.index == 1
    assert torch.accelerator.current_device_index() == 1
    torch.accelerator.set_device_index(0)
    assert torch.npu.current_device() == 0
    stream = torch.Stream(device="npu")
    event = torch.Event(device="npu")
    event.record(stream)
    assert event.query() and stream.query()
    torch.accelerator.synchronize()


def test_tensor_and_module_methods_exist(torch_npu):
    tensor = torch.ones(2).npu()
    assert tensor.is_npu and not torch.ones(2).is_npu
    module = torch.nn.Linear(2, 2).npu()
    assert module.weight.is_npu
    assert repr(tensor) == "tensor([1., 1.], device='npu:0')"


# --- the torch_npu functions on npu tensors -----------------------------------------------


def test_torch_npu_functions_take_npu_tensors_and_answer_on_the_npu(torch_npu):
    torch.manual_seed(4)
    x, gamma = torch.randn(3, 16), torch.randn(16)
    expected_y, expected_rstd = torch_npu.npu_rms_norm(x, gamma)  # CPU tensors still work
    y, rstd = torch_npu.npu_rms_norm(x.to("npu"), gamma.to("npu"))
    assert y.device == NPU and rstd.device == NPU
    torch.testing.assert_close(y.cpu(), expected_y)
    torch.testing.assert_close(rstd.cpu(), expected_rstd)
    with pytest.raises(RuntimeError, match="same device.*torch_npu.npu_rms_norm"):
        torch_npu.npu_rms_norm(x.to("npu"), gamma)


def test_torch_npu_writes_land_in_npu_tensors(torch_npu):
    key = torch.randn(2, 1, 8, dtype=torch.float16)
    key_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float16, device="npu")
    value_cache = torch.zeros_like(key_cache)
    slots = torch.tensor([5, 0], dtype=torch.int32, device="npu")
    torch_npu.npu_scatter_pa_kv_cache(key.to("npu"), key.to("npu"), key_cache, value_cache,
                                      slots, cache_mode="Norm")
    assert key_cache.device == NPU
    torch.testing.assert_close(key_cache[1, 1].cpu(), key[0])
    torch.testing.assert_close(value_cache[0, 0].cpu(), key[1])


# --- collectives over hccl (gloo underneath) on npu tensors -------------------------------

_COLLECTIVES_WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, torch_npu
import torch.distributed as dist
rank = int(sys.argv[3])
dist.init_process_group("hccl", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
x = torch.arange(4.0).npu() + 10 * rank
dist.all_reduce(x)
gathered = torch.empty(8, device="npu")
dist.all_gather_into_tensor(gathered, torch.full((4,), float(rank)).npu())
scattered = torch.empty(2, device="npu")
dist.reduce_scatter_tensor(scattered, torch.arange(4.0).npu())
swapped = torch.empty(4, device="npu")
dist.all_to_all_single(swapped, torch.full((4,), float(rank)).npu())
dist.barrier()
devices = {t.device.type for t in (x, gathered, scattered, swapped)}
print(sorted(devices), x.tolist(), gathered.tolist(), scattered.tolist(), swapped.tolist())
dist.destroy_process_group()
"""


def test_hccl_collectives_on_npu_tensors_across_two_processes(torch_npu, tmp_path):
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(_COLLECTIVES_WORKER)
    store = tmp_path / "store"
    workers = [subprocess.Popen([sys.executable, str(script), REFERENCE_PATH, str(store),
                                 str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for rank in range(2)]
    outputs = [worker.communicate(timeout=120) for worker in workers]
    for worker, (_out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
    first, second = (out.strip().splitlines()[-1] for out, _ in outputs)
    assert first == ("['npu'] [10.0, 12.0, 14.0, 16.0] [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, "
                     "1.0] [0.0, 2.0] [0.0, 0.0, 1.0, 1.0]")
    assert second == ("['npu'] [10.0, 12.0, 14.0, 16.0] [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, "
                      "1.0] [4.0, 6.0] [0.0, 0.0, 1.0, 1.0]")
