"""torch_npu's fused attention inside FULL NPU graphs, through graph task updates.

``npu_fused_infer_attention_score`` takes its sequence lengths as host lists, which a
captured graph would freeze. torch_npu's answer (its ``graph_task_group_begin`` /
``graph_task_group_end`` / ``graph_task_update_begin`` / ``graph_task_update_end`` pages,
with ``ExternalEvent`` and the op's ``.out`` form over a fixed workspace) is used here:

- **capture** (``capture_fused_attention``, called by the attention backends while a graph
  captures a uniform decode batch): the graph waits on an ``ExternalEvent`` and resets it,
  then the op's ``.out`` form is issued inside a task group with a workspace from
  ``_npu_fused_infer_attention_score_get_max_workspace`` (one per graph and shape, shared by
  the graph's layers, which run one after the other); the handle, the event and the call's
  arguments are kept for the graph, with the layer's name;
- **before each replay** (``NPUGraphWithTaskUpdates.replay``): for every call captured in
  that graph, the layer's attention metadata of this step (vLLM's forward context, which
  vLLM's ``CUDAGraphWrapper`` replays inside) gives the new host arguments
  (``actual_seq_lengths`` and ``actual_seq_lengths_kv``); on a side stream the call is
  re-issued between ``graph_task_update_begin`` and ``graph_task_update_end`` over the
  captured tensors, and the event is recorded so the replayed group runs after its update.

The model runner's graph class (``torch.cuda.CUDAGraph`` under ``npu_device_names``) is an
``NPUGraphWithTaskUpdates``, so vLLM's capture and replay go through it unchanged.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

HostArguments = Callable[[Any], dict[str, Any]]


@dataclass
class CapturedFusedAttention:
    """One fused-attention call captured in a task group of one graph."""

    layer_name: str
    handle: Any  # torch_npu's task-group handle
    event: Any  # torch.npu.ExternalEvent the replayed group waits on
    args: tuple  # query, key, value: the captured tensors
    kwargs: dict[str, Any]  # the call's keyword arguments at capture
    workspace: torch.Tensor
    out: list[torch.Tensor]
    # This step's host arguments from the layer's attention metadata (raises when the
    # metadata is not of the captured batch's shape).
    host_arguments: HostArguments


@dataclass
class _GraphTasks:
    calls: list[CapturedFusedAttention] = field(default_factory=list)
    workspaces: dict[tuple, torch.Tensor] = field(default_factory=dict)
    updates: int = 0


class _Registry:
    def __init__(self) -> None:
        self.capturing: Any = None  # the NPUGraphWithTaskUpdates being captured
        self.by_graph: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.update_stream: Any = None

    def tasks(self, graph) -> _GraphTasks:
        return self.by_graph.setdefault(graph, _GraphTasks())


_registry = _Registry()


def _current_attention_metadata() -> Mapping[str, Any]:
    """This step's attention metadata per layer (vLLM's forward context)."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        raise RuntimeError(
            "An NPU graph with captured fused attention is replayed outside vLLM's forward "
            "context; its task groups need this step's attention metadata to update the "
            "sequence lengths. Replay it inside set_forward_context(attn_metadata, ...).")
    metadata = get_forward_context().attn_metadata
    if not isinstance(metadata, Mapping):
        raise NotImplementedError(
            f"Attention metadata of type {type(metadata).__name__} (micro-batching?) at an NPU "
            "graph replay; the npu target's graph task updates take one dict of metadata "
            "per layer.")
    return metadata


def capture_fused_attention(layer_name: str, args: tuple, kwargs: dict[str, Any],
                            out: list[torch.Tensor], host_arguments: HostArguments) -> None:
    """Issue ``npu_fused_infer_attention_score.out(*args, **kwargs, out=out)`` into the
    graph being captured as a task group whose host arguments are updated before each
    replay from ``host_arguments(this step's metadata of layer_name)``."""
    import torch_npu

    graph = _registry.capturing
    if graph is None or not torch.npu.is_current_stream_capturing():
        raise RuntimeError(
            f"Fused attention of layer {layer_name!r} is being captured outside an "
            "NPUGraphWithTaskUpdates capture (ascend_core.attention.npu_graph_tasks); no "
            "replay would update its sequence lengths. Capture with the npu model runner's "
            "graph class.")
    if not layer_name:
        raise ValueError("capture_fused_attention needs the layer's name (its metadata key), "
                         f"got {layer_name!r}.")
    tasks = _registry.tasks(graph)
    query = args[0]
    key = (tuple(query.shape), query.dtype, kwargs.get("num_heads"))
    workspace = tasks.workspaces.get(key)
    if workspace is None:
        workspace = torch_npu._npu_fused_infer_attention_score_get_max_workspace(
            *args, **kwargs)
        tasks.workspaces[key] = workspace
    stream = torch.npu.current_stream()
    event = torch.npu.ExternalEvent()
    event.wait(stream)
    event.reset(stream)
    torch.npu.graph_task_group_begin(stream)
    torch_npu.npu_fused_infer_attention_score.out(*args, workspace=workspace, out=out,
                                                  **kwargs)
    handle = torch.npu.graph_task_group_end(stream)
    tasks.calls.append(CapturedFusedAttention(layer_name, handle, event, args, dict(kwargs),
                                              workspace, out, host_arguments))


def update_before_replay(graph) -> int:
    """Give every fused-attention task group captured in ``graph`` this step's host
    arguments; returns how many groups were updated."""
    import torch_npu

    tasks = _registry.by_graph.get(graph)
    if tasks is None or not tasks.calls:
        return 0
    metadata = _current_attention_metadata()
    if _registry.update_stream is None:
        _registry.update_stream = torch.npu.Stream()
    stream = _registry.update_stream
    with torch.npu.stream(stream):
        for call in tasks.calls:
            if call.layer_name not in metadata:
                raise KeyError(
                    f"No attention metadata for layer {call.layer_name!r} at the replay of a "
                    f"graph that captured its fused attention (metadata for "
                    f"{sorted(metadata)[:4]}...).")
            kwargs = {**call.kwargs, **call.host_arguments(metadata[call.layer_name])}
            torch.npu.graph_task_update_begin(stream, call.handle)
            torch_npu.npu_fused_infer_attention_score.out(
                *call.args, workspace=call.workspace, out=call.out, **kwargs)
            torch.npu.graph_task_update_end(stream)
            call.event.record(stream)
    tasks.updates += len(tasks.calls)
    return len(tasks.calls)


def task_counts(graph) -> tuple[int, int]:
    """(task groups captured in ``graph``, task-group updates issued for it so far)."""
    tasks = _registry.by_graph.get(graph)
    return (0, 0) if tasks is None else (len(tasks.calls), tasks.updates)


@functools.cache
def graph_cls_with_task_updates() -> type:
    """``torch.npu.NPUGraph`` whose captures collect fused-attention task groups and whose
    replays update them first; made on first use (``torch.npu`` exists once torch_npu is
    imported)."""

    class NPUGraphWithTaskUpdates(torch.npu.NPUGraph):
        def capture_begin(self, *args, **kwargs) -> None:
            super().capture_begin(*args, **kwargs)
            _registry.by_graph[self] = _GraphTasks()
            _registry.capturing = self

        def capture_end(self) -> None:
            try:
                super().capture_end()
            finally:
                _registry.capturing = None

        def replay(self) -> None:
            update_before_replay(self)
            super().replay()

        def reset(self) -> None:
            _registry.by_graph.pop(self, None)
            super().reset()

    return NPUGraphWithTaskUpdates
