"""The npu target's device communicator (``AscendPlatform.get_device_communicator_cls``)."""

from __future__ import annotations

from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)


class NPUCommunicator(DeviceCommunicatorBase):
    """Collectives between NPUs over HCCL.

    vLLM's base communicator runs all-reduce, all-gather, reduce-scatter, gather, send/recv
    and broadcast through ``torch.distributed`` on the group's ``device_group``; on the npu
    target that group's backend is HCCL (``AscendPlatform.dist_backend``), which torch_npu
    registers, so the base's collectives are the NPU's as they stand. Expert-parallel
    all-to-all (dispatch/combine for MoE) needs an HCCL all-to-all manager, which is later
    work; until then the base class answers for it.
    """
