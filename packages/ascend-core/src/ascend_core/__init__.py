"""Core of the vLLM Ascend plugin.

Platforms (npu and host), ``AscendConfig`` (vLLM's ``additional_config``), the
``VLLM_ASCEND_*`` environment registry, workers and model runners, custom-op
registration and the extension registries that the leaf packages fill.

Importing this package imports no vLLM; the vLLM-facing modules live under
``ascend_core.platform`` and ``ascend_core.worker``.
"""

from ascend_core.__about__ import __version__

__all__ = ["__version__"]
