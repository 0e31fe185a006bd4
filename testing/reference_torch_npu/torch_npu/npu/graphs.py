"""NPU graphs of the reference ``torch.npu``: ``NPUGraph``, ``graph``, capture and replay.

Follows torch_npu's ``torch.npu.NPUGraph`` / ``torch.npu.graph(npu_graph, pool=None,
stream=None, capture_error_mode="global")``, documented as torch.cuda's CUDAGraph /
torch.cuda.graph for npu devices.

How the reference models a graph (it has no device queue to capture):

- **Capture** runs the body eagerly and records, as steps, the work issued to the NPU: each
  aten op that touches an npu tensor or names the npu device (seen through a
  ``TorchDispatchMode``, so after autograd and, outside inference mode, after composite ops
  decomposed), and each reference torch_npu function called on npu tensors (one step, as
  one kernel launch). Host work (ops on CPU tensors only, Python) runs once and is not part
  of the graph, as on a device. View ops only change metadata and are not replayed, unless
  they copied (under inference mode the mode sees ``aten.reshape`` / ``aten.to``, which
  copy when they cannot alias): then they are steps like any other.
- **Replay** runs the steps again, in order, on the very tensors recorded: the static
  inputs as they are now, the captured intermediates and outputs. An op that wrote into a
  tensor writes into it again; an op that made a fresh tensor computes it again and the
  result is copied into the tensor captured then. So the captured outputs hold what the
  captured work computes from the static inputs' current contents, and Python values read
  at capture time (shapes, lists of ints) stay frozen, as in a real graph. Unlike a real
  graph, replay allocates transient results (freed at once), and random ops draw anew.
- **What a graph cannot hold raises at capture**, as the device runtime refuses it: host
  synchronisation (``.item()``, ``.tolist()``, ``nonzero``, boolean-mask indexing,
  ``unique``, ``masked_select``, ``torch.equal``, ``torch.npu.synchronize()``, stream and
  event synchronisation) and copies between npu and pageable host memory (only
  ``non_blocking`` copies from or to pinned host memory are captured). Capture must run on
  a stream other than the default stream (``torch.npu.graph`` picks a side stream).

A captured graph refers to device addresses, as a real one does: ``replay()`` raises when the
memory of a tensor it captured was released or moved since (storage resized), instead of
running on freed memory. The captured tensors stay alive with the graph until ``reset()``,
so their memory stays allocated, as a graph's private pool does; ``pool`` arguments are
accepted and only name the pool (``graph_pool_handle()``).
"""

from __future__ import annotations

import gc
import itertools
import threading

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from torch_npu.npu import streams

DEVICE_TYPE = "npu"
_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

aten = torch.ops.aten
# Ops whose result the host must wait for (a value or a data-dependent shape).
_HOST_SYNC = {
    aten._local_scalar_dense, aten.item, aten.equal, aten.is_nonzero, aten.nonzero,
    aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
    aten.unique_consecutive, aten.unique_dim_consecutive,
}
_pool_ids = itertools.count(1)


class _Capture(threading.local):
    def __init__(self) -> None:
        self.graph: NPUGraph | None = None


_capture = _Capture()


def _capturing_graph() -> NPUGraph | None:
    """The graph being captured on this thread, or None."""
    return _capture.graph


def is_current_stream_capturing() -> bool:
    """Whether a graph is being captured (``torch.npu.is_current_stream_capturing``)."""
    return _capture.graph is not None


def _refuse_sync_while_capturing(what: str) -> None:
    if _capture.graph is not None:
        raise RuntimeError(
            f"{what} synchronizes with the host, which is not permitted while an NPU graph is "
            "capturing (the runtime fails the capture, as CUDA's "
            "cudaErrorStreamCaptureUnsupported). Move it out of the captured region."
        )


def _is_npu(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.device.type == DEVICE_TYPE
    return isinstance(value, torch.device) and value.type == DEVICE_TYPE


def _touches_npu(tree) -> bool:
    return any(_is_npu(leaf) for leaf in pytree.tree_leaves(tree))


def _host_tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree)
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu"]


def _check_capturable(func, args, kwargs) -> None:
    name = str(func)
    if func._overloadpacket in _HOST_SYNC or func in _HOST_SYNC:
        _refuse_sync_while_capturing(f"{name} (e.g. .item(), .tolist(), nonzero, unique)")
    if func._overloadpacket in (aten.index, aten.index_put, aten.index_put_,
                                aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in indices):
            _refuse_sync_while_capturing(f"{name} with a boolean mask (it calls nonzero)")
    if func._overloadpacket is aten.repeat_interleave and kwargs.get("output_size") is None:
        if len(args) < 3 or args[-1] is None:
            _refuse_sync_while_capturing(f"{name} without output_size")
    host = [t for t in _host_tensors((args, kwargs)) if t.dim() > 0]
    if func._overloadpacket in (aten.copy_, aten._to_copy, aten._copy_from):
        non_blocking = bool(kwargs.get("non_blocking", False)) or (
            func._overloadpacket is aten.copy_ and len(args) > 2 and bool(args[2]))
        to_host = (func._overloadpacket is aten._to_copy
                   and not _is_npu(kwargs.get("device", args[0].device)))
        if to_host or any(not (t.is_pinned() and non_blocking) for t in host):
            raise RuntimeError(
                f"{name} copies between the npu and pageable host memory (or blocks on the "
                "host), which is not permitted while an NPU graph is capturing; only "
                "non_blocking copies from or to pinned host memory can be captured."
            )


class _Step:
    __slots__ = ("function", "args", "kwargs", "result", "name")

    def __init__(self, function, args, kwargs, result, name) -> None:
        self.function = function
        self.args = args
        self.kwargs = kwargs
        self.result = result
        self.name = name

    def run(self) -> None:
        fresh = self.function(*self.args, **self.kwargs)
        for leaf in pytree.tree_leaves(fresh):
            if isinstance(leaf, torch.ScriptObject) or type(leaf).__name__ == "Work":
                # A collective (c10d op, gloo underneath) hands back its work: the next
                # step runs after it, as kernels in one stream do.
                leaf.wait()
        written = {t.untyped_storage().data_ptr()
                   for t in pytree.tree_leaves((self.args, self.kwargs))
                   if isinstance(t, torch.Tensor)}
        for captured, now in zip(pytree.tree_leaves(self.result), pytree.tree_leaves(fresh),
                                 strict=True):
            if not isinstance(captured, torch.Tensor) or captured is now:
                continue
            if now.untyped_storage().data_ptr() in written:
                continue  # an argument written again in place, or a view of one
            captured.copy_(now)


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: NPUGraph) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _touches_npu((args, kwargs)):
            return func(*args, **kwargs)  # host work: runs once, not in the graph
        _check_capturable(func, args, kwargs)
        if isinstance(func, torch._ops.OpOverload) and _runs_python_per_step(func):
            # vLLM's attention ops run Python that reads the step's forward context: a
            # device graph holds the kernels they launched at capture, not that Python, so
            # their inner work is recorded step by step (through their npu kernel).
            with self:
                return func.redispatch(_NPU_KEYS, *args, **kwargs)
        if isinstance(func, torch._ops.OpOverload) and func.namespace != "aten":
            # A custom op (e.g. a torch.library op around torch_npu calls) is one step,
            # as a kernel launch: the torch_npu functions it calls are not steps of their
            # own (the aten ops inside it are not seen by this mode either).
            graph, _capture.graph = _capture.graph, None
            try:
                result = func(*args, **kwargs)
            finally:
                _capture.graph = graph
        else:
            result = func(*args, **kwargs)
        if not func.is_view or not _aliases_an_input(result, (args, kwargs)):
            # Ops marked as views that copied this time (under inference mode the mode sees
            # aten.reshape / aten.to themselves, which copy when they cannot alias) are
            # work on the device like any other.
            self.graph._steps.append(_Step(func, args, kwargs, result, str(func)))
        return result


_NPU_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)


def _runs_python_per_step(func) -> bool:
    """vLLM's attention and KV-cache-update custom ops (``torch.ops.vllm.unified_*``)."""
    name = func._schema.name
    return func.namespace == "vllm" and ("attention" in name or "kv_cache_update" in name)


def _aliases_an_input(result, inputs) -> bool:
    storages = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(inputs)
                if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in storages
               for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor))


class NPUGraph:
    """An NPU graph (``torch.npu.NPUGraph``): capture once, replay many times.

    See the module's docstring for what capture records and replay runs.
    """

    def __init__(self, keep_graph: bool = False) -> None:
        self._steps: list[_Step] = []
        self._recorder: _Recorder | None = None
        self._captured = False
        self._pool = None
        self._addresses: list[tuple[torch.Tensor, int]] = []
        # Task groups (torch_npu.npu.task_groups): the open one while capturing, the closed
        # ones, and how many updates were applied to them.
        self._open_task_group = None
        self._task_groups: list = []
        self._task_group_updates = 0

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        """Start recording the work issued on this thread to the NPU."""
        if capture_error_mode not in _CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode={capture_error_mode!r}; expected one of "
                             f"{_CAPTURE_ERROR_MODES}.")
        if _capture.graph is not None:
            raise RuntimeError("An NPU graph is already capturing on this thread; nested "
                               "captures are not allowed.")
        if self._captured or self._steps:
            raise RuntimeError("This NPUGraph already holds a capture; call reset() first.")
        if streams.current_stream() == streams.default_stream():
            raise RuntimeError("NPU graphs must be captured on a non-default stream "
                               "(torch.npu.graph() uses a side stream for you).")
        self._pool = pool if pool is not None else graph_pool_handle()
        self._recorder = _Recorder(self)
        self._recorder.__enter__()
        _capture.graph = self

    def capture_end(self) -> None:
        """Stop recording; the graph can then be replayed."""
        if _capture.graph is not self:
            raise RuntimeError("capture_end() without a matching capture_begin().")
        if self._open_task_group is not None:
            self._abort()
            raise RuntimeError("capture_end() with a task group still open; call "
                               "torch.npu.graph_task_group_end before the capture ends. The "
                               "capture was dropped.")
        self._stop()
        self._captured = True
        self._addresses = _device_addresses(self._steps)

    def _stop(self) -> None:
        _capture.graph = None
        recorder, self._recorder = self._recorder, None
        recorder.__exit__(None, None, None)

    def _abort(self) -> None:
        if _capture.graph is self:
            self._stop()
        self._steps.clear()
        self._open_task_group = None
        self._task_groups.clear()
        self._task_group_updates = 0

    def _record_call(self, function, name: str, args, kwargs):
        with _disable_current_modes():
            result = function(*args, **kwargs)
        self._steps.append(_Step(function, args, kwargs, result, f"torch_npu.{name}"))
        return result

    def replay(self) -> None:
        """Run the captured work again on the captured tensors."""
        if not self._captured:
            raise RuntimeError("replay() needs a finished capture (capture_begin / "
                               "capture_end, or torch.npu.graph).")
        if _capture.graph is not None:
            raise RuntimeError("Cannot replay an NPU graph while capturing another.")
        from torch_npu.npu import task_groups

        task_groups._refuse_replay_in_update()
        _check_addresses(self._addresses)
        with torch.inference_mode():
            for step in self._steps:
                step.run()

    def reset(self) -> None:
        """Drop the capture and the tensors it kept alive."""
        self._abort()
        self._captured = False
        self._addresses = []

    def pool(self):
        """The memory pool id of this graph, to share with later captures."""
        return self._pool

    @property
    def num_steps(self) -> int:
        """Reference only: how many NPU steps the capture recorded."""
        return len(self._steps)

    @property
    def num_task_groups(self) -> int:
        """Reference only: task groups captured (``graph_task_group_begin`` / ``_end``)."""
        return len(self._task_groups)

    @property
    def task_group_updates(self) -> int:
        """Reference only: updates applied to this graph's task groups so far."""
        return self._task_group_updates

    def step_names(self) -> list[str]:
        """Reference only: the recorded steps, in order (aten ops and torch_npu functions)."""
        return [step.name for step in self._steps]


def _device_addresses(steps: list[_Step]) -> list[tuple[torch.Tensor, int]]:
    """Each npu tensor the steps use, with the device address its memory had at capture."""
    seen: dict[int, tuple[torch.Tensor, int]] = {}
    for step in steps:
        for leaf in pytree.tree_leaves((step.args, step.kwargs, step.result)):
            if _is_npu(leaf) and isinstance(leaf, torch.Tensor) and id(leaf) not in seen:
                seen[id(leaf)] = (leaf, leaf.untyped_storage().data_ptr())
    return list(seen.values())


def _check_addresses(addresses: list[tuple[torch.Tensor, int]]) -> None:
    """A graph holds device addresses: memory released or moved since capture breaks it."""
    for tensor, address in addresses:
        now = tensor.untyped_storage().data_ptr()
        if now != address:
            raise RuntimeError(
                f"This NPU graph was captured over device memory at {address:#x} that is now "
                f"at {now:#x} (a {tuple(tensor.shape)} {tensor.dtype} tensor whose storage was "
                "released or reallocated since capture, e.g. by sleep mode); replaying it "
                "would use freed memory. Capture the graph again.")


def graph_pool_handle():
    """An id naming a graph memory pool (``torch.npu.graph_pool_handle``)."""
    return (0, next(_pool_ids))


class graph:
    """Context manager capturing its body into ``npu_graph`` (``torch.npu.graph``).

    As torch.cuda.graph: synchronizes, collects garbage and empties the cache first, then
    captures on ``stream`` (a side stream when None).
    """

    default_capture_stream: streams.Stream | None = None

    def __init__(self, npu_graph: NPUGraph, pool=None, stream=None,
                 capture_error_mode: str = "global") -> None:
        if not isinstance(npu_graph, NPUGraph):
            raise TypeError(f"graph() expects a torch.npu.NPUGraph, got "
                            f"{type(npu_graph).__name__}.")
        if stream is None:
            if graph.default_capture_stream is None:
                graph.default_capture_stream = streams.Stream()
            stream = graph.default_capture_stream
        self.npu_graph = npu_graph
        self.pool = pool
        self.capture_error_mode = capture_error_mode
        self.stream_context = streams.stream(stream)

    def __enter__(self) -> None:
        from torch_npu.npu import _device, memory

        _device.synchronize()
        gc.collect()
        memory.empty_cache()
        self.stream_context.__enter__()
        try:
            self.npu_graph.capture_begin(self.pool, self.capture_error_mode)
        except BaseException:
            self.stream_context.__exit__(None, None, None)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.npu_graph.capture_end()
            else:
                self.npu_graph._abort()  # a failed capture leaves nothing to replay
        finally:
            self.stream_context.__exit__(None, None, None)
