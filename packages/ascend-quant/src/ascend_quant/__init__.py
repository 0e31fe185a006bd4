"""ascend-quant: quantized checkpoints (compressed-tensors, msModelSlim) for vLLM on Ascend.

``register()`` fills ascend-core's registries: every scheme under its name in
``QUANT_SCHEMES`` (MoE expert schemes as ``moe:<name>``) and the vLLM quantization
config classes, by dotted path, in ``QUANT_CONFIGS``. Called inside a vLLM process whose
platform is one of the plugin's, it also registers those config classes with vLLM, so
compressed-tensors checkpoints and msModelSlim (``ascend``) checkpoints load through
this package's schemes.
"""

from __future__ import annotations

import sys

from ascend_quant.__about__ import __version__

__all__ = ["__version__", "register"]

CONFIG_HOOK_NAME = "msmodelslim-detection"

CONFIG_CLASSES = {
    "compressed-tensors": "ascend_quant.vllm.config.AscendCompressedTensorsConfig",
    "ascend": "ascend_quant.vllm.config.AscendModelSlimConfig",
}


def register() -> None:
    """Register this package's implementations (idempotent; imports no vLLM itself)."""
    from ascend_core.registry import QUANT_CONFIGS, QUANT_SCHEMES
    from ascend_quant.lookup import MOE_PREFIX
    from ascend_quant.schemes import LINEAR_SCHEMES, MOE_SCHEMES

    for scheme in LINEAR_SCHEMES:
        QUANT_SCHEMES.register(scheme.name, scheme)
    for scheme in MOE_SCHEMES:
        QUANT_SCHEMES.register(MOE_PREFIX + scheme.name, scheme)
    for method, path in CONFIG_CLASSES.items():
        QUANT_CONFIGS.register(method, path)
    _register_config_hook()
    if "vllm" in sys.modules:
        # Only a process that already runs vLLM registers with it (vLLM calls this from
        # the plugin's general entry point); nothing here imports vLLM on its own.
        from ascend_quant.vllm.register import register_if_platform_active

        register_if_platform_active()


def _register_config_hook() -> None:
    """Detecting msModelSlim folders: the platforms run core's CONFIG_HOOKS first thing in
    ``check_and_update_config``."""
    from ascend_core.registry import CONFIG_HOOKS
    from ascend_quant.hooks import select_checkpoint_quantization

    CONFIG_HOOKS.register(CONFIG_HOOK_NAME, select_checkpoint_quantization)
