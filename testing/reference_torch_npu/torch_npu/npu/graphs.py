"""NPU graphs of the reference ``torch.npu`` (capture and replay): not yet modelled."""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

DEVICE_TYPE = "npu"


def _capturing_graph():
    """The graph being captured on this thread, or None."""
    return None


def _touches_npu(tree) -> bool:
    return any(isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE
               for x in pytree.tree_leaves(tree))
