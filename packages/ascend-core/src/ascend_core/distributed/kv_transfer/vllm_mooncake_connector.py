"""``MooncakeConnectorV1``: vLLM's KV connector API over ``pull.py``'s protocol.

Scheduler side (in the engine core): a prefill request sent with
``kv_transfer_params: {"do_remote_decode": true}`` keeps its blocks when it finishes
and returns where to pull them from; a decode request sent with those parameters
waits (``WAITING_FOR_REMOTE_KVS``) while its worker pulls, then computes only its last
prompt token. Worker side: registers the KV caches with the transfer engine, serves
leases (prefill) and pulls in a background thread (decode); a failed pull marks the
request's blocks as load errors, so vLLM recomputes them (``kv_load_failure_policy``
``recompute``) or fails the request (``fail``), never reading a half-written cache.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ascend_core.distributed.kv_transfer.layout import describe_kv_caches, memory_regions
from ascend_core.distributed.kv_transfer.leases import LeaseTable, prompt_digest
from ascend_core.distributed.kv_transfer.params import (
    KVTransferParamsError,
    check_parallel_sizes,
    check_role,
    parse_options,
    parse_remote_prefill,
    remote_prefill_params,
)
from ascend_core.distributed.kv_transfer.pull import DecodeSide, PrefillSide, PullTask
from ascend_core.distributed.kv_transfer.side_channel import SideChannelServer
from ascend_core.distributed.kv_transfer.transfer_engine import MooncakeEngine

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

PRODUCERS = ("kv_producer", "kv_both")
CONSUMERS = ("kv_consumer", "kv_both")


@dataclass
class MooncakeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    pulls: list[PullTask] = field(default_factory=list)  # decode: blocks to fill
    # prefill: request id -> (blocks kept, prompt_digest of the prompt they hold)
    leases: dict[str, tuple[list[int], str | None]] = field(default_factory=dict)
    # prefill: requests being prefilled for a decode node (a claim for one waits), and
    # those of them that ended without a lease (request id -> why)
    expected: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)


@dataclass
class MooncakeTransferStats(KVConnectorStats):
    """Counts since the last report, summed over workers."""

    def __post_init__(self):
        for key in _STAT_KEYS:
            self.data.setdefault(key, 0)

    def reset(self):
        self.data = dict.fromkeys(_STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key in _STAT_KEYS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


_STAT_KEYS = ("pulls", "failed_pulls", "pulled_bytes", "pull_seconds", "expired_leases")


class MooncakePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        from vllm.v1.metrics.utils import create_metric_per_engine

        docs = {
            "pulls": "Requests whose KV blocks this decode node pulled from a prefill node.",
            "failed_pulls": "Pulls that failed; their blocks were recomputed or the request "
                            "failed (kv_load_failure_policy).",
            "pulled_bytes": "Bytes of KV cache pulled from prefill nodes.",
            "pull_seconds": "Seconds the pulls took (claim, reads, release), summed.",
            "expired_leases": "Requests whose kept KV blocks this prefill node freed because "
                              "no decode node pulled them within lease_timeout_s.",
        }
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(name=f"vllm:ascend_pd_{key}", documentation=doc,
                                  labelnames=labelnames),
                per_engine_labelvalues)
            for key, doc in docs.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, counter in self.counters.items():
            value = transfer_stats_data.get(key, 0)
            if value:
                counter[engine_idx].inc(value)


def _default_protocol() -> str:
    from ascend_core.platform import active_target

    return "ascend" if active_target() == "npu" else "tcp"


class MooncakeConnectorV1(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        config = vllm_config.kv_transfer_config
        self.kv_role = check_role(config.kv_role)
        self.options = parse_options(config.kv_connector_extra_config, _default_protocol())
        parallel = vllm_config.parallel_config
        check_parallel_sizes(self.options, self.kv_role, tp_size=parallel.tensor_parallel_size,
                             dp_size=parallel.data_parallel_size)
        from vllm.utils.network_utils import get_ip

        self.engine_id = config.engine_id
        self.host = get_ip()
        self.kv_port = config.kv_port
        self.block_size = vllm_config.cache_config.block_size
        self.tp_size = parallel.tensor_parallel_size
        self.world_size = parallel.world_size
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = _SchedulerSide(self)
            self._worker = None
        else:
            self._scheduler = None
            self._worker = _WorkerSide(self, kv_cache_config)

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int):
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]):
        return self._scheduler.request_finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks arrive, in every group.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the step's forward (vLLM starts async loads after it): a decode node may
        # already be claiming a lease that this metadata registers.
        self._worker.register(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker.start(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole requests are pulled before they are scheduled

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs) -> None:
        return  # pull design: the prefill node keeps its blocks, nothing is pushed

    def wait_for_save(self):
        return

    def get_finished(self, finished_req_ids: set[str]):
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.take_stats() if self._worker is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None):
        return MooncakeTransferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames,
                           per_engine_labelvalues):
        return MooncakePromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def shutdown(self):
        if self._worker is not None:
            self._worker.shutdown()


def _idle_step_pause_s(world_size: int, cores: int | None = None) -> float:
    """How long the engine waits before a step that follows an empty one.

    While a prefill node holds blocks for decode nodes, or a decode node waits for its
    pulls, vLLM's engine keeps stepping with nothing to compute. With one process per
    rank, each step wakes every worker, and a worker woken within vLLM's busy-loop
    window (``SpinCondition``'s ``busy_loop_s``, 1 s) spins on ``sched_yield`` instead
    of sleeping. Where each rank has a core to spin on beside the one its side channel
    and transfer engine need, that costs nothing; with fewer cores (``cores``: those this
    process may use) the spinning workers starve those threads: measured on 2 cores, a
    TP 2 prefill node's pulls took minutes. Then the pause outlasts that window so the
    workers sleep; otherwise (and with one process) it only slows the loop.
    """
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    if world_size <= 1 or cores >= 2 * world_size:
        return 0.01
    from ascend_core.worker.busy_loop import worker_busy_loop_s

    return worker_busy_loop_s() + 0.1


class _SchedulerSide:
    def __init__(self, connector: MooncakeConnectorV1):
        self.connector = connector
        self._idle_pause_s = _idle_step_pause_s(connector.world_size)
        self._last_step_empty = False
        self._parsed: dict[str, Any] = {}  # request id -> RemotePrefill, until allocated
        self._pulls: list[PullTask] = []
        self._leases: dict[str, tuple[list[int], str | None]] = {}
        self._expected: list[str] = []
        self._dropped: dict[str, str] = {}

    def _remote_prefill(self, request: Request):
        """The request's checked RemotePrefill, or None (then it is computed here)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        request_id = request.request_id
        if request_id in self._parsed:
            return self._parsed[request_id]
        connector = self.connector
        try:
            if connector.kv_role not in CONSUMERS:
                raise KVTransferParamsError(
                    f"kv_transfer_params has do_remote_prefill but this instance is "
                    f"{connector.kv_role}: send it to a kv_consumer or kv_both instance")
            remote = parse_remote_prefill(params, request.num_prompt_tokens,
                                          connector.block_size)
            expected_tp = connector.options.prefill.tp_size
            if remote.tp_size != expected_tp:
                raise KVTransferParamsError(
                    f"kv_transfer_params remote_tp_size={remote.tp_size} but "
                    f"kv_connector_extra_config says prefill tp_size {expected_tp}: the "
                    f"parameters come from another prefill deployment")
        except KVTransferParamsError as err:
            logger.error("MooncakeConnectorV1: request %s: %s; computing its prompt here",
                         request_id, err)
            params["do_remote_prefill"] = False
            return None
        self._parsed[request_id] = remote
        return remote

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int):
        if self._remote_prefill(request) is None:
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int):
        remote = self._remote_prefill(request)
        if remote is None:
            params = request.kv_transfer_params
            if params and params.get("do_remote_decode") and \
                    self.connector.kv_role in PRODUCERS:
                self._expected.append(request.request_id)
            return
        # Blocks a local prefix-cache hit filled are hashed; the others are to pull.
        local = blocks.get_unhashed_block_ids() if num_external_tokens > 0 else []
        self._pulls.append(PullTask(request.request_id, tuple(local), remote,
                                    prompt_digest(request.prompt_token_ids)))
        request.kv_transfer_params["do_remote_prefill"] = False
        del self._parsed[request.request_id]

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> MooncakeConnectorMetadata:
        # Two empty steps in a row: the engine only waits on leases, pulls or free blocks.
        empty = (not scheduler_output.total_num_scheduled_tokens and not self._pulls
                 and not self._leases and not self._dropped)
        if empty and self._last_step_empty:
            time.sleep(self._idle_pause_s)
        self._last_step_empty = empty
        meta = MooncakeConnectorMetadata(pulls=self._pulls, leases=self._leases,
                                         expected=self._expected, dropped=self._dropped)
        self._pulls, self._leases, self._expected, self._dropped = [], {}, [], {}
        return meta

    def request_finished(self, request: Request, block_ids: list[int]):
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):
            # Ended (aborted) before its blocks were allocated: free the prefill's blocks.
            remote = self._remote_prefill(request)
            if remote is not None:
                self._pulls.append(PullTask(request.request_id, (), remote))
                self._parsed.pop(request.request_id, None)
                params["do_remote_prefill"] = False
            return False, None
        connector = self.connector
        if not params.get("do_remote_decode"):
            return False, None
        if connector.kv_role not in PRODUCERS:
            logger.error("MooncakeConnectorV1: request %s has do_remote_decode but this "
                         "instance is %s: its blocks are not kept (send it to a kv_producer "
                         "or kv_both instance)", request.request_id, connector.kv_role)
            return False, None
        if (request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                   RequestStatus.FINISHED_STOPPED) or not block_ids):
            self._dropped[request.request_id] = (
                f"the prefill request ended {request.status.name.lower()} and kept no blocks")
            return False, None
        self._leases[request.request_id] = (list(block_ids),
                                            prompt_digest(request.prompt_token_ids))
        return True, remote_prefill_params(
            engine_id=connector.engine_id, request_id=request.request_id,
            host=connector.host, port=connector.kv_port, block_ids=list(block_ids),
            tp_size=connector.tp_size)


class _WorkerSide:
    def __init__(self, connector: MooncakeConnectorV1, kv_cache_config: KVCacheConfig):
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        self.connector = connector
        self.kv_cache_config = kv_cache_config
        self.tp_rank = get_tensor_model_parallel_rank()
        self.leases = LeaseTable(connector.options.lease_timeout_s)
        self.engine: MooncakeEngine | None = None
        self.regions: list[tuple[int, int]] = []
        self.server: SideChannelServer | None = None
        self.decode: DecodeSide | None = None
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
        self._inflight: dict[str, tuple[PullTask, Future]] = {}
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self._stats = MooncakeTransferStats()

    def _as_the_backend_reads_them(self, kv_caches: dict[str, torch.Tensor]) -> dict:
        """Each layer's cache as its attention backend lays blocks out. A backend that
        reinterprets vLLM's pages (the Ascend MLA backend keeps all blocks' latent rows, then
        all blocks' rope rows, in one layer's memory) says so with ``split_cache``; the
        planes are then those views, not ``cache[block]``."""
        context = self.connector._vllm_config.compilation_config.static_forward_context
        views = {}
        for name, cache in kv_caches.items():
            split = getattr(getattr(context.get(name), "impl", None), "split_cache", None)
            if split is not None and cache.dim() == 4 and cache.is_contiguous():
                # vLLM registers the 4D [blocks, 1 head, tokens, width] view of the pages
                # that the backend's forward gets as [blocks, tokens, width].
                cache = cache.view(cache.shape[0], -1, cache.shape[-1])
            views[name] = split(cache) if split is not None else cache
        return views

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        connector = self.connector
        spec = self.kv_cache_config.kv_cache_groups[0].kv_cache_spec
        layout = describe_kv_caches(self._as_the_backend_reads_them(kv_caches),
                                    self.kv_cache_config.num_blocks, connector.block_size,
                                    getattr(spec, "num_kv_heads", None))
        self.engine = MooncakeEngine(connector.host, connector.options.protocol,
                                     connector.options.device_name)
        self.regions = memory_regions(kv_caches)
        self.engine.register(self.regions)
        if connector.kv_role in PRODUCERS:
            port = connector.kv_port + self.tp_rank
            side = PrefillSide(connector.engine_id, self.engine.session, layout, self.leases,
                               f"{connector.host}:{port}")
            self.server = SideChannelServer(connector.host, port, side.handle)
        if connector.kv_role in CONSUMERS:
            # A claim the prefill node answers "still prefilling" is asked again for as
            # long as a lease would be kept there.
            self.decode = DecodeSide(self.engine, layout, self.tp_rank, connector.tp_size,
                                     connector.options.side_channel_timeout_s,
                                     pending_timeout_s=connector.options.lease_timeout_s)
        logger.info("MooncakeConnectorV1 (%s, rank %d): %d KV planes of %d blocks registered "
                    "with the transfer engine at %s%s", connector.kv_role, self.tp_rank,
                    len(layout.planes), layout.num_blocks, self.engine.session,
                    f", side channel {self.server.address}" if self.server else "")

    def register(self, meta: MooncakeConnectorMetadata) -> None:
        for request_id in meta.expected:
            self.leases.expect(request_id)
        for request_id, (block_ids, prompt) in meta.leases.items():
            self.leases.add(request_id, block_ids, prompt)
        for request_id, why in meta.dropped.items():
            self.leases.drop(request_id, why)

    def start(self, meta: MooncakeConnectorMetadata) -> None:
        for task in meta.pulls:
            future = self._pool.submit(self._timed_pull, task)
            if task.local_block_ids:
                self._inflight[task.request_id] = (task, future)

    def _timed_pull(self, task: PullTask) -> tuple[int, float]:
        started = time.perf_counter()
        read = self.decode.pull(task)
        return read, time.perf_counter() - started

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        released, expired = self.leases.take_finished()
        if expired:
            logger.warning("MooncakeConnectorV1: freed the blocks of %d request(s) no decode "
                           "node pulled within lease_timeout_s=%g: %s", len(expired),
                           self.leases.timeout_s, sorted(expired))
            self._stats.data["expired_leases"] += len(expired)
        received = set()
        for request_id, (task, future) in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[request_id]
            received.add(request_id)
            error = future.exception()
            if error is None:
                read, seconds = future.result()
                self._stats.data["pulls"] += 1
                self._stats.data["pulled_bytes"] += read
                self._stats.data["pull_seconds"] += seconds
                continue
            logger.error("MooncakeConnectorV1: request %s: pulling its KV blocks failed, "
                         "they count as load errors: %s", request_id, error)
            self._stats.data["failed_pulls"] += 1
            self._load_errors.update(task.local_block_ids)
        return (released | expired) or None, received or None

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def take_stats(self) -> MooncakeTransferStats | None:
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, MooncakeTransferStats()
        return stats

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.engine is not None:
            self.engine.close(self.regions)
            self.engine = None
