"""Streams and events of the reference ``torch.npu``.

Follows ``torch_npu.npu.Stream`` / ``torch_npu.npu.Event`` as documented by torch_npu
(``Stream(device=None, priority=0)``, ``Event(enable_timing=False, blocking=False,
interprocess=False)``; Ascend/op-plugin ``docs/context/torch_npu-npu-Event()-recorded_time-().md``
for events), which mirror torch.cuda's. The reference runs every op synchronously on the CPU,
so work on any stream is finished when the call returns: waits and synchronisations return at
once and ``query()`` is always true. Events take a host timestamp when recorded, so
``elapsed_time`` measures host time between the two records.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch

from torch_npu.npu._device import DEVICE_TYPE, _index

_stream_ids = itertools.count(1)


class Stream:
    """An NPU stream (``torch_npu.npu.Stream(device=None, priority=0)``).

    ``device=None`` or a negative index means the current NPU, as documented.
    """

    def __init__(self, device=None, priority: int = 0, **kwargs) -> None:
        if kwargs:
            raise TypeError(
                f"reference torch_npu.npu.Stream does not model arguments {sorted(kwargs)}; "
                "it takes device and priority."
            )
        if isinstance(device, int) and not isinstance(device, bool) and device < 0:
            device = None
        self.device_index = _index(device)
        self.priority = int(priority)
        self.npu_stream = next(_stream_ids)

    @classmethod
    def _default(cls, index: int) -> Stream:
        stream = cls(index)
        stream.npu_stream = 0
        return stream

    @property
    def device(self) -> torch.device:
        return torch.device(DEVICE_TYPE, self.device_index)

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``: already true in the reference."""
        _require_event(event)

    def wait_stream(self, stream: Stream) -> None:
        """Make later work on this stream wait for ``stream``'s: already true in the reference."""
        if not isinstance(stream, Stream):
            raise TypeError(f"wait_stream expects a torch.npu.Stream, got {type(stream).__name__}.")

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one when ``None``) on this stream and return it."""
        event = Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        """Whether all work on the stream is done: always, in the reference."""
        return True

    def synchronize(self) -> None:
        """Wait for the stream's work: nothing is ever pending in the reference."""
        _refuse_sync_while_capturing("Stream.synchronize()")

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Stream)
            and self.npu_stream == other.npu_stream
            and self.device_index == other.device_index
        )

    def __hash__(self) -> int:
        return hash((self.npu_stream, self.device_index))

    def __repr__(self) -> str:
        return f"<torch_npu.npu.Stream device={self.device} npu_stream={self.npu_stream}>"


class Event:
    """An NPU event (``torch_npu.npu.Event(enable_timing=False, blocking=False,
    interprocess=False)``).

    ``interprocess=True`` (IPC handles) is not modelled and raises ``NotImplementedError``.
    """

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        if interprocess:
            raise NotImplementedError(
                "reference torch_npu.npu.Event does not model interprocess events."
            )
        self.enable_timing = bool(enable_timing)
        self.blocking = bool(blocking)
        self._recorded_at: float | None = None
        self._stream: Stream | None = None

    def record(self, stream: Stream | None = None) -> None:
        """Record the event on ``stream`` (the current stream when ``None``)."""
        self._stream = current_stream() if stream is None else stream
        self._recorded_at = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        """Make ``stream``'s later work wait for this event: already true in the reference."""
        (current_stream() if stream is None else stream).wait_event(self)

    def query(self) -> bool:
        """Whether the work before the record has finished: always, in the reference."""
        return True

    def synchronize(self) -> None:
        """Wait until the event has completed: it completes when recorded, in the reference."""
        _refuse_sync_while_capturing("Event.synchronize()")

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds between this event's record and ``end_event``'s.

        Both events must have been created with ``enable_timing=True`` and recorded, as
        torch_npu requires; otherwise ``RuntimeError``.
        """
        _require_event(end_event)
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self._recorded_at is None or end_event._recorded_at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        return (end_event._recorded_at - self._recorded_at) * 1000.0

    def __repr__(self) -> str:
        state = "recorded" if self._recorded_at is not None else "not recorded"
        return f"<torch_npu.npu.Event {state}>"


def _refuse_sync_while_capturing(what: str) -> None:
    from torch_npu.npu import graphs

    graphs._refuse_sync_while_capturing(what)


def _require_event(event: object) -> None:
    if not isinstance(event, Event):
        raise TypeError(f"Expected a torch.npu.Event, got {type(event).__name__}.")


class _Streams(threading.local):
    def __init__(self) -> None:
        self.default: dict[int, Stream] = {}
        self.current: dict[int, Stream] = {}


_streams = _Streams()


def default_stream(device=None) -> Stream:
    """The NPU's default stream (``torch_npu.npu.default_stream``)."""
    index = _index(device)
    if index not in _streams.default:
        _streams.default[index] = Stream._default(index)
    return _streams.default[index]


def current_stream(device=None) -> Stream:
    """The NPU's current stream (``torch_npu.npu.current_stream``)."""
    index = _index(device)
    return _streams.current.get(index) or default_stream(index)


def set_stream(stream: Stream) -> None:
    """Make ``stream`` current on its NPU (``torch_npu.npu.set_stream``); ``None`` does nothing."""
    if stream is None:
        return
    if not isinstance(stream, Stream):
        raise TypeError(f"set_stream expects a torch.npu.Stream, got {type(stream).__name__}.")
    _streams.current[stream.device_index] = stream


class StreamContext:
    """Context manager making a stream current (``torch_npu.npu.stream``)."""

    def __init__(self, stream: Stream | None) -> None:
        if stream is not None and not isinstance(stream, Stream):
            raise TypeError(f"stream() expects a torch.npu.Stream, got {type(stream).__name__}.")
        self.stream = stream
        self._previous: Stream | None = None

    def __enter__(self) -> Stream | None:
        if self.stream is not None:
            self._previous = current_stream(self.stream.device_index)
            set_stream(self.stream)
        return self.stream

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            set_stream(self._previous)


def stream(stream: Stream | None) -> StreamContext:
    """Context manager making ``stream`` current; ``None`` is a no-op, as in torch_npu."""
    return StreamContext(stream)


def _reset() -> None:
    _streams.default.clear()
    _streams.current.clear()
