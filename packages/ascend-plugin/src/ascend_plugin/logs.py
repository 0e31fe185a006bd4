"""Show the ascend-* packages' logs the way vLLM shows its own.

The packages log through the standard ``logging`` module under their import
names; vLLM configures only its ``vllm`` logger. When the plugin is active, their
records go to the handlers the ``vllm`` logger has when they are emitted, at its
level, so a user sees one stream of logs. Looked up then, not copied once: vLLM
configures its logger after the plugins load in an LLM's own process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and again in each process it starts.
"""

from __future__ import annotations

import logging

PACKAGE_LOGGERS = ("ascend_kernels", "ascend_core", "ascend_quant", "ascend_specdec",
                   "ascend_eplb", "ascend_plugin")


class ToVllmHandlers(logging.Handler):
    """Hands each record at or above the ``vllm`` logger's level to that logger's handlers."""

    def emit(self, record: logging.LogRecord) -> None:
        vllm_logger = logging.getLogger("vllm")
        if record.levelno < vllm_logger.getEffectiveLevel():
            return
        for handler in vllm_logger.handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def share_vllm_log_handlers() -> None:
    for name in PACKAGE_LOGGERS:
        package_logger = logging.getLogger(name)
        if package_logger.handlers:
            continue  # configured by the user or by an earlier call
        package_logger.addHandler(ToVllmHandlers())
        package_logger.setLevel(logging.DEBUG)  # the handler applies vLLM's level
        package_logger.propagate = False
