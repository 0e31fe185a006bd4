"""The npu target's worker: vLLM's GPU worker with its device set up through torch_npu.

Written so far: device initialisation. ``init_device`` selects the worker's NPU
(``torch.npu.set_device``), brings up the distributed environment over HCCL with vLLM's
``init_worker_distributed_environment``, seeds the generators and takes a memory snapshot
with ``torch.npu.mem_get_info``, refusing to start when the NPU has less free memory than
``gpu_memory_utilization`` asks for.

Not written yet (a later issue): the NPU model runner, ACL graph capture, KV-cache memory
profiling and data parallelism within a node. ``init_device`` therefore stops with a
``NotImplementedError`` naming the missing model runner once the device is up.
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass

import torch
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

from ascend_core.config import init_ascend_config
from ascend_core.platform.npu import AscendPlatform


@dataclass(frozen=True)
class NPUMemorySnapshot:
    """Memory of one NPU at one moment, in bytes, read through ``torch.npu``."""

    free_memory: int
    total_memory: int
    torch_allocated: int
    torch_reserved: int

    @classmethod
    def measure(cls, device: torch.device) -> NPUMemorySnapshot:
        free, total = torch.npu.mem_get_info(device)
        return cls(
            free_memory=free,
            total_memory=total,
            torch_allocated=torch.npu.memory_allocated(device),
            torch_reserved=torch.npu.memory_reserved(device),
        )


class NPUWorker(Worker):
    def __init__(self, vllm_config, *args, **kwargs):
        # Workers run in their own processes: parse additional_config here too.
        init_ascend_config(vllm_config.additional_config, target="npu")
        super().__init__(vllm_config, *args, **kwargs)

    def init_device(self) -> None:
        self.init_npu_device()
        self._init_workspace_and_model_runner()

    def init_npu_device(self) -> None:
        """Select the NPU, join the HCCL groups, seed, and snapshot the NPU's memory."""
        if self.parallel_config.data_parallel_size > 1:
            raise NotImplementedError(
                "The npu worker does not place data-parallel ranks on NPUs yet "
                f"(data_parallel_size={self.parallel_config.data_parallel_size}); "
                "run with data_parallel_size=1."
            )
        visible_index = AscendPlatform.logical_device_id_to_visible_device_id(self.local_rank)
        self.device = torch.device(AscendPlatform.device_type, visible_index)
        AscendPlatform.set_device(self.device)
        if self.model_config is not None:
            AscendPlatform.check_if_supports_dtype(self.model_config.dtype)

        # HCCL's buffers are allocated here, so the snapshot below comes after.
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            AscendPlatform.dist_backend,
        )
        if self.model_config is not None:
            set_random_seed(self.model_config.seed)
            # set_random_seed seeds the NPU through the current platform, which is this
            # one in a vLLM process; seeding here too keeps that true when it is not.
            if self.model_config.seed is not None:
                AscendPlatform.manual_seed_all(self.model_config.seed)

        gc.collect()
        AscendPlatform.empty_cache()
        self.init_npu_snapshot = NPUMemorySnapshot.measure(self.device)
        self.requested_memory = self._requested_memory(self.init_npu_snapshot)

    def _requested_memory(self, snapshot: NPUMemorySnapshot) -> int:
        utilization = self.cache_config.gpu_memory_utilization
        requested = math.ceil(snapshot.total_memory * utilization)
        if snapshot.free_memory < requested:
            raise ValueError(
                f"Free memory on {self.device} ({snapshot.free_memory} of "
                f"{snapshot.total_memory} bytes) is less than gpu_memory_utilization="
                f"{utilization} asks for ({requested} bytes). Lower gpu_memory_utilization "
                "or free the NPU from other processes."
            )
        return requested

    def _init_workspace_and_model_runner(self) -> None:
        raise NotImplementedError(
            f"{self.device} is initialised, but the npu target has no model runner yet "
            "(ascend_core.worker.npu_model_runner is a later issue); the npu target cannot "
            "load or run a model. Use VLLM_ASCEND_TARGET=host meanwhile."
        )
