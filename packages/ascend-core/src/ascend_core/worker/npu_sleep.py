"""Sleep mode on the npu target: release the weights' and KV cache's NPU memory, restore it.

vLLM's GPU worker frees memory for sleep mode through ``CuMemAllocator``, a CUDA virtual-
memory pool that unmaps physical pages and maps them again at the same addresses. torch_npu
documents no such pool, so this module does the same job with what any PyTorch device
offers:

- **Tagging.** ``NPUSleepPool.allocating(tag)`` is the memory-pool context of vLLM's worker
  (``_maybe_get_memory_pool_context``): while it is open, a ``TorchDispatchMode`` notes the
  storage of every npu tensor an op creates (outputs that alias none of the op's inputs, so
  in-place ops and views are not allocations). Storages are held by weak reference: a
  temporary freed during loading is forgotten with it. vLLM opens it with ``"weights"``
  around model loading and ``"kv_cache"`` around the KV-cache allocation.
- **Sleep.** ``sleep(level)`` releases every live storage of both tags with
  ``untyped_storage().resize_(0)`` (the tensors, views and parameters stay, with no device
  memory behind them) and empties the NPU cache, so ``mem_get_info`` shows the memory free.
  Level 1 copies the weights to pinned host memory first; level 2 keeps nothing (vLLM's
  worker keeps the model's buffers on the host itself; the weights come back with
  ``reload_weights``). The KV cache is discarded at both levels.
- **Wake-up.** ``wake_up(tags)`` resizes each storage back to its old size (fresh device
  memory) and copies the host copy in (level-1 weights) or zeroes it (KV cache, level-2
  weights). ``discard(tags)`` releases tags without a host copy, as vLLM's ``discard``.

Addresses: memory given back and taken again lands at other device addresses, and a
captured NPU graph (FULL decode graphs through vLLM's ``CUDAGraphWrapper``) holds the old
ones. ``NPUWorker`` therefore drops the captured graphs at sleep (which also frees their
pool) and captures them again once every tag is awake; see ``npu_worker``.

Only the two tags vLLM's executor manages (``SLEEP_TAGS``) are pooled. The worker's other
contexts (``"workspace"``, ``"runtime"``: scratch and KV-init state, small) stay resident.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

logger = logging.getLogger(__name__)

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
SLEEP_TAGS = (WEIGHTS, KV_CACHE)
SLEEP_LEVELS = (1, 2)


def _npu_tensors(tree) -> list[torch.Tensor]:
    return [leaf for leaf in pytree.tree_leaves(tree)
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "npu"]


class _AllocationRecorder(TorchDispatchMode):
    """Notes the storages of npu tensors that ops create while it is active."""

    def __init__(self, on_storage) -> None:
        super().__init__()
        self.on_storage = on_storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        outputs = _npu_tensors(result)
        if outputs:
            inputs = {t.untyped_storage().data_ptr() for t in _npu_tensors((args, kwargs))}
            for tensor in outputs:
                storage = tensor.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in inputs:
                    self.on_storage(storage)
        return result


@dataclass
class _Released:
    """A storage put to sleep: its size, and its bytes on the host when they are kept."""

    storage: weakref.ReferenceType
    nbytes: int
    host_copy: torch.Tensor | None


@dataclass
class SleepReport:
    """Bytes one ``sleep``/``discard`` released, per tag, and how many went to the host."""

    released: dict[str, int] = field(default_factory=dict)
    kept_on_host: int = 0

    @property
    def total(self) -> int:
        return sum(self.released.values())


def _byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of a storage's bytes."""
    view = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return view.set_(storage, 0, (storage.nbytes(),), (1,))


class NPUSleepPool:
    """The NPU storages allocated under each sleep tag, released and restored on demand."""

    def __init__(self) -> None:
        self._live: dict[str, weakref.WeakValueDictionary] = {
            tag: weakref.WeakValueDictionary() for tag in SLEEP_TAGS}
        self._asleep: dict[str, list[_Released]] = {}

    # --- tagging ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def allocating(self, tag: str) -> Iterator[None]:
        """Tag every npu storage created inside the block with ``tag``."""
        self._check_tags([tag])
        if tag in self._asleep:
            raise RuntimeError(f"Cannot allocate under tag {tag!r} while it is asleep; call "
                               f"wake_up(tags=[{tag!r}]) first.")
        live = self._live[tag]

        def remember(storage: torch.UntypedStorage) -> None:
            live[id(storage)] = storage

        with _AllocationRecorder(remember):
            yield

    def storages(self, tag: str) -> list[torch.UntypedStorage]:
        """The live storages tagged ``tag`` that hold device memory now."""
        self._check_tags([tag])
        return [s for s in list(self._live[tag].values()) if s.nbytes()]

    def resident_bytes(self, tag: str) -> int:
        """Device bytes the storages tagged ``tag`` hold now."""
        return sum(s.nbytes() for s in self.storages(tag))

    def asleep_bytes(self, tag: str) -> int:
        """Device bytes released under ``tag`` and not yet restored."""
        self._check_tags([tag])
        return sum(entry.nbytes for entry in self._asleep.get(tag, []))

    @property
    def asleep_tags(self) -> tuple[str, ...]:
        return tuple(tag for tag in SLEEP_TAGS if tag in self._asleep)

    @property
    def host_bytes(self) -> int:
        """Host bytes the level-1 copies of the weights take now."""
        return sum(entry.host_copy.nbytes for entries in self._asleep.values()
                   for entry in entries if entry.host_copy is not None)

    # --- sleep and wake-up -----------------------------------------------------------------

    def check_can_sleep(self, level: int) -> None:
        """ValueError for a level the pool does not offer, RuntimeError when already asleep."""
        if type(level) is not int or level not in SLEEP_LEVELS:
            raise ValueError(
                f"Sleep level {level!r} is not one the npu worker offers: 1 (weights to host "
                "memory, KV cache discarded) or 2 (both discarded; reload the weights after "
                "wake_up). Level 0 (pausing the scheduler) is the engine's, not the worker's.")
        if WEIGHTS in self._asleep:
            raise RuntimeError(
                f"The npu worker is already asleep (tags {list(self.asleep_tags)}); call "
                "wake_up() before sleeping again.")

    def sleep(self, level: int = 1) -> SleepReport:
        """Release the weights (to the host at level 1, dropped at level 2) and the KV cache."""
        self.check_can_sleep(level)
        report = SleepReport()
        report.released[WEIGHTS] = self._release(WEIGHTS, keep_on_host=level == 1)
        if KV_CACHE not in self._asleep:  # a discarded KV cache stays discarded
            report.released[KV_CACHE] = self._release(KV_CACHE, keep_on_host=False)
        report.kept_on_host = self.host_bytes
        self._give_back_cache()
        return report

    def discard(self, tags) -> SleepReport:
        """Release ``tags`` without keeping their contents; tags already asleep are left."""
        tags = list(tags)
        self._check_tags(tags)
        report = SleepReport()
        for tag in tags:
            if tag not in self._asleep:
                report.released[tag] = self._release(tag, keep_on_host=False)
        self._give_back_cache()
        return report

    def wake_up(self, tags: list[str] | None = None) -> dict[str, int]:
        """Give ``tags`` (all asleep ones when None) their device memory back; bytes per tag."""
        if not self._asleep:
            raise RuntimeError("wake_up() on an npu worker that is not asleep; call sleep() "
                               "first.")
        if tags is None:
            tags = list(self._asleep)
        else:
            tags = list(tags)
            self._check_tags(tags)
            sleeping = [tag for tag in tags if tag not in self._asleep]
            if sleeping:
                raise ValueError(f"Tags {sleeping} are awake; wake_up takes tags that are "
                                 f"asleep: {list(self.asleep_tags)}.")
        restored = {}
        for tag in tags:
            restored[tag] = self._restore(tag)
        return restored

    # --- the mechanism ---------------------------------------------------------------------

    def _release(self, tag: str, keep_on_host: bool) -> int:
        entries = []
        for storage in self.storages(tag):
            host_copy = None
            if keep_on_host:
                device_bytes = _byte_view(storage)
                host_copy = torch.empty(device_bytes.shape, dtype=torch.uint8,
                                        pin_memory=True)
                host_copy.copy_(device_bytes)
                del device_bytes
            entries.append(_Released(weakref.ref(storage), storage.nbytes(), host_copy))
            storage.resize_(0)
        self._asleep[tag] = entries
        released = sum(entry.nbytes for entry in entries)
        logger.info("npu sleep: released %d bytes of %s (%d storages), %s.", released, tag,
                    len(entries), "kept on the host" if keep_on_host else "discarded")
        return released

    def _restore(self, tag: str) -> int:
        restored = 0
        for entry in self._asleep.pop(tag):
            storage = entry.storage()
            if storage is None:  # freed while asleep (e.g. a weight replaced): nothing to do
                continue
            storage.resize_(entry.nbytes)
            device_bytes = _byte_view(storage)
            if entry.host_copy is not None:
                device_bytes.copy_(entry.host_copy)
            else:
                device_bytes.zero_()  # defined contents: a fresh KV cache, weights to reload
            restored += entry.nbytes
        logger.info("npu wake-up: restored %d bytes of %s.", restored, tag)
        return restored

    def _check_tags(self, tags) -> None:
        unknown = [tag for tag in tags if tag not in SLEEP_TAGS]
        if unknown:
            raise ValueError(f"Unknown sleep tag(s) {unknown}: the npu worker's sleep mode "
                             f"manages {list(SLEEP_TAGS)}.")

    @staticmethod
    def _give_back_cache() -> None:
        gc.collect()
        torch.npu.empty_cache()
