"""What importing the reference does to torch, and how a test undoes what it can.

Like torch_npu, the reference

1. renames torch's PrivateUse1 backend to ``npu`` (``torch.utils.rename_privateuse1_backend``),
   so ``torch.device("npu:0")`` parses and the dispatch key behind "npu" is PrivateUse1;
2. registers ``torch_npu.npu`` as ``torch.npu`` (``torch._register_device_module``);
3. registers the ``hccl`` distributed backend (``torch.distributed.Backend.register_backend``).

Tensors on the "npu" device come from a small C++ extension (``csrc/reference_device.cpp``,
built on first import by ``torch_npu._device_ext``): PrivateUse1 kernels over host memory,
an allocator that accounts each byte against the modelled NPU, a device guard and a
fallback running torch's CPU kernels on host views. ``install`` enables it and adds torch's
generated ``Tensor.npu()`` / ``is_npu`` methods. Its ``hccl`` is gloo underneath,
registered for "cpu" and "npu" tensors; c10d's collectives on npu tensors run gloo's CPU
path on host views of them, so results land in the npu tensors.

The rename cannot be undone in a process, and torch.accelerator then answers from
``torch.npu``. ``uninstall()`` therefore leaves an inert ``torch.npu`` that reports no
NPU, so torch behaves afterwards as on a machine without one; ``hccl`` stays registered, and
the loaded extension stays but refuses new npu memory until torch_npu is imported again.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings

import torch
import torch.distributed as dist

DEVICE_TYPE = "npu"
_DEFAULT_PRIVATEUSE1_NAME = "privateuseone"

def _rename_privateuse1() -> None:
    name = torch._C._get_privateuse1_backend_name()
    if name == DEVICE_TYPE:
        return
    if name != _DEFAULT_PRIVATEUSE1_NAME:
        raise RuntimeError(
            f"torch's PrivateUse1 backend is already named {name!r} by another extension; "
            "the reference torch_npu needs it as 'npu' and cannot share the process with it."
        )
    torch.utils.rename_privateuse1_backend(DEVICE_TYPE)


def _enable_npu_device() -> None:
    from torch_npu import _device_ext

    _device_ext.load().set_enabled(True)
    if not hasattr(torch.Tensor, "is_" + DEVICE_TYPE):
        # Tensor.npu() / .is_npu, Module.npu(), storage .npu(), as torch_npu adds them.
        torch.utils.generate_methods_for_privateuse1_backend(for_packed_sequence=False)


_HCCL_BACKENDS: dict[str, object] = {}


def _hccl_over_gloo(store, rank, size, timeout):
    backend = _ProcessGroupHCCL(store, rank, size, timeout)
    # Kept alive here: the name must keep finding this object (and c10d hands back this
    # Python object, with its method, only while it lives).
    _HCCL_BACKENDS[backend.name] = backend
    return backend


def hccl_backend_named(name: str):
    """The reference ``hccl`` backend whose ``get_hccl_comm_name`` is ``name`` (None if no
    group of this process has that name): what torch_npu's MC2 ops reach through their
    ``group_ep`` string."""
    return _HCCL_BACKENDS.get(name)


# torch's c10d ops whose PrivateUse1 kernels would hand npu tensors to the backend's
# (gloo's) own kernels, which take CPU tensors only.
_COLLECTIVES = (
    "allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_",
    "allgather_coalesced_", "allgather_into_tensor_coalesced_", "reduce_scatter_",
    "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "alltoall_base_",
    "alltoall_", "broadcast_", "reduce_", "gather_", "scatter_", "send", "recv_",
    "recv_any_source_", "barrier", "monitored_barrier_",
)
_collectives_library = None


def _collective_on_host_views(op, *args, **kwargs):
    from torch_npu._on_device import call_on_host

    return call_on_host(op, str(op), args, kwargs)


def _route_npu_collectives_through_gloo() -> None:
    """Make c10d's ops on npu tensors run gloo's CPU path on host views of them.

    As with torch's own PrivateUse1 kernels the op then reaches the group's backend, here
    through its CPU registration (gloo), with CPU tensors over the npu memory: results are
    written into the npu tensors themselves.
    """
    global _collectives_library
    if _collectives_library is not None:
        return
    library = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Overriding a previously registered")
        for name in _COLLECTIVES:
            packet = getattr(torch.ops.c10d, name, None)
            if packet is not None:
                library.impl(name, functools.partial(_collective_on_host_views,
                                                     packet.default), "PrivateUse1")
    _collectives_library = library


def _hccl_backend_class():
    class ProcessGroupHCCL(dist.ProcessGroupGloo):
        """gloo, plus the communicator name torch_npu's ``ProcessGroupHCCL`` gives
        (``get_hccl_comm_name(rank)``), which the MC2 ops take as ``group_ep``."""

        _made = 0

        def __init__(self, store, rank, size, timeout):
            super().__init__(store, rank, size, timeout)
            ProcessGroupHCCL._made += 1
            self.name = f"reference_hccl_{ProcessGroupHCCL._made}"

        def get_hccl_comm_name(self, rank: int) -> str:
            # torch_npu names the communicator; callers pass their own rank.
            return self.name

    return ProcessGroupHCCL


_ProcessGroupHCCL = _hccl_backend_class() if dist.is_available() else None


def _register_hccl() -> None:
    if not dist.is_available():
        return
    _route_npu_collectives_through_gloo()
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _hccl_over_gloo, devices=["cpu", DEVICE_TYPE])


def install(npu_module: types.ModuleType) -> None:
    """Make ``npu_module`` torch's ``npu`` device module (idempotent)."""
    _rename_privateuse1()
    registered = getattr(torch, DEVICE_TYPE, None)
    if registered is not npu_module:
        if registered is not None and not getattr(registered, "_reference_inert", False):
            raise RuntimeError(
                f"torch.npu is already {registered!r}; the reference torch_npu cannot "
                "replace another torch_npu in the same process."
            )
        if registered is not None:
            delattr(torch, DEVICE_TYPE)
        torch._register_device_module(DEVICE_TYPE, npu_module)
        _forget_cached_device_module()
    _enable_npu_device()
    _register_hccl()


def _forget_cached_device_module() -> None:
    # torch.get_device_module caches its answer; torch.accelerator goes through it.
    cache_clear = getattr(torch.get_device_module, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _inert_npu_module() -> types.ModuleType:
    module = types.ModuleType("torch.npu")
    module.__doc__ = "Left by torch_npu._reference.uninstall(): no NPU is present."
    module._reference_inert = True
    module.is_available = lambda: False
    module.device_count = lambda: 0
    # torch.manual_seed seeds a PrivateUse1 module that has these two, and warns otherwise.
    module._is_in_bad_fork = lambda: False
    module.manual_seed_all = lambda seed: None
    return module


def uninstall() -> None:
    """Forget the reference: drop ``torch_npu`` modules, leave an inert ``torch.npu``."""
    from torch_npu import _device_ext

    _device_ext.load().set_enabled(False)
    if hasattr(torch, DEVICE_TYPE):
        delattr(torch, DEVICE_TYPE)
    torch._register_device_module(DEVICE_TYPE, _inert_npu_module())
    _forget_cached_device_module()
    for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
        del sys.modules[name]
