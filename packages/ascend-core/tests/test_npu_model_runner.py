"""The npu worker's model runner: capture-size planning, the torch.npu name mapping, and the
worker's checks, run on the reference torch_npu.

End-to-end runs of the runner through vLLM: tests/e2e/test_npu_target.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from ascend_core.worker.npu_model_runner import (
    blocks_for_capture_size,
    check_capture_sizes_fit_cache,
    plan_decode_capture_sizes,
)

from npu_reference import reference_on_path

NPU_MODULES = (
    "ascend_core.platform.npu",
    "ascend_core.worker.npu_worker",
    "ascend_core.distributed.npu_communicator",
)


# --- capture sizes ---------------------------------------------------------------------------


def test_capture_sizes_are_request_counts_times_the_decode_query_length():
    assert plan_decode_capture_sizes(8, 0, 8192) == [1, 2, 4, 8]
    # max_num_seqs is always a size, off the grid or not.
    assert plan_decode_capture_sizes(20, 0, 8192) == [1, 2, 4, 8, 16, 20]
    # Two drafts per request: three tokens per request in a decode step.
    assert plan_decode_capture_sizes(20, 2, 8192) == [3, 6, 12, 24, 48, 60]
    large = plan_decode_capture_sizes(300, 0, 8192)
    assert large[:5] == [1, 2, 4, 8, 16]
    assert large[-5:] == [248, 256, 272, 288, 300]
    assert all(b - a == 8 for a, b in zip(large[3:34], large[4:35], strict=True))


def test_capture_sizes_stop_at_the_batch_token_limit():
    # 64 requests of 4 tokens would be 256 tokens; only batches of <= 100 tokens are scheduled.
    assert plan_decode_capture_sizes(64, 3, 100) == [4, 8, 16, 32, 64, 96]


@pytest.mark.parametrize("args", [(0, 0, 8), (4, -1, 8), (4, 0, 0), (4.0, 0, 8)])
def test_capture_size_planning_rejects_bad_input(args):
    with pytest.raises(ValueError, match="expected an integer"):
        plan_decode_capture_sizes(*args)


def test_blocks_for_a_capture_size():
    assert blocks_for_capture_size(8, query_len=1, block_size=128) == 8
    assert blocks_for_capture_size(12, query_len=3, block_size=128) == 4
    # A request whose query spans two blocks holds two.
    assert blocks_for_capture_size(400, query_len=200, block_size=128) == 4


def test_capture_sizes_the_cache_holds_pass():
    check_capture_sizes_fit_cache([1, 2, 4, 8], query_len=1, num_blocks=9, block_size=128)
    check_capture_sizes_fit_cache([3, 6], query_len=3, num_blocks=3, block_size=128)


def test_a_capture_size_larger_than_the_cache_allows_is_a_clear_error():
    with pytest.raises(ValueError) as raised:
        check_capture_sizes_fit_cache([1, 2, 4, 8, 16], query_len=1, num_blocks=6,
                                      block_size=128)
    message = str(raised.value)
    assert "Graph capture size 8 (8 requests of 1 tokens)" in message
    assert "needs at least 8 KV-cache blocks" in message
    assert "5 usable blocks" in message
    assert "max_num_seqs to at most 5" in message
    assert "enforce_eager=True" in message


def test_speculative_capture_sizes_are_checked_in_requests():
    # 12 tokens of 4-token decode queries are 3 requests: 3 blocks, and the cache has 2.
    with pytest.raises(ValueError, match="Graph capture size 12 \\(3 requests of 4 tokens\\)"):
        check_capture_sizes_fit_cache([4, 8, 12], query_len=4, num_blocks=3, block_size=128)


# --- on the reference torch_npu --------------------------------------------------------------


@pytest.fixture(scope="module")
def reference_npu():
    """torch_npu imported from the reference, dropped again when the module's tests end."""
    with reference_on_path(forget=NPU_MODULES):
        yield importlib.import_module("torch_npu")


def test_device_names_point_at_torch_npu_and_are_restored(reference_npu):
    from ascend_core.worker.npu_model_runner import npu_device_names

    before = (torch.cuda.Stream, torch.cuda.Event, torch.cuda.current_stream, torch.Event,
              torch.accelerator.synchronize, torch.accelerator.get_memory_info)
    with npu_device_names():
        assert torch.cuda.Stream is torch.npu.Stream
        assert torch.cuda.Event is torch.npu.Event
        assert torch.cuda.current_stream is torch.npu.current_stream
        assert torch.cuda.stream is torch.npu.stream
        assert torch.accelerator.synchronize is torch.npu.synchronize
        assert torch.accelerator.get_memory_info is torch.npu.mem_get_info
        with npu_device_names():  # re-entrant: an entry point calling another
            event = torch.Event()
        assert isinstance(event, torch.npu.Event)
        assert isinstance(torch.cuda.Event(blocking=True), torch.npu.Event)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            assert torch.cuda.current_stream() == stream
        assert torch.accelerator.get_memory_info() == torch.npu.mem_get_info()
        with pytest.raises(ValueError, match="NPU events"):
            torch.Event("cpu")
    after = (torch.cuda.Stream, torch.cuda.Event, torch.cuda.current_stream, torch.Event,
             torch.accelerator.synchronize, torch.accelerator.get_memory_info)
    assert after == before


def test_code_torch_compile_traces_runs_inside_the_device_names(reference_npu):
    """vLLM compiles small helpers with the platform's ``simple_compile_backend`` (``eager``
    on npu), e.g. its logprobs counting; dynamo then checks ``isinstance(x, torch.Event)``,
    which fails if the stand-in for torch.Event is not a type (a logprobs request on the npu
    target died of it)."""
    from ascend_core.platform.npu import AscendPlatform
    from ascend_core.worker.npu_model_runner import npu_device_names

    @torch.compile(backend=AscendPlatform.simple_compile_backend)
    def count_greater_or_equal(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        torch._check(x.shape[0] >= 1)
        torch._check(x.shape[0] == values.shape[0])
        return (x >= values).sum(-1)

    torch._dynamo.reset()
    x = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.2, 0.1]], device="npu")
    with npu_device_names():
        assert isinstance(torch.Event, type)
        counts = count_greater_or_equal(x, torch.tensor([[0.5], [0.3]], device="npu"))
    assert counts.tolist() == [2, 1]


def test_too_few_npus_for_the_parallel_layout_is_a_clear_error(reference_npu, monkeypatch):
    from vllm.config import ParallelConfig

    from ascend_core.worker.npu_worker import check_npus_for_layout

    monkeypatch.setenv("TORCH_NPU_REFERENCE_DEVICE_COUNT", "4")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1")
    layout = ParallelConfig(tensor_parallel_size=2)
    with pytest.raises(ValueError) as raised:
        check_npus_for_layout(layout, local_rank=0)
    message = str(raised.value)
    assert "tensor_parallel_size=2 x pipeline_parallel_size=1" in message
    assert "needs 2 NPUs" in message
    assert "only 1 NPU(s) are visible" in message
    assert "ASCEND_RT_VISIBLE_DEVICES='1'" in message
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "1,3")
    assert check_npus_for_layout(layout, local_rank=1) == 2
    # Pipeline stages need NPUs of their own too: TP 2 x PP 2 is four.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 x pipeline_parallel_size=2"
                       r"\) needs 4 NPUs .* only 2 NPU\(s\) are visible"):
        check_npus_for_layout(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2),
                              local_rank=0)
    # Under the Ray executor a node needs only the ranks Ray placed on it (their NPU ids).
    across_nodes = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2)
    across_nodes.assigned_physical_gpu_ids = [0, 1]
    assert check_npus_for_layout(across_nodes, local_rank=1) == 2
    across_nodes.assigned_physical_gpu_ids = [0, 1, 2]
    with pytest.raises(ValueError, match=r"needs 3 NPUs on this node"):
        check_npus_for_layout(across_nodes, local_rank=0)


# --- the torch fallback of vLLM's slot-mapping kernel ----------------------------------------


def test_slot_mapping_fallback_matches_the_block_table_lookup():
    from ascend_core.worker.triton_fallbacks import compute_slot_mapping

    block_size, max_tokens = 4, 16
    block_table = torch.tensor([[7, 2, 9], [3, 5, 0], [1, 8, 6]], dtype=torch.int32)
    # request 0: positions 2..6 (5 tokens), request 1: position 9 (invalid block 2 -> 0),
    # request 2: positions 0..1 -- ragged, in vLLM's flattened order.
    query_start_loc = torch.tensor([0, 5, 6, 8], dtype=torch.int32)
    positions = torch.tensor([2, 3, 4, 5, 6, 9, 0, 1], dtype=torch.int64)
    slots = torch.full((max_tokens,), 12345, dtype=torch.int64)
    compute_slot_mapping(8, max_tokens, query_start_loc, positions, block_table, 3, slots,
                         KV_CACHE_BLOCK_SIZE=block_size)
    expected = []
    for request, (start, end) in enumerate([(0, 5), (5, 6), (6, 8)]):
        for pos in positions[start:end].tolist():
            expected.append(int(block_table[request, pos // block_size]) * block_size
                            + pos % block_size)
    assert slots[:8].tolist() == expected == [30, 31, 8, 9, 10, 1, 4, 5]
    assert slots[8:].tolist() == [-1] * 8


def test_slot_mapping_fallback_refuses_context_parallelism():
    from ascend_core.worker.triton_fallbacks import compute_slot_mapping

    with pytest.raises(NotImplementedError, match="context parallelism"):
        compute_slot_mapping(1, 2, torch.tensor([0, 1]), torch.tensor([0]),
                             torch.zeros(1, 1, dtype=torch.int32), 1,
                             torch.zeros(2, dtype=torch.int64), KV_CACHE_BLOCK_SIZE=4,
                             TOTAL_CP_WORLD_SIZE=2)


def test_batch_memcpy_fallback_copies_within_the_kv_cache_allocation():
    # vLLM's mamba state copies (prefix caching) come as raw addresses of the KV cache.
    from ascend_core.worker.triton_fallbacks import batch_memcpy, register_kv_allocation

    cache = torch.arange(64, dtype=torch.int32)
    view = cache[8:].view(4, 14)  # a layer's view into the allocation
    register_kv_allocation(view)
    base, word = cache.data_ptr(), cache.element_size()
    src = torch.tensor([base + 0 * word, base + 40 * word])
    dst = torch.tensor([base + 20 * word, base + 44 * word])  # the second overlaps its source
    batch_memcpy(src, dst, torch.tensor([4 * word, 8 * word]))
    want = torch.arange(64, dtype=torch.int32)
    want[20:24] = torch.arange(0, 4)
    want[44:52] = torch.arange(40, 48)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="lie in no KV cache allocation"):
        batch_memcpy(torch.tensor([base]), torch.tensor([base + 10 ** 9]),
                     torch.tensor([word]))
