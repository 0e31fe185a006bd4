"""Runs the reference's torch_npu functions on npu tensors.

The functions in ``_ops*.py`` compute with torch on CPU tensors. ``on_device(function)``
gives each a torch_npu-like front: when its tensor arguments are on an npu device, it
passes host views of them (the same memory, see ``csrc/reference_device.cpp``), so writes
into an argument (a KV cache) land in the npu tensor, and returns results on that npu
device: a result that is a view of an argument becomes the same view of the npu argument,
a fresh result is copied to the device. CPU arguments only: the function runs as before.
npu tensors of two devices, or npu and CPU tensors with dimensions, in one call raise the
device mismatch a real NPU op raises (0-dim CPU tensors pass, as CPU scalars do in torch).

While an ``NPUGraph`` is capturing, a call with npu tensors is one captured step, run again
on replay, as a real torch_npu op is one kernel launch in the graph (``torch_npu.npu.graphs``).
Inside a graph task update (``torch_npu.npu.task_groups``) such a call is not run: it gives
new arguments to the captured task it re-issues.

Storage formats (``torch_npu._formats``): ``nz`` names the arguments the op takes in
FRACTAL_NZ; an npu tensor cast to FRACTAL_NZ in any other argument raises, as on an NPU.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.utils import _pytree as pytree

from torch_npu import _device_ext, _formats

DEVICE_TYPE = "npu"


def _device_of(tensors: list[torch.Tensor], name: str) -> torch.device | None:
    device = None
    host = None
    for tensor in tensors:
        if tensor.device.type == DEVICE_TYPE:
            if device is None:
                device = tensor.device
            elif tensor.device != device:
                host = tensor.device
        elif tensor.dim() > 0 and host is None:
            host = tensor.device
    if device is not None and host is not None:
        raise RuntimeError(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{device} and {host}! (torch_npu.{name})"
        )
    return device


def _back_on(result, device: torch.device, npu_by_host: dict[int, torch.Tensor],
             npu_by_data: dict[int, torch.Tensor]):
    if not isinstance(result, torch.Tensor) or result.device.type != "cpu":
        return result
    same = npu_by_host.get(id(result))
    if same is not None:
        return same
    owner = npu_by_data.get(result.untyped_storage().data_ptr())
    if owner is not None and result.untyped_storage().nbytes() > 0:
        view = torch.empty(0, dtype=result.dtype, device=device)
        return view.set_(owner.untyped_storage(), result.storage_offset(), result.size(),
                         result.stride())
    return result.to(device)


def call_on_host(function, name: str, args, kwargs):
    """``function(*args, **kwargs)`` with npu tensors given as host views; results back."""
    flat, spec = pytree.tree_flatten((args, kwargs))
    tensors = [item for item in flat if isinstance(item, torch.Tensor)]
    device = _device_of(tensors, name)
    if device is None:
        return function(*args, **kwargs)
    ext = _device_ext.load()
    npu_by_host: dict[int, torch.Tensor] = {}
    npu_by_data: dict[int, torch.Tensor] = {}
    host_flat = []
    for item in flat:
        if isinstance(item, torch.Tensor) and item.device.type == DEVICE_TYPE:
            host = ext.host_view(item)
            npu_by_host[id(host)] = item
            npu_by_data[item.untyped_storage().data_ptr()] = item
            host_flat.append(host)
        else:
            host_flat.append(item)
    host_args, host_kwargs = pytree.tree_unflatten(host_flat, spec)
    result = function(*host_args, **host_kwargs)
    return pytree.tree_map(lambda r: _back_on(r, device, npu_by_host, npu_by_data), result)


def on_device(function, name: str | None = None, nz: tuple[str, ...] = ()):
    """Wrap a reference torch_npu function so that it takes and returns npu tensors
    (``name``: the torch_npu name, by default the function's; ``nz``: the arguments it
    takes in FRACTAL_NZ)."""
    name = name or function.__name__
    nz_arguments = frozenset(nz)
    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        from torch_npu.npu import graphs, task_groups

        if _formats.any_recorded():
            try:
                bound = signature.bind(*args, **kwargs)
            except TypeError:
                pass  # the function itself reports the bad call
            else:
                _formats.check_formats(name, bound.arguments.items(), nz_arguments)

        if task_groups._pending_update() is not None and graphs._touches_npu((args, kwargs)):
            # Inside graph_task_update_begin/_end a call re-issues a captured task.
            return task_groups._issue_in_update(name, args, kwargs)
        capture = graphs._capturing_graph()
        if capture is not None and graphs._touches_npu((args, kwargs)):
            return capture._record_call(
                lambda *a, **k: call_on_host(function, name, a, k), name, args, kwargs)
        return call_on_host(function, name, args, kwargs)

    return wrapper
