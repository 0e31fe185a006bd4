"""Graph task groups of the reference: a fused attention captured in a task group, with a
workspace, replays with the lengths of its last update -- the eager op's result with those
lengths -- and keeps the captured ones without an update; misuse raises."""

from __future__ import annotations

import pytest
import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 4, 2, 32, 128, 6




def _inputs(batch: int = 2, q_s: int = 1):
    generator = torch.Generator().manual_seed(7)

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(torch.bfloat16).npu()

    query = randn(batch, q_s, HEADS, HEAD_DIM)
    key = randn(BLOCKS, BLOCK, KV_HEADS * HEAD_DIM)
    value = randn(BLOCKS, BLOCK, KV_HEADS * HEAD_DIM)
    table = torch.tensor([[1, 2, 0], [3, 4, 5]], dtype=torch.int32)[:batch].npu()
    return query, key, value, table


_MASKS: list[torch.Tensor] = []


def _causal_mask() -> torch.Tensor:
    """The compressed causal mask on the npu, made once (not inside a capture)."""
    if not _MASKS:
        _MASKS.append(torch.triu(torch.ones(2048, 2048, dtype=torch.int8), diagonal=1).npu())
    return _MASKS[0]


def _kwargs(table, lengths, q_s=1):
    extra = {}
    if q_s > 1:
        extra = {"atten_mask": _causal_mask(), "sparse_mode": 3,
                 "actual_seq_lengths": [q_s] * len(lengths)}
    return dict(actual_seq_lengths_kv=lengths, block_table=table, block_size=BLOCK,
                num_heads=HEADS, num_key_value_heads=KV_HEADS, scale=HEAD_DIM ** -0.5,
                input_layout="BSND", **extra)


class _Captured:
    """One fused attention captured in a task group, as a graph-mode attention layer does."""

    def __init__(self, torch_npu, query, key, value, table, lengths, q_s=1):
        self.torch_npu = torch_npu
        self.inputs = (query, key, value)
        self.table = table
        self.q_s = q_s
        self.workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            query, key, value, **_kwargs(table, lengths, q_s))
        self.out = torch.empty_like(query)
        self.lse = torch.empty(1, dtype=torch.float16, device="npu")
        self.event = torch.npu.ExternalEvent()
        self.graph = torch.npu.NPUGraph()
        with torch.npu.graph(self.graph):
            stream = torch.npu.current_stream()
            self.event.wait(stream)
            self.event.reset(stream)
            torch.npu.graph_task_group_begin(stream)
            self.call(lengths)
            self.handle = torch.npu.graph_task_group_end(stream)
            self.doubled = self.out * 2  # later work reads the group's output

    def call(self, lengths):
        return self.torch_npu.npu_fused_infer_attention_score.out(
            *self.inputs, workspace=self.workspace, out=[self.out, self.lse],
            **_kwargs(self.table, lengths, self.q_s))

    def update(self, lengths) -> None:
        update_stream = torch.npu.Stream()
        with torch.npu.stream(update_stream):
            torch.npu.graph_task_update_begin(update_stream, self.handle)
            self.call(lengths)
            torch.npu.graph_task_update_end(update_stream)
            self.event.record(update_stream)

    def eager(self, lengths) -> torch.Tensor:
        out, _ = self.torch_npu.npu_fused_infer_attention_score(
            *self.inputs, **_kwargs(self.table, lengths, self.q_s))
        return out.cpu()


@pytest.mark.parametrize("q_s", [1, 3])
def test_updated_lengths_replay_like_the_eager_op_and_stay_for_later_replays(torch_npu, q_s):
    query, key, value, table = _inputs(q_s=q_s)
    captured = _Captured(torch_npu, query, key, value, table, [5, 300], q_s=q_s)
    assert captured.graph.step_names()[0] == "torch_npu.npu_fused_infer_attention_score.out"
    assert captured.graph.num_task_groups == 1
    old, new = captured.eager([5, 300]), captured.eager([200, 17])
    assert not torch.equal(old, new)
    # Replay without an update keeps the captured lengths.
    captured.out.zero_()
    captured.graph.replay()
    torch.testing.assert_close(captured.out.cpu(), old, rtol=0, atol=0)
    # An update gives the group new lengths; the update's call itself computes nothing.
    captured.out.zero_()
    captured.update([200, 17])
    assert torch.count_nonzero(captured.out.cpu()) == 0
    assert captured.graph.task_group_updates == 1
    captured.graph.replay()
    torch.testing.assert_close(captured.out.cpu(), new, rtol=0, atol=0)
    torch.testing.assert_close(captured.doubled.cpu(), (new.float() * 2).to(new.dtype))
    # New query contents with the updated lengths, replayed again without another update.
    query.copy_(torch.randn(query.shape).to(query.dtype))
    captured.graph.replay()
    torch.testing.assert_close(captured.out.cpu(), captured.eager([200, 17]), rtol=0, atol=0)


def test_out_form_and_workspace(torch_npu):
    query, key, value, table = _inputs()
    kwargs = _kwargs(table, [5, 300])
    workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
        query, key, value, **kwargs)
    assert workspace.device.type == "npu" and workspace.dtype == torch.uint8
    # float32 scratch of B * Q_S * N rows of D + 2 values.
    assert workspace.numel() == 4 * 2 * 1 * HEADS * (HEAD_DIM + 2)
    out = torch.empty_like(query)
    lse = torch.empty(1, dtype=torch.float32, device="npu")
    returned = torch_npu.npu_fused_infer_attention_score.out(
        query, key, value, workspace=workspace, out=[out, lse], **kwargs)
    assert returned[0] is out and returned[1] is lse
    expected, _ = torch_npu.npu_fused_infer_attention_score(query, key, value, **kwargs)
    torch.testing.assert_close(out.cpu(), expected.cpu(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="workspace"):
        torch_npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace[:10], out=[out, lse], **kwargs)
    with pytest.raises(RuntimeError, match=r"out\[0\]"):
        torch_npu.npu_fused_infer_attention_score.out(
            query, key, value, workspace=workspace, out=[out[:1], lse], **kwargs)


def test_task_group_misuse_raises(torch_npu):
    query, key, value, table = _inputs()
    stream = torch.npu.Stream()
    with pytest.raises(RuntimeError, match="only valid while an NPU graph is capturing"):
        torch.npu.graph_task_group_begin(stream)
    with pytest.raises(TypeError, match="torch.npu.Stream"):
        torch.npu.ExternalEvent().record(None)
    graph = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="task group still open"):
        with torch.npu.graph(graph):
            torch.npu.graph_task_group_begin(torch.npu.current_stream())
    graph = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="holds no task"):
        with torch.npu.graph(graph):
            capture_stream = torch.npu.current_stream()
            torch.npu.graph_task_group_begin(capture_stream)
            torch.npu.graph_task_group_end(capture_stream)
    graph = torch.npu.NPUGraph()
    with pytest.raises(NotImplementedError, match="torch_npu op calls only"):
        with torch.npu.graph(graph):
            capture_stream = torch.npu.current_stream()
            torch.npu.graph_task_group_begin(capture_stream)
            query * 2
            torch.npu.graph_task_group_end(capture_stream)
    graph = torch.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="capturing stream"):
        with torch.npu.graph(graph):
            torch.npu.ExternalEvent().wait(torch.npu.Stream())

    captured = _Captured(torch_npu, query, key, value, table, [5, 300])
    update_stream = torch.npu.Stream()
    with pytest.raises(RuntimeError, match="current stream"):
        torch.npu.graph_task_update_begin(update_stream, captured.handle)  # not current
    with torch.npu.stream(update_stream):
        torch.npu.graph_task_update_begin(update_stream, captured.handle)
        with pytest.raises(RuntimeError, match="update_end first"):
            captured.graph.replay()
        with pytest.raises(RuntimeError, match="0 torch_npu call"):
            torch.npu.graph_task_update_end(update_stream)
        # Other tensors than the captured ones are not a host-argument update.
        torch.npu.graph_task_update_begin(update_stream, captured.handle)
        torch_npu.npu_fused_infer_attention_score.out(
            query.clone(), key, value, workspace=captured.workspace,
            out=[captured.out, captured.lse], **_kwargs(table, [7, 9]))
        with pytest.raises(NotImplementedError, match="other tensors"):
            torch.npu.graph_task_update_end(update_stream)
    # A failed update changed nothing: the captured lengths replay.
    captured.graph.replay()
    torch.testing.assert_close(captured.out.cpu(), captured.eager([5, 300]), rtol=0, atol=0)
    assert captured.graph.task_group_updates == 0
    captured.graph.reset()
    with torch.npu.stream(update_stream), pytest.raises(RuntimeError, match="was reset"):
        torch.npu.graph_task_update_begin(update_stream, captured.handle)
