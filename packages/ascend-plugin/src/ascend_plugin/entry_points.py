"""vLLM's entry points for the plugin (declared only in this package).

``platform_plugin`` tells vLLM which platform to use; ``general_plugin`` runs in
every vLLM process and fills ascend-core's registries from the leaf packages.
vLLM swallows exceptions raised while it probes platform plugins, so every
start-up error (bad target, missing torch_npu, unsupported vLLM) is raised from
``general_plugin``, which vLLM does not guard.
"""

from __future__ import annotations

import logging

from ascend_core import envs
from ascend_core.platform.detect import npu_is_visible

logger = logging.getLogger(__name__)

NPU_PLATFORM = "ascend_core.platform.npu.AscendPlatform"
HOST_PLATFORM = "ascend_core.platform.host.AscendHostPlatform"


class AscendTargetError(RuntimeError):
    pass


def active_target() -> str | None:
    """``"npu"``, ``"host"`` or None (plugin inactive), from VLLM_ASCEND_TARGET."""
    target = envs.VLLM_ASCEND_TARGET
    if target == "host":
        return "host"
    if target == "npu":
        if not npu_is_visible():
            raise AscendTargetError(
                "VLLM_ASCEND_TARGET=npu, but torch_npu does not import or sees no NPU. "
                "Install `ascend-plugin[npu]` with CANN on an Ascend machine, or set "
                "VLLM_ASCEND_TARGET=host to run the plugin on the CPU (or auto to leave "
                "vLLM alone where there is no NPU)."
            )
        return "npu"
    return "npu" if npu_is_visible() else None


def platform_plugin() -> str | None:
    try:
        target = active_target()
    except (envs.EnvVarError, AscendTargetError) as err:
        # Raised again by general_plugin; here vLLM would only log it at debug level.
        logger.error("ascend platform plugin: cannot select a target: %s", err)
        return None
    except Exception:
        logger.exception("ascend platform plugin: cannot select a target")
        return None
    if target is None:
        return None
    from ascend_plugin.vllm_version import check_vllm_version

    try:
        check_vllm_version()
    except Exception as err:
        logger.error("%s", err)
        return None
    return NPU_PLATFORM if target == "npu" else HOST_PLATFORM


def general_plugin() -> None:
    from ascend_plugin.vllm_version import check_vllm_version

    target = active_target()
    if target is not None:
        from ascend_plugin.logs import share_vllm_log_handlers

        share_vllm_log_handlers()
        check_vllm_version()
    register_all()
    if target is not None:
        from ascend_core.distributed.kv_transfer.vllm_registration import (
            register_kv_connectors,
        )
        from ascend_core.ops.vllm_custom_ops import register_with_vllm

        register_with_vllm()
        register_kv_connectors()


def register_all() -> None:
    """Fill ascend-core's registries from every leaf package (idempotent)."""
    import ascend_eplb
    import ascend_quant
    import ascend_specdec

    for package in (ascend_quant, ascend_specdec, ascend_eplb):
        package.register()
