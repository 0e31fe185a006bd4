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

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        cls.log_activation(vllm.__version__)
        cls.run_config_hooks(vllm_config)
        init_ascend_config(vllm_config.additional_config, target="host")
        envs.warn_removed()
        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = HOST_WORKER
        super().check_and_update_config(vllm_config)

        from ascend_core.ops.vllm_custom_ops import enable_in_compilation_config, register
        register()
        enable_in_compilation_config(vllm_config.compilation_config)
