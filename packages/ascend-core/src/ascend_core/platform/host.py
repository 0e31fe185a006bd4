"""The host target: the plugin stack on a CPU through vLLM's CPU backend.

For vLLM this stays a CPU platform (``is_cpu()`` is true), so vLLM's CPU
attention, kernels and executor apply; what the plugin owns (configuration,
registries, worker and model runner, custom ops, proposers, quant schemes, EPLB)
is the same code as on the npu target.
"""

from __future__ import annotations

import logging

import vllm
from vllm.platforms.cpu import CpuPlatform

from ascend_core import envs
from ascend_core.config import init_ascend_config
from ascend_core.platform.common import AscendPlatformMixin

logger = logging.getLogger(__name__)

HOST_WORKER = "ascend_core.worker.host_worker.AscendHostWorker"


class AscendHostPlatform(AscendPlatformMixin, CpuPlatform):
    ascend_target = "host"
    # Ray places a host worker on one of a node's CPUs (``ray start --num-cpus N``); vLLM's
    # CPU platform has no key and refuses Ray. See ascend_core.distributed.ray_executor.
    ray_device_key: str = "CPU"

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        cls.log_activation(vllm.__version__)
        cls.run_config_hooks(vllm_config)
        init_ascend_config(vllm_config.additional_config, target="host")
        cls.refuse_hybrid_speculation_with_prefix_caching(vllm_config)
        envs.warn_removed()
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = HOST_WORKER
        cls.use_ascend_ray_executor(parallel_config)
        use_reference_mla_for_float32(vllm_config)
        super().check_and_update_config(vllm_config)

        from ascend_core.ops.vllm_custom_ops import enable_in_compilation_config, register
        register()
        enable_in_compilation_config(vllm_config.compilation_config)


def use_reference_mla_for_float32(vllm_config) -> bool:
    """Pick vLLM's reference CPU MLA backend for a float32 MLA model on a CPU with AMX.

    vLLM's CPU platform prefers its AMX MLA backend wherever the CPU has AMX tiles, but that
    backend packs bfloat16 / float16 weights only: a float32 DeepSeek model fails at load
    ("expect weight to be bfloat16, float16, int8, ..." from ``convert_weight_packed``).
    The reference backend takes float32. A backend the user chose is left alone. Returns
    whether it chose.
    """
    import torch
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    model_config = vllm_config.model_config
    attention_config = vllm_config.attention_config
    if (model_config is None or not getattr(model_config, "use_mla", False)
            or model_config.dtype != torch.float32 or attention_config.backend is not None
            or not torch.cpu._is_amx_tile_supported()):
        return False
    attention_config.backend = AttentionBackendEnum.CPU_MLA
    logger.info("float32 MLA model on an AMX CPU: vLLM's CPU_MLA attention backend "
                "(its AMX_MLA backend takes bfloat16 / float16 only)")
    return True
