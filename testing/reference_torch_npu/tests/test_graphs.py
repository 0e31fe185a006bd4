"""NPU graphs of the reference: what capture records, what replay computes, what a graph
refuses. Each replay is checked against the same computation done eagerly on the CPU from
the static inputs' new contents."""

from __future__ import annotations

import sys

import pytest
import torch

from conftest import REFERENCE_PATH


def test_replay_computes_from_the_static_inputs_current_contents(torch_npu):
    torch.manual_seed(0)
    weight = torch.randn(8, 8)
    static_x = torch.zeros(4, 8, device="npu")
    npu_weight = weight.npu()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        hidden = torch.relu(static_x @ npu_weight) + 1
        out = hidden.sum(-1)
        first = out[0]  # a view of a captured output
    assert graph.step_names() == ["aten.mm.default", "aten.relu.default",
                                  "aten.add.Tensor", "aten.sum.dim_IntList"]
    for _ in range(3):
        x = torch.randn(4, 8)
        static_x.copy_(x)
        graph.replay()
        expected = (torch.relu(x @ weight) + 1).sum(-1)
        torch.testing.assert_close(out.cpu(), expected)
        torch.testing.assert_close(first.cpu(), expected[0])


def test_in_place_writes_and_torch_npu_functions_are_replayed(torch_npu):
    torch.manual_seed(1)
    key_cache = torch.zeros(2, 4, 1, 8, dtype=torch.float16, device="npu")
    value_cache = torch.zeros_like(key_cache)
    static_key = torch.zeros(2, 1, 8, dtype=torch.float16, device="npu")
    static_slots = torch.tensor([0, 1], dtype=torch.int32).npu()
    counter = torch.zeros(1, device="npu")
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        torch_npu.npu_scatter_pa_kv_cache(static_key, static_key, key_cache, value_cache,
                                          static_slots, cache_mode="Norm")
        counter.add_(1)
    assert graph.step_names() == ["torch_npu.npu_scatter_pa_kv_cache", "aten.add_.Tensor"]
    assert counter.item() == 1
    key = torch.randn(2, 1, 8, dtype=torch.float16)
    static_key.copy_(key)
    static_slots.copy_(torch.tensor([7, 2], dtype=torch.int32))
    graph.replay()
    assert counter.item() == 2
    torch.testing.assert_close(key_cache[1, 3].cpu(), key[0])
    torch.testing.assert_close(value_cache[0, 2].cpu(), key[1])


def test_a_linear_model_replays_like_eager(torch_npu):
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(),
                                torch.nn.Linear(32, 4))
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    model.npu()
    static_x = torch.zeros(3, 16, device="npu")
    graph = torch.npu.NPUGraph()
    with torch.inference_mode():
        with torch.npu.graph(graph):
            static_out = model(static_x)
        x = torch.randn(3, 16)
        static_x.copy_(x)
        graph.replay()
    cpu_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(),
                                    torch.nn.Linear(32, 4))
    cpu_model.load_state_dict(reference)
    with torch.no_grad():
        torch.testing.assert_close(static_out.cpu(), cpu_model(x))


def test_host_work_during_capture_runs_once_and_is_not_replayed(torch_npu):
    host = torch.zeros(2)
    static = torch.zeros(2, device="npu")
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        host.add_(1)  # CPU tensor: host work
        static.add_(1)
    graph.replay()
    graph.replay()
    assert host.tolist() == [1.0, 1.0]
    assert static.cpu().tolist() == [3.0, 3.0]
    assert graph.num_steps == 1


@pytest.mark.parametrize("body", [
    lambda x: x.sum().item(),
    lambda x: x.tolist(),
    lambda x: torch.nonzero(x),
    lambda x: x[x > 0],
    lambda x: torch.unique(x),
    lambda x: x.cpu(),
    lambda x: x.copy_(torch.ones(4)),
    lambda x: torch.npu.synchronize(),
    lambda x: torch.npu.current_stream().synchronize(),
])
def test_host_synchronisation_in_a_capture_raises(torch_npu, body):
    static = torch.ones(4, device="npu")
    graph = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="not permitted while an NPU graph is capturing"):
        with torch.npu.graph(graph):
            body(static)
    assert not torch.npu.is_current_stream_capturing()
    with pytest.raises(RuntimeError, match="needs a finished capture"):
        graph.replay()


def test_pinned_non_blocking_copies_are_captured(torch_npu):
    pinned = torch.zeros(4, pin_memory=True)
    static = torch.zeros(4, device="npu")
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        static.copy_(pinned, non_blocking=True)
        doubled = static * 2
    pinned.copy_(torch.arange(4.0))
    graph.replay()  # the copy reads the host buffer at replay, as a graph's memcpy does
    assert doubled.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]


def test_capture_rules(torch_npu):
    graph = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        graph.capture_begin()
    with pytest.raises(ValueError, match="capture_error_mode"):
        with torch.npu.graph(graph, capture_error_mode="strict"):
            pass
    with pytest.raises(TypeError, match="NPUGraph"):
        torch.npu.graph(object())
    with torch.npu.graph(graph):
        with pytest.raises(RuntimeError, match="already capturing"):
            torch.npu.NPUGraph().capture_begin()
    with pytest.raises(RuntimeError, match="already holds a capture"):
        with torch.npu.graph(graph):
            pass


def test_captured_tensors_stay_allocated_until_reset(torch_npu):
    torch_npu._reference.reset_state()
    static = torch.zeros(256, device="npu")  # 1024 bytes
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph, pool=torch.npu.graph_pool_handle()):
        out = (static + 1) * 2  # an intermediate and an output, 1024 bytes each
    del out
    assert torch.npu.memory_allocated() == 3 * 1024  # the graph keeps its tensors
    graph.reset()
    assert torch.npu.memory_allocated() == 1024


def test_copying_reshapes_and_casts_under_inference_mode_are_replayed(torch_npu):
    # Under inference mode the mode sees aten.reshape / aten.to (view-annotated) instead of
    # their clone / _to_copy; when they copy, replay must compute them again.
    with torch.inference_mode():
        static_x = torch.zeros(2, 3, dtype=torch.int32, device="npu")
        graph = torch.npu.NPUGraph()
        with torch.npu.graph(graph):
            flat = static_x.t().reshape(6)
            as_float = static_x.float()
            same = static_x.reshape(3, 2)  # a true view: not a step
        assert graph.step_names() == ["aten.reshape.default", "aten.to.dtype"]
        x = torch.arange(6, dtype=torch.int32).reshape(2, 3)
        static_x.copy_(x)
        graph.replay()
    torch.testing.assert_close(flat.cpu(), x.t().reshape(6))
    torch.testing.assert_close(as_float.cpu(), x.float())
    torch.testing.assert_close(same.cpu(), x.reshape(3, 2))


def test_a_custom_op_is_one_step_and_its_torch_npu_calls_are_not_recorded_again(torch_npu):
    # A torch.library op whose body calls torch_npu (as the npu target's traced kernels do):
    # one launch. Recording its torch_npu call too would replay an in-place body twice.
    @torch.library.custom_op("reference_graph_test::add_norm_", mutates_args=("x",))
    def add_norm_(x: torch.Tensor, weight: torch.Tensor) -> None:
        normed, _ = torch_npu.npu_rms_norm(x, weight)
        x.add_(normed)

    torch.manual_seed(2)
    weight = torch.rand(8) + 0.5
    static_x = torch.zeros(2, 8, device="npu")
    npu_weight = weight.npu()
    graph = torch.npu.NPUGraph()
    with torch.npu.graph(graph):
        torch.ops.reference_graph_test.add_norm_(static_x, npu_weight)
    assert graph.step_names() == ["reference_graph_test.add_norm_.default"]
    x = torch.randn(2, 8)
    static_x.copy_(x)
    graph.replay()
    expected = x + x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(static_x.cpu(), expected)


_CAPTURED_ALL_REDUCE_WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, torch_npu
import torch.distributed as dist
rank = int(sys.argv[3])
dist.init_process_group("hccl", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
n = 1 << 20  # large enough that gloo is still working when a step after it would start
static_x = torch.zeros(n, device="npu")
graph = torch.npu.NPUGraph()
with torch.npu.graph(graph):
    y = static_x * 2
    dist.all_reduce(y)
    z = y + 1
sums = []
for step in range(3):
    static_x.copy_(torch.full((n,), float(10 * step + rank + 1)))
    graph.replay()
    sums.append(z.cpu().unique().tolist())
dist.destroy_process_group()
print(sums)
"""


def test_a_captured_all_reduce_completes_before_the_next_step_on_replay(torch_npu, tmp_path):
    # An HCCL collective in a graph is a kernel of its stream: the step after it sees the
    # reduced tensor. (gloo underneath works asynchronously; replay waits for it.)
    import subprocess

    script = tmp_path / "worker.py"
    script.write_text(_CAPTURED_ALL_REDUCE_WORKER)
    store = tmp_path / "store"
    workers = [subprocess.Popen([sys.executable, str(script), REFERENCE_PATH, str(store),
                                 str(rank)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for rank in range(2)]
    outputs = [worker.communicate(timeout=120) for worker in workers]
    for worker, (_out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err
    # Step s: 2 * ((10 s + 1) + (10 s + 2)) + 1 everywhere, on both ranks.
    expected = str([[2.0 * (20 * step + 3) + 1] for step in range(3)])
    for out, _ in outputs:
        assert out.strip().splitlines()[-1] == expected
