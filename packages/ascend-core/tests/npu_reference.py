"""The reference torch_npu (``testing/reference_torch_npu``) on ``sys.path`` for a block of
tests: what the npu-side test modules of ascend-core share."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

from ascend_kernels.dispatch import torch_npu_module

REFERENCE_PATH = str(Path(__file__).resolve().parents[3] / "testing" / "reference_torch_npu")


def prime_transformers_without_torch_npu() -> None:
    """transformers decides once per process whether torch_npu exists; let it decide before
    the reference is importable, so that it keeps treating this machine as NPU-less."""
    from transformers.utils import import_utils

    import_utils.is_torch_npu_available()
    import_utils.is_torch_npu_available(check_device=True)


@contextlib.contextmanager
def reference_on_path(forget: Iterable[str] = ()) -> Iterator[None]:
    """Put the reference first on ``sys.path`` for the block; afterwards forget the modules
    in ``forget`` (imported over it), uninstall its npu device and take it off the path."""
    prime_transformers_without_torch_npu()
    sys.path.insert(0, REFERENCE_PATH)
    importlib.invalidate_caches()
    torch_npu_module.cache_clear()
    try:
        yield
    finally:
        for name in forget:
            sys.modules.pop(name, None)
        if "torch_npu" in sys.modules:
            importlib.import_module("torch_npu._reference").uninstall()
        sys.path.remove(REFERENCE_PATH)
        torch_npu_module.cache_clear()


@contextlib.contextmanager
def reference_torch_npu(forget: Iterable[str] = ()) -> Iterator[object]:
    """``reference_on_path``, yielding the reference torch_npu, checked to be the module that
    ascend-kernels dispatches to."""
    with reference_on_path(forget):
        module = importlib.import_module("torch_npu")
        assert torch_npu_module() is module
        yield module
