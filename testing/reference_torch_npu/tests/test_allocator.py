"""The reference's npu allocator seen through torch's device-generic memory calls.

torch_npu's caching allocator is a ``c10::DeviceAllocator``, so ``torch.accelerator``'s memory
functions (``empty_cache``, ``memory_allocated``, ``get_memory_info``, ...) reach it as
``torch.npu``'s do. vLLM calls them at engine shutdown and around sleep mode; each number
here is checked against the bytes of the tensors that hold it and against ``torch.npu``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import REFERENCE_PATH

MiB = 1024**2


@pytest.fixture
def torch_npu(fresh_torch_npu, monkeypatch):
    monkeypatch.setenv("TORCH_NPU_REFERENCE_TOTAL_MEMORY", str(64 * MiB))
    fresh_torch_npu._reference.reset_state()
    return fresh_torch_npu


def test_accelerator_empty_cache_releases_cached_free_blocks(torch_npu):
    kept = torch.empty(MiB // 4, device="npu")  # 1 MiB
    freed = torch.empty(MiB // 2, device="npu")  # 2 MiB
    del freed
    assert torch.npu.memory_allocated() == MiB
    assert torch.npu.memory_reserved() == 3 * MiB  # the freed block stays cached
    assert torch.accelerator.get_memory_info() == (61 * MiB, 64 * MiB)

    torch.accelerator.empty_cache()

    assert torch.npu.memory_reserved() == MiB  # only what live tensors hold
    assert torch.npu.mem_get_info() == (63 * MiB, 64 * MiB)
    assert torch.accelerator.get_memory_info() == torch.npu.mem_get_info()
    assert torch.npu.memory_allocated() == MiB and kept.numel() == MiB // 4


def test_accelerator_memory_numbers_agree_with_torch_npu(torch_npu):
    first = torch.empty(1000, dtype=torch.uint8, device="npu")
    second = torch.empty(3000, dtype=torch.uint8, device="npu")
    del first
    assert torch.accelerator.memory_allocated() == torch.npu.memory_allocated() == 3000
    assert torch.accelerator.max_memory_allocated() == torch.npu.max_memory_allocated() == 4000
    assert torch.accelerator.memory_reserved() == torch.npu.memory_reserved() == 4000
    torch.accelerator.reset_peak_memory_stats()
    assert torch.npu.max_memory_allocated() == 3000
    assert torch.accelerator.max_memory_reserved() == 4000  # reserved has not fallen yet
    del second
    torch.accelerator.empty_cache()
    assert torch.accelerator.memory_reserved() == 0


def test_releasing_a_storage_gives_its_bytes_back(torch_npu):
    """What sleep mode relies on: a storage resized to 0 bytes frees its device memory, and
    resized back it holds fresh memory of the old size."""
    tensor = torch.arange(MiB // 4, dtype=torch.float32, device="npu")
    storage = tensor.untyped_storage()
    storage.resize_(0)
    torch.npu.empty_cache()
    assert torch.npu.memory_allocated() == 0 and torch.npu.memory_reserved() == 0
    storage.resize_(MiB)
    assert torch.npu.memory_allocated() == MiB
    tensor.zero_()
    assert torch.equal(tensor.cpu(), torch.zeros(MiB // 4))



def test_a_graph_over_released_memory_refuses_to_replay(torch_npu):
    """A captured graph holds device addresses: once sleep mode (or anything else) has
    released a captured tensor's storage, replay must fail instead of using freed memory."""
    weight = torch.full((4,), 2.0, device="npu")
    static_input = torch.ones(4, device="npu")
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        static_output = static_input * weight
    static_input.fill_(3.0)
    graph.replay()
    assert torch.equal(static_output.cpu(), torch.full((4,), 6.0))

    storage = weight.untyped_storage()
    address = storage.data_ptr()
    storage.resize_(0)
    blocker = torch.empty(4, device="npu")  # may take the freed address (the host's malloc)
    storage.resize_(16)  # the same bytes again, at another address
    assert storage.data_ptr() != address and blocker.numel() == 4
    weight.fill_(2.0)
    with pytest.raises(RuntimeError, match="released or reallocated since capture"):
        graph.replay()

    graph.reset()
    with torch.npu.graph(graph):  # captured again over the new memory, it replays
        static_output = static_input * weight
    static_input.fill_(5.0)
    graph.replay()
    assert torch.equal(static_output.cpu(), torch.full((4,), 10.0))



def test_accelerator_empty_host_cache_reaches_the_pinned_allocator(torch_npu):
    # vLLM's shutdown calls torch.accelerator.empty_host_cache(); with no host allocator
    # registered for the npu device type torch dereferenced a null one (a segfault), so
    # the call runs in a child process whose exit status is checked.
    script = ("import torch, torch_npu\n"
              "pinned = torch.empty(1024, pin_memory=True)\n"
              "assert pinned.is_pinned()\n"
              "torch.accelerator.empty_host_cache()\n"
              "print('done')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [REFERENCE_PATH] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                           text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.strip() == "done"
