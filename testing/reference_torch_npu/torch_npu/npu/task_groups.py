"""Task groups of NPU graphs and their updates, as torch_npu documents them.

torch_npu (Ascend/op-plugin ``docs/context/torch_npu-npu-graph_task_group_begin.md``,
``..._group_end.md``, ``..._update_begin.md``, ``..._update_end.md``,
``torch_npu-npu-ExternalEvent.md``) lets a captured op take new host arguments (the
``actual_seq_lengths`` of fused attention, say) between replays:

- while a graph captures, ``graph_task_group_begin(stream)`` ... ``graph_task_group_end(stream)
  -> handle`` mark the tasks issued on the capturing ``stream`` in between as one group;
- later, outside capture, ``graph_task_update_begin(stream, handle)``, the same op calls again
  with new arguments on ``stream``, ``graph_task_update_end(stream)``: those calls do not
  compute; they re-issue the group's tasks in the graph, so following replays run them with
  the new arguments;
- ``ExternalEvent`` orders the update stream before the replayed group: captured
  ``wait`` / ``reset`` on the capturing stream, ``record`` on the update stream after the
  update.

How the reference models it:

- A group is the steps its graph recorded between begin and end. It must hold at least
  one step, and only torch_npu function calls (each one task); aten ops in a group raise
  ``NotImplementedError`` at ``graph_task_group_end``.
- An update window collects the torch_npu calls made in it (on npu tensors) without
  running them; ``graph_task_update_end`` checks that they are the group's calls, in order
  (same functions, the same tensors: same memory, shape, strides and dtype, so that the
  graph's other steps still read what they write), and then replaces the recorded host
  arguments of each step. Every replay from then on runs the steps with them. Updating
  tensor arguments to other memory is not modelled and raises ``NotImplementedError``.
- The device runs each task when issued, so events order nothing: ``ExternalEvent``'s
  ``record`` / ``wait`` / ``reset`` check their stream (a ``torch.npu.Stream``; while a graph
  captures, the capturing stream) and do nothing else.
- Unsupported use raises: groups outside capture, nested groups, a group left open at
  ``capture_end``, begin and end on other streams, updates while capturing, nested
  updates, an update of a reset graph's handle, a replay inside an update window, a
  mismatch between the update's calls and the group's.

Reference-only counters for tests: ``NPUGraph.num_task_groups`` and
``NPUGraph.task_group_updates`` (updates applied to the graph's groups).
"""

from __future__ import annotations

import threading

import torch
from torch.utils import _pytree as pytree

from torch_npu.npu import graphs, streams

TORCH_NPU_STEP_PREFIX = "torch_npu."


class _TaskGroup:
    __slots__ = ("graph", "stream", "start", "stop")

    def __init__(self, graph, stream, start: int) -> None:
        self.graph = graph
        self.stream = stream
        self.start = start
        self.stop: int | None = None

    def steps(self) -> list:
        return self.graph._steps[self.start:self.stop]


class NPUTaskGroupHandle:
    """What ``graph_task_group_end`` returns (torch_npu's ``_NPUTaskGroupHandle``)."""

    __slots__ = ("_group",)

    def __init__(self, group: _TaskGroup) -> None:
        self._group = group

    def __repr__(self) -> str:
        group = self._group
        return (f"<torch_npu.npu task group of {group.stop - group.start} task(s), "
                f"steps {group.start}..{group.stop - 1}>")


class _Update:
    __slots__ = ("handle", "stream", "calls")

    def __init__(self, handle: NPUTaskGroupHandle, stream) -> None:
        self.handle = handle
        self.stream = stream
        self.calls: list[tuple[str, tuple, dict]] = []


class _UpdateState(threading.local):
    def __init__(self) -> None:
        self.update: _Update | None = None


_state = _UpdateState()


def _require_stream(stream, what: str) -> None:
    if not isinstance(stream, streams.Stream):
        raise TypeError(f"{what} expects a torch.npu.Stream, got {type(stream).__name__}.")


def _capturing(what: str):
    graph = graphs._capturing_graph()
    if graph is None:
        raise RuntimeError(f"{what} is only valid while an NPU graph is capturing (it marks "
                           "tasks of the capture).")
    return graph


def _require_current(stream, what: str, role: str) -> None:
    current = streams.current_stream(stream.device_index)
    if stream != current:
        raise RuntimeError(f"{what} got {stream!r}, but the {role} stream is {current!r}; "
                           "pass the stream the work is issued on (torch.npu.current_stream()).")


def graph_task_group_begin(stream) -> None:
    """Start a task group on the capturing ``stream``."""
    what = "torch.npu.graph_task_group_begin"
    _require_stream(stream, what)
    graph = _capturing(what)
    _require_current(stream, what, "capturing")
    if graph._open_task_group is not None:
        raise RuntimeError(f"{what}: a task group is already open in this capture; end it "
                           "with graph_task_group_end first (groups do not nest).")
    graph._open_task_group = _TaskGroup(graph, stream, len(graph._steps))


def graph_task_group_end(stream) -> NPUTaskGroupHandle:
    """End the open task group; returns its handle for ``graph_task_update_begin``."""
    what = "torch.npu.graph_task_group_end"
    _require_stream(stream, what)
    graph = _capturing(what)
    group = graph._open_task_group
    if group is None:
        raise RuntimeError(f"{what} without a matching graph_task_group_begin.")
    if stream != group.stream:
        raise RuntimeError(f"{what} got {stream!r}; the group was begun on "
                           f"{group.stream!r} and must end on the same stream.")
    graph._open_task_group = None
    group.stop = len(graph._steps)
    steps = group.steps()
    if not steps:
        raise RuntimeError(f"{what}: the task group holds no task (no torch_npu op was "
                           "called on npu tensors since graph_task_group_begin).")
    others = [step.name for step in steps if not step.name.startswith(TORCH_NPU_STEP_PREFIX)]
    if others:
        raise NotImplementedError(
            f"{what}: the reference models task groups of torch_npu op calls only; this "
            f"group also holds {others}. Keep other work outside the group.")
    graph._task_groups.append(group)
    return NPUTaskGroupHandle(group)


def graph_task_update_begin(stream, handle) -> None:
    """Open an update of ``handle``'s group: the torch_npu calls that follow, on ``stream``,
    give the group's tasks their new arguments."""
    what = "torch.npu.graph_task_update_begin"
    _require_stream(stream, what)
    if not isinstance(handle, NPUTaskGroupHandle):
        raise TypeError(f"{what} expects a handle from graph_task_group_end, got "
                        f"{type(handle).__name__}.")
    if graphs._capturing_graph() is not None:
        raise RuntimeError(f"{what} while an NPU graph is capturing; update a captured "
                           "graph's task groups after its capture, before its replay.")
    if _state.update is not None:
        raise RuntimeError(f"{what}: an update is already open; end it with "
                           "graph_task_update_end first.")
    group = handle._group
    if group not in group.graph._task_groups:
        raise RuntimeError(f"{what}: the handle's graph was reset since the group was "
                           "captured; its tasks no longer exist.")
    _require_current(stream, what, "current")
    _state.update = _Update(handle, stream)


def _tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree) if isinstance(leaf, torch.Tensor)]


def _same_memory(captured: torch.Tensor, given: torch.Tensor) -> bool:
    return (captured.device == given.device and captured.dtype == given.dtype
            and captured.shape == given.shape and captured.stride() == given.stride()
            and captured.untyped_storage().data_ptr() == given.untyped_storage().data_ptr()
            and captured.storage_offset() == given.storage_offset())


def graph_task_update_end(stream) -> None:
    """Close the open update: the group's tasks take the arguments of the calls made in it."""
    what = "torch.npu.graph_task_update_end"
    _require_stream(stream, what)
    update = _state.update
    if update is None:
        raise RuntimeError(f"{what} without a matching graph_task_update_begin.")
    _state.update = None
    if stream != update.stream:
        raise RuntimeError(f"{what} got {stream!r}; the update was begun on "
                           f"{update.stream!r} and must end on the same stream.")
    group = update.handle._group
    steps = group.steps()
    if len(update.calls) != len(steps):
        raise RuntimeError(
            f"{what}: the update issued {len(update.calls)} torch_npu call(s) for a task group "
            f"of {len(steps)} ({[step.name for step in steps]}); call each op of the group "
            "again, in order.")
    for index, (step, (name, args, kwargs)) in enumerate(zip(steps, update.calls,
                                                             strict=True)):
        if step.name != TORCH_NPU_STEP_PREFIX + name:
            raise RuntimeError(f"{what}: call {index} of the update is torch_npu.{name}, but "
                               f"task {index} of the group is {step.name}.")
        captured, given = _tensors((step.args, step.kwargs)), _tensors((args, kwargs))
        if len(captured) != len(given) or not all(
                _same_memory(c, g) for c, g in zip(captured, given, strict=True)):
            raise NotImplementedError(
                f"{what}: the update of {step.name} passes other tensors than the capture "
                "(other memory, shapes, strides or dtypes, or tensors given or left out); "
                "the reference models updates of host arguments (lengths, scalars) over the "
                "captured tensors.")
    for step, (_, args, kwargs) in zip(steps, update.calls, strict=True):
        # Keep the captured tensor objects (the address check holds them); take the rest.
        step.args, step.kwargs = args, kwargs
    group.graph._task_group_updates += 1


def _pending_update() -> _Update | None:
    return _state.update


def _issue_in_update(name: str, args, kwargs):
    """A torch_npu call inside an update window: collected, not run (it re-issues a task)."""
    update = _state.update
    current = streams.current_stream(update.stream.device_index)
    if current != update.stream:
        raise RuntimeError(f"torch_npu.{name} was issued on {current!r} inside an update "
                           f"window opened on {update.stream!r}; issue it on the update stream.")
    update.calls.append((name, args, kwargs))
    return kwargs.get("out")


def _refuse_replay_in_update() -> None:
    if _state.update is not None:
        raise RuntimeError("replay() inside an open graph task update; call "
                           "torch.npu.graph_task_update_end first.")


class ExternalEvent:
    """An event for ordering work outside a graph with a replay (``torch.npu.ExternalEvent``).

    Captured ``wait`` / ``reset`` make the replay wait for a later ``record`` (on the update
    stream). The reference device runs work when issued, so the three only check that they
    name a stream, and while a graph captures, the capturing stream.
    """

    def _check(self, stream, what: str) -> None:
        _require_stream(stream, f"ExternalEvent.{what}")
        if graphs._capturing_graph() is not None:
            _require_current(stream, f"ExternalEvent.{what}", "capturing")

    def record(self, stream) -> None:
        self._check(stream, "record")

    def wait(self, stream) -> None:
        self._check(stream, "wait")

    def reset(self, stream) -> None:
        self._check(stream, "reset")
