"""Whether this machine can run the npu target, asked without raising.

``VLLM_ASCEND_TARGET=auto`` picks the npu target only when torch_npu imports and at least
one NPU is visible, so installing the plugin elsewhere never takes vLLM over. Imports no
vLLM.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def npu_is_visible() -> bool:
    """True if torch_npu imports and ``torch.npu.device_count() > 0``; False on any error."""
    try:
        import torch

        import torch_npu  # noqa: F401 - registers torch.npu

        count = torch.npu.device_count()
    # No torch_npu, no CANN, no driver: each surfaces as its own exception; all mean "no NPU".
    except Exception as error:  # noqa: BLE001
        logger.debug("No NPU: %s: %s", type(error).__name__, error)
        return False
    return count > 0
