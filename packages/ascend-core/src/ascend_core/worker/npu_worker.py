"""The npu target's worker: vLLM's GPU worker with its device set up through torch_npu.

``init_device`` checks that this node shows enough NPUs for the parallel layout, selects
the worker's NPU (``torch.npu.set_device``), brings up the distributed environment over
HCCL with vLLM's ``init_worker_distributed_environment``, seeds the generators, takes a
memory snapshot with ``torch.npu.mem_get_info`` (refusing to start when the NPU has less
free memory than ``gpu_memory_utilization`` asks for) and builds the
``NPUModelRunner``.

``determine_available_memory`` sizes the KV cache from ``torch.npu``'s memory numbers: the
drop in free memory from the start-up snapshot to the end of a profiling run (weights and
memory held outside torch) plus the profiling run's transient peak
(``max_memory_allocated`` over what stays allocated) are taken from the requested memory.

Sleep mode (``enable_sleep_mode``): vLLM's ``Worker.sleep`` / ``wake_up`` / ``discard`` run
unchanged over ``NPUSleepModeBackend``, whose pool (``ascend_core.worker.npu_sleep``) tags
the storages allocated while vLLM loads the weights and allocates the KV cache, releases
their NPU memory at sleep (weights to pinned host memory at level 1) and restores it at
wake-up. Restored memory sits at other device addresses, so captured NPU graphs are dropped
at sleep and captured again once every tag is awake.

Not done yet: data parallelism within a node.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import vllm.v1.worker.gpu_worker as gpu_worker_module
from vllm.compilation.cuda_graph import CUDAGraphWrapper
from vllm.config import set_current_vllm_config
from vllm.device_allocator.sleep_mode_backend import SleepModeBackend
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment

from ascend_core.config import get_ascend_config, init_ascend_config
from ascend_core.platform.npu import AscendPlatform
from ascend_core.worker.cpu_binding import bind_worker
from ascend_core.worker.npu_model_runner import NPUModelRunner, npu_device_names
from ascend_core.worker.npu_sleep import SLEEP_TAGS, NPUSleepPool
from ascend_core.worker.npu_trace_errors import explain_trace_failures

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class NPUMemoryProfile:
    """What a profiling run tells about the memory the KV cache may not use, in bytes."""

    consumed: int  # free memory at start-up minus free memory after profiling
    transient_peak: int  # the run's peak allocation above what stays allocated after it
    after: NPUMemorySnapshot

    @property
    def non_kv_cache_memory(self) -> int:
        return self.consumed + self.transient_peak


def profile_npu_memory(
    device: torch.device, baseline: NPUMemorySnapshot, run: Callable[[], None]
) -> NPUMemoryProfile:
    """Run ``run`` (a forward pass of the largest batch) and measure it with ``torch.npu``."""
    gc.collect()
    torch.npu.empty_cache()
    torch.npu.reset_peak_memory_stats(device)
    run()
    torch.npu.synchronize(device)
    peak = torch.npu.max_memory_allocated(device)
    gc.collect()
    torch.npu.empty_cache()
    after = NPUMemorySnapshot.measure(device)
    consumed = baseline.free_memory - after.free_memory
    if consumed < 0:
        raise RuntimeError(
            f"Free memory on {device} grew during profiling (from {baseline.free_memory} to "
            f"{after.free_memory} bytes): another process released NPU memory meanwhile, so "
            "the KV cache cannot be sized. Run vLLM on NPUs no other process uses, or pass "
            "kv_cache_memory_bytes."
        )
    return NPUMemoryProfile(
        consumed=consumed, transient_peak=max(peak - after.torch_allocated, 0), after=after
    )


def _no_cuda_kernel_warmup(worker, **kwargs) -> None:
    logger.debug("npu target: no CUDA kernel warm-up to run.")


def check_npus_for_layout(parallel_config, local_rank: int) -> int:
    """The number of NPUs this process sees; ValueError when the layout needs more."""
    visible = torch.npu.device_count()
    # Under the Ray executor a node holds the ranks Ray placed there (their NPU ids); else
    # every rank of the layout is on this node.
    assigned = getattr(parallel_config, "assigned_physical_gpu_ids", None)
    needed = len(assigned) if assigned else parallel_config.local_world_size
    if needed > visible or local_rank >= visible:
        layout = (f"tensor_parallel_size={parallel_config.tensor_parallel_size} x "
                  f"pipeline_parallel_size={parallel_config.pipeline_parallel_size}")
        shown = os.environ.get(AscendPlatform.device_control_env_var)
        raise ValueError(
            f"The parallel layout ({layout}) needs {needed} NPUs on this node and this worker "
            f"is local rank {local_rank}, but only {visible} NPU(s) are visible "
            f"({AscendPlatform.device_control_env_var}={shown!r}). Make {needed} NPUs visible "
            "or lower tensor_parallel_size / pipeline_parallel_size."
        )
    return visible


class NPUSleepModeBackend(SleepModeBackend):
    """vLLM's sleep-mode backend interface over the npu worker's ``NPUSleepPool``."""

    def __init__(self, pool: NPUSleepPool) -> None:
        super().__init__()
        self.pool = pool

    def suspend(self, level: int = 1) -> None:
        self.pool.sleep(level)
        self._state = "SUSPENDED"

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        self.pool.wake_up(tags)
        self._state = "SUSPENDED" if self.pool.asleep_tags else "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        self.pool.discard(tags)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True  # HCCL's buffers are not in the pool


# Names of model_config.sleep_mode_backend the npu worker serves with NPUSleepModeBackend:
# vLLM's default ("cumem", which means "the platform's allocator pool") and our own.
NPU_SLEEP_BACKEND_NAMES = ("cumem", "npu")


def captured_graph_count() -> int:
    """NPU graphs vLLM's graph wrappers hold in this process."""
    return sum(entry.cudagraph is not None
               for wrapper in list(CUDAGraphWrapper._all_instances)
               for entry in wrapper.concrete_cudagraph_entries.values())


class NPUWorker(Worker):
    def __init__(self, vllm_config, *args, **kwargs):
        # Workers run in their own processes: parse additional_config here too.
        init_ascend_config(vllm_config.additional_config, target="npu")
        self.sleep_pool = NPUSleepPool()
        self._recapture_graphs_on_wake = False
        super().__init__(vllm_config, *args, **kwargs)
        if self.use_v2_model_runner:
            raise ValueError(
                "The npu target runs vLLM's V1 model runner (NPUModelRunner); unset "
                "VLLM_USE_V2_MODEL_RUNNER or set it to 0."
            )

    def init_device(self) -> None:
        self.init_npu_device()
        self._init_workspace_and_model_runner()

    def init_npu_device(self) -> None:
        """Select the NPU, join the HCCL groups, seed, and snapshot the NPU's memory."""
        # Data-parallel engines: vLLM assigns each its NPUs (assigned_physical_gpu_ids), so
        # local rank 0 of DP rank 1 is that rank's first NPU.
        check_npus_for_layout(self.parallel_config, self.local_rank)
        if get_ascend_config().enable_cpu_binding:  # before HCCL starts its threads
            bind_worker(self.local_rank, self.parallel_config.local_world_size)
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
        # vLLM's Worker reads free_memory / total_memory of init_snapshot in its logs.
        self.init_snapshot = self.init_npu_snapshot
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
        with npu_device_names():
            super()._init_workspace_and_model_runner()

    def _make_model_runner(self) -> NPUModelRunner:
        return NPUModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        # With sleep mode, the weights and the KV cache are tagged in the sleep pool; other
        # contexts (workspace, runtime) stay resident. Allocation itself is always the NPU
        # caching allocator's.
        if self.model_config.enable_sleep_mode and tag in SLEEP_TAGS:
            return self.sleep_pool.allocating(tag)
        return contextlib.nullcontext()

    def load_model(self, *args, **kwargs) -> None:
        with npu_device_names():
            super().load_model(*args, **kwargs)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        """Bytes the KV cache may take: the requested memory less the profiled rest."""
        run = self._profile_run
        if kv_cache_memory_bytes := self.cache_config.kv_cache_memory_bytes:
            run()  # still run the largest batch once, as vLLM does
            logger.info("KV cache: %d bytes, as kv_cache_memory_bytes asks (not profiled).",
                        kv_cache_memory_bytes)
            return kv_cache_memory_bytes

        profile = profile_npu_memory(self.device, self.init_npu_snapshot, run)
        available = self.requested_memory - profile.non_kv_cache_memory
        self.total_consumed = profile.consumed
        self.peak_activation_memory = profile.transient_peak
        self.available_kv_cache_memory_bytes = available
        logger.info(
            "npu memory: %d bytes requested (gpu_memory_utilization=%s of %d), %d consumed by "
            "weights and runtime, %d peak activations; %d bytes for the KV cache.",
            self.requested_memory, self.cache_config.gpu_memory_utilization,
            self.init_npu_snapshot.total_memory, profile.consumed, profile.transient_peak,
            available)
        if available <= 0:
            raise ValueError(
                f"No NPU memory is left for the KV cache on {self.device}: "
                f"gpu_memory_utilization={self.cache_config.gpu_memory_utilization} requests "
                f"{self.requested_memory} bytes, and the model takes {profile.consumed} bytes "
                f"(weights and runtime) plus {profile.transient_peak} bytes of activations at "
                "its largest batch. Raise gpu_memory_utilization, or lower "
                "max_num_batched_tokens / max_model_len."
            )
        return available

    def _profile_run(self) -> None:
        with (set_current_vllm_config(self.vllm_config),
              explain_trace_failures(self.vllm_config, "profiling run")):
            self.model_runner.profile_run(randomize_inputs=self.randomize_dummy_inputs)

    def compile_or_warm_up_model(self):
        # vLLM's kernel_warmup tunes CUDA/ROCm kernels (Triton, DeepGEMM, FlashInfer, ...),
        # none of which the npu target runs; the rest of the warm-up (the graph capture
        # hook, the sampler's largest batch, reseeding) is vLLM's.
        original = gpu_worker_module.kernel_warmup
        gpu_worker_module.kernel_warmup = _no_cuda_kernel_warmup
        try:
            with npu_device_names(), explain_trace_failures(self.vllm_config, "warm-up"):
                return super().compile_or_warm_up_model()
        finally:
            gpu_worker_module.kernel_warmup = original

    def initialize_from_config(self, kv_cache_config) -> None:
        with npu_device_names():
            super().initialize_from_config(kv_cache_config)

    # --- sleep mode ------------------------------------------------------------------------

    @property
    def sleep_mode_backend(self) -> NPUSleepModeBackend:
        if self._sleep_mode_backend is None:
            name = self.model_config.sleep_mode_backend
            if name not in NPU_SLEEP_BACKEND_NAMES:
                raise ValueError(
                    f"sleep_mode_backend={name!r} is not available on the npu target; it "
                    f"offers {list(NPU_SLEEP_BACKEND_NAMES)} (both the npu worker's pool).")
            self._sleep_mode_backend = NPUSleepModeBackend(self.sleep_pool)
        return self._sleep_mode_backend

    def _check_sleep_mode(self) -> None:
        if not self.model_config.enable_sleep_mode:
            raise RuntimeError(
                "Sleep mode is off for this engine: nothing was tagged when the weights and "
                "the KV cache were allocated. Start it with enable_sleep_mode=True.")

    def sleep(self, level: int = 1) -> None:
        """Release the weights' and the KV cache's NPU memory (vLLM's ``Worker.sleep``)."""
        self._check_sleep_mode()
        self.sleep_pool.check_can_sleep(level)  # before vLLM saves buffers or graphs go
        self._drop_graphs()
        with npu_device_names():
            super().sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore ``tags`` (vLLM's ``Worker.wake_up``); graphs are captured again once all
        tags are awake."""
        self._check_sleep_mode()
        with npu_device_names():
            super().wake_up(tags)
        if self._recapture_graphs_on_wake and not self.sleep_pool.asleep_tags:
            self._recapture_graphs_on_wake = False
            self.model_runner.capture_model()
            logger.info("npu wake-up: captured %d NPU graphs again.", captured_graph_count())

    def discard(self, tags: tuple[str, ...]) -> None:
        self._check_sleep_mode()
        self._drop_graphs()
        with npu_device_names():
            super().discard(tags)

    def reload_weights(self, *args, **kwargs) -> None:
        # After a level-2 sleep: the weights' storages are back (zeroed) and load in place.
        with npu_device_names():
            super().reload_weights(*args, **kwargs)

    def _drop_graphs(self) -> None:
        """Captured graphs hold the device addresses of memory about to be released: drop
        them (their pool goes with them) and capture them again at wake-up."""
        if captured_graph_count():
            CUDAGraphWrapper.clear_all_graphs()
            self._recapture_graphs_on_wake = True

    def npu_memory_report(self) -> dict[str, int]:
        """This worker's NPU memory and sleep-pool numbers, in bytes (for collective_rpc)."""
        free, total = torch.npu.mem_get_info(self.device)
        report = {
            "memory_allocated": torch.npu.memory_allocated(self.device),
            "memory_reserved": torch.npu.memory_reserved(self.device),
            "free_memory": free,
            "total_memory": total,
            "host_copy_bytes": self.sleep_pool.host_bytes,
            "captured_graphs": captured_graph_count(),
        }
        for tag in SLEEP_TAGS:
            report[f"{tag}_resident_bytes"] = self.sleep_pool.resident_bytes(tag)
            report[f"{tag}_asleep_bytes"] = self.sleep_pool.asleep_bytes(tag)
        return report
