"""vLLM's Ray executor on both targets.

The platforms put ``AscendRayExecutor`` in place of ``distributed_executor_backend="ray"``.
It is vLLM's own (``RayExecutorV2``: workers as Ray actors in a placement group of one
``{ray_device_key: 1}`` bundle each, commands over vLLM's message queues) with these
changes:

- start-up checks (``ray_checks``): a cluster with fewer devices than workers fails at once
  with the numbers (vLLM would wait for the placement group forever), and a worker whose
  node has another vLLM or plugin version or other model files than the engine's node stops
  the start with both values;
- on the host target (``ray_device_key`` ``CPU``; npu keeps vLLM's path with ``NPU``):
  vLLM asks Ray for the key again on the worker actor (``resources={key: n}``) and for the
  actor's accelerator ids, and Ray takes ``CPU`` only through ``num_cpus`` and lists no ids
  for it. The worker actor asks nothing more (its bundle already holds its CPU) and reports
  no device ids (a host worker has none: its threads are bound through
  ``VLLM_CPU_OMP_THREADS_BIND`` by local rank, as under ``mp``);
- workers go to the placement group's first ``world_size`` bundles only. vLLM finds worker
  bundles by the device key, and under ``--data-parallel-backend ray`` each rank's group ends
  with the engine's own bundle, which holds ``CPU``: counted as a worker's on the host
  target, the executor would wait for a worker that never comes.
"""

from __future__ import annotations

import json
import os
from unittest import mock

import ray
from vllm.platforms import current_platform
from vllm.v1.executor import ray_executor_v2
from vllm.v1.executor.ray_utils import get_bundles_sorted_by_node as vllm_bundles_by_node

from ascend_core.distributed.ray_checks import (
    DRIVER_FACTS_VAR,
    disagreement,
    node_facts,
    shortage_message,
)


class AscendRayWorkerProc(ray_executor_v2.RayWorkerProc):
    """vLLM's Ray worker, checking its node against the engine's before it loads anything."""

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        model = self._init_kwargs["vllm_config"].model_config.model
        engine = json.loads(os.environ.get(DRIVER_FACTS_VAR, "{}"))
        problem = disagreement(engine, node_facts(model), node=ray.util.get_node_ip_address(),
                               model=model)
        if problem:
            raise RuntimeError(problem)
        if current_platform.ray_device_key == "CPU":
            return ray.get_runtime_context().get_node_id(), []
        return super().get_node_and_physical_gpu_ids()


class AscendRayExecutor(ray_executor_v2.RayExecutorV2):
    """vLLM's Ray executor (V2) with the plugin's checks and the host target's ``CPU``."""

    @staticmethod
    def _get_actor_resource_kwargs() -> dict:
        if current_platform.ray_device_key == "CPU":
            return {"num_gpus": 0}  # the bundle holds the CPU; Ray refuses it in resources=
        return ray_executor_v2.RayExecutorV2._get_actor_resource_kwargs()

    def _build_runtime_env(self) -> dict:
        runtime_env = super()._build_runtime_env()
        env_vars = runtime_env.setdefault("env_vars", {})
        # The workers' platform is the engine's from their first line (vLLM hands them the
        # engine's environment only after placing them, and a platform resolved before
        # that would be stock vLLM's), whatever a node's own environment says.
        env_vars["VLLM_ASCEND_TARGET"] = current_platform.ascend_target
        env_vars[DRIVER_FACTS_VAR] = json.dumps(node_facts(self.vllm_config.model_config.model))
        return runtime_env

    def _init_executor(self) -> None:
        parallel_config = self.parallel_config
        if parallel_config.placement_group is None:  # vLLM makes one: are there devices?
            if not ray.is_initialized():
                ray.init(address=None, runtime_env=parallel_config.ray_runtime_env)
            key = current_platform.ray_device_key
            problem = shortage_message(
                world_size=parallel_config.world_size,
                tensor_parallel=parallel_config.tensor_parallel_size,
                pipeline_parallel=parallel_config.pipeline_parallel_size,
                device_key=key, in_cluster=ray.cluster_resources().get(key, 0),
                address=ray.get_runtime_context().gcs_address)
            if problem:
                raise RuntimeError(problem)
        world_size = parallel_config.world_size

        def worker_bundles(placement_group) -> list:
            return [bundle for bundle in vllm_bundles_by_node(placement_group)
                    if bundle[0] < world_size]

        # vLLM's executor reads both names from its module when it places its workers.
        with mock.patch.multiple(ray_executor_v2, RayWorkerProc=AscendRayWorkerProc,
                                 get_bundles_sorted_by_node=worker_bundles):
            super()._init_executor()
