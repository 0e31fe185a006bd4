"""What both Ascend platforms (npu and host) do the same way."""

from __future__ import annotations

import logging
import os

from ascend_core import envs
from ascend_core.distributed.ray_checks import require_ray
from ascend_core.registry import CONFIG_HOOKS, REQUEST_CHECKS
from ascend_core.suggest import did_you_mean

logger = logging.getLogger(__name__)

PUNICA_WRAPPER = "ascend_core.lora.punica.AscendPunicaWrapper"


class AscendPlatformMixin:
    """Mixed into AscendPlatform and AscendHostPlatform, before vLLM's base class."""

    ascend_target: str

    @classmethod
    def validate_environ(cls, hard_fail: bool) -> None:
        """vLLM's check of ``VLLM_*`` variables, knowing the plugin's own."""
        from vllm import envs as vllm_envs

        ours = set(envs.VARIABLES) | set(envs.REMOVED)
        for name in os.environ:
            if not name.startswith("VLLM_") or name in vllm_envs.environment_variables:
                continue
            if name in ours:
                continue
            hint = did_you_mean(name, ours) if name.startswith(envs.PREFIX) else ""
            message = f"Unknown vLLM environment variable detected: {name}.{hint}"
            if hard_fail:
                raise ValueError(message)
            logger.warning(message)

    @classmethod
    def refuse_hybrid_speculation_with_prefix_caching(cls, vllm_config) -> None:
        """Speculative decoding on a hybrid model (gated delta-net / mamba layers beside
        attention) with prefix caching: vLLM then keeps the layers' states in its "align"
        cache mode, whose per-step state copies are raw-address Triton kernels
        (``precopy_mamba_align_fused_kernel``, ``postprocess_mamba_fused_kernel``) that run
        on neither target: stop at start-up, not at the first verified step."""
        model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
        if (model_config is None or not model_config.is_hybrid
                or vllm_config.speculative_config is None
                or not cache_config.enable_prefix_caching):
            return
        raise ValueError(
            f"speculative_config method={vllm_config.speculative_config.method!r} on the "
            f"hybrid model {model_config.architecture} with prefix caching on: vLLM's state "
            "copies for that (mamba_cache_mode 'align') are GPU Triton kernels the "
            f"{cls.ascend_target} target does not run; start with --no-enable-prefix-caching "
            "(enable_prefix_caching=False), or without speculative_config")

    @classmethod
    def get_punica_wrapper(cls) -> str:
        """Multi-LoRA batches on the plugin's LoRA kernels (``ascend_kernels.lora``)."""
        return PUNICA_WRAPPER

    @classmethod
    def use_ascend_ray_executor(cls, parallel_config) -> None:
        """``distributed_executor_backend="ray"`` runs vLLM's Ray executor with the plugin's
        checks (``ascend_core.distributed.ray_executor``); Ray asked for but not installed
        stops here with one line."""
        require_ray(parallel_config)
        if parallel_config.distributed_executor_backend == "ray":
            from ascend_core.distributed.ray_executor import AscendRayExecutor

            parallel_config.distributed_executor_backend = AscendRayExecutor

    @classmethod
    def run_config_hooks(cls, vllm_config) -> None:
        """The leaf packages' hooks (core's CONFIG_HOOKS), in name order."""
        for name in CONFIG_HOOKS:
            CONFIG_HOOKS.get(name)(vllm_config)

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """vLLM's per-request check, then the leaf packages' (core's REQUEST_CHECKS)."""
        super().validate_request(processed_inputs, params)
        for name in REQUEST_CHECKS:
            REQUEST_CHECKS.get(name)(params)

    @classmethod
    def log_activation(cls, vllm_version: str) -> None:
        logger.info("Ascend plugin active: %s target (%s) on vLLM %s", cls.ascend_target,
                    cls.__name__, vllm_version)
