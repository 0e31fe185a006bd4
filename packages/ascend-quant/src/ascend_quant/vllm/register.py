"""Registering ascend-quant's quantization configs with vLLM."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def plugin_platform_active() -> bool:
    """True when vLLM's current platform is one of the plugin's (npu or host target)."""
    from ascend_core.platform import active_target

    return active_target() is not None


def register_with_vllm() -> None:
    """Make vLLM build our configs for ``compressed-tensors`` and ``ascend`` checkpoints.

    vLLM looks custom methods up after its built-in ones, so registering under
    ``compressed-tensors`` replaces its own config class in this process.
    """
    from vllm.model_executor.layers.quantization import register_quantization_config

    from ascend_quant.vllm.config import AscendCompressedTensorsConfig, AscendModelSlimConfig

    register_quantization_config("compressed-tensors")(AscendCompressedTensorsConfig)
    register_quantization_config("ascend")(AscendModelSlimConfig)


def register_if_platform_active() -> bool:
    """Register with vLLM only when the plugin's platform runs; stock vLLM (plugin
    installed but inactive) keeps its own compressed-tensors support."""
    if not plugin_platform_active():
        return False
    register_with_vllm()
    logger.debug("ascend-quant: compressed-tensors and ascend (msModelSlim) configs "
                 "registered with vLLM")
    return True
