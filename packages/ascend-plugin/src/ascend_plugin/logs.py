"""Show the ascend-* packages' logs the way vLLM shows its own.

The packages log through the standard ``logging`` module under their import
names; vLLM configures only its ``vllm`` logger. When the plugin is active, its
loggers reuse vLLM's handlers and level, so a user sees one stream of logs.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGERS = ("ascend_kernels", "ascend_core", "ascend_quant", "ascend_specdec",
                   "ascend_eplb", "ascend_plugin")


def share_vllm_log_handlers() -> None:
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    for name in PACKAGE_LOGGERS:
        package_logger = logging.getLogger(name)
        if package_logger.handlers:
            continue  # configured by the user or by an earlier call
        for handler in vllm_logger.handlers:
            package_logger.addHandler(handler)
        package_logger.setLevel(vllm_logger.level)
        package_logger.propagate = False
