"""EPLB in the serving loop, without vLLM: placement in service, load recording,
periodic replanning and atomic rearrangement of expert weights.

One ``EplbRuntime`` per serving process (per expert-parallel rank) owns:

- the placement in service (``Placement``: ``phy2log`` and the tables routing a
  token's logical expert to one of its replicas);
- the slot buffers: per MoE layer, expert-major weight tensors with one row per
  local slot (``(experts + redundant) / ranks`` rows), which the MoE kernel reads;
- an ``ExpertLoadRecorder`` fed by the MoE layers.

The model glue (``ascend_eplb.vllm``, on the host and npu targets) calls ``start`` once,
then per forward step ``on_step_boundary`` before the first MoE layer runs, and per MoE
layer ``record`` and ``route`` (or ``route_physical``). Every ``heat_collection_interval``
steps the recorded window is handed to the policy (rank 0 plans in a background thread); after
``execution_delay`` more steps the new placement is applied, between two steps:

1. rank 0 broadcasts the new ``phy2log`` (or that planning failed);
2. every rank checks it, turns old -> new into the fewest copies (``plan_transfers``)
   and stages the rows it receives (``exchange.stage_expert_weights``); the weights
   in service are not touched;
3. the ranks agree (all-reduce) that every one of them staged successfully; only then
   does each commit its staged rows and swap in the new routing tables. Otherwise
   all ranks drop their staging and keep serving the old placement, with an error log.

The order of the steps is the same on every rank, as every decision depends only on
step counts and on data rank 0 broadcasts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

import ascend_eplb
from ascend_core.registry import EPLB_POLICIES, RegistryError
from ascend_eplb.exchange import commit_staged_weights, stage_expert_weights
from ascend_eplb.expert_map import ExpertMap, save_expert_map
from ascend_eplb.metrics import balancedness
from ascend_eplb.placement import check_phy2log, log2phy_from_phy2log
from ascend_eplb.recorder import PHASES, ExpertLoadRecorder
from ascend_eplb.transfer import TransferPlan, plan_initial_transfers, plan_transfers
from ascend_eplb.validation import UnknownEplbPolicyError, positive_int

__all__ = ["EplbRuntime", "EplbSettings", "Placement", "default_phy2log"]

logger = logging.getLogger(__name__)

LayerWeights = list[list[torch.Tensor]]  # [layer][param] -> [slots, ...]


@dataclass(frozen=True)
class EplbSettings:
    """What the runtime needs from ``eplb_config`` and the model."""

    num_experts: int  # logical routed experts per MoE layer
    num_redundant_experts: int = 0
    policy: str = "default"
    dynamic: bool = False
    heat_collection_interval: int = 400  # steps between two replans
    execution_delay: int = 30  # steps between a replan's start and its application
    window_steps: int | None = None  # recorder window; None: heat_collection_interval
    phase: str = "all"
    num_groups: int = 1
    num_nodes: int = 1
    record_path: str | None = None

    def __post_init__(self) -> None:
        positive_int("num_experts", self.num_experts)
        if not isinstance(self.num_redundant_experts, int) or self.num_redundant_experts < 0:
            raise ValueError(
                f"num_redundant_experts must be an integer >= 0, got {self.num_redundant_experts!r}"
            )
        positive_int("heat_collection_interval", self.heat_collection_interval)
        positive_int("execution_delay", self.execution_delay)
        if self.window_steps is not None:
            positive_int("window_steps", self.window_steps)
        if self.phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {self.phase!r}")

    @property
    def num_slots(self) -> int:
        return self.num_experts + self.num_redundant_experts

    @classmethod
    def from_eplb_config(cls, eplb_config: Any, num_experts: int, **model: Any) -> EplbSettings:
        """From ascend-core's ``EplbConfig`` (``get_ascend_config().eplb_config``)."""
        return cls(
            num_experts=num_experts,
            num_redundant_experts=eplb_config.num_redundant_experts,
            policy=eplb_config.policy,
            dynamic=eplb_config.dynamic_eplb,
            heat_collection_interval=eplb_config.expert_heat_collection_interval,
            execution_delay=eplb_config.algorithm_execution_interval,
            phase=eplb_config.heat_collection_phase,
            record_path=eplb_config.expert_map_record_path,
            **model,
        )


@dataclass(frozen=True)
class Placement:
    """A placement in service and its routing tables (never modified: replaced whole)."""

    phy2log: torch.Tensor  # [layers, slots] int64 (CPU)
    log2phy: torch.Tensor  # [layers, experts, max_replicas] int64, -1 padded (device)
    logcnt: torch.Tensor  # [layers, experts] int64 (device)
    num_ranks: int

    @classmethod
    def from_phy2log(
        cls, phy2log: torch.Tensor, num_experts: int, num_ranks: int, device: Any = "cpu"
    ) -> Placement:
        log2phy, logcnt = log2phy_from_phy2log(phy2log, num_experts)
        return cls(phy2log.clone(), log2phy.to(device), logcnt.to(device), num_ranks)

    @property
    def slots_per_rank(self) -> int:
        return self.phy2log.size(1) // self.num_ranks

    def local_experts(self, rank: int) -> torch.Tensor:
        """[layers, slots_per_rank]: the logical expert of each local slot of ``rank``."""
        k = self.slots_per_rank
        return self.phy2log[:, rank * k : (rank + 1) * k]

    def physical(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global physical slot of each (token, choice) (``[tokens, top_k]`` int64).

        A token whose expert has ``n`` replicas goes to replica ``token_index % n``,
        which spreads a batch evenly over the replicas.
        """
        ids = topk_ids.to(torch.int64).clamp(min=0)
        counts = self.logcnt[layer][ids]
        token = torch.arange(ids.size(0), device=ids.device).unsqueeze(-1)
        replica = token % counts
        return self.log2phy[layer][ids, replica]

    def route(
        self, layer: int, topk_ids: torch.Tensor, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical slot of each (token, choice), as ``(local_slot, is_local)`` for ``rank``.

        The replica is ``physical``'s; ``local_slot`` is the slot index on ``rank``
        (meaningless where ``is_local`` is False).
        """
        physical = self.physical(layer, topk_ids)
        local = physical - rank * self.slots_per_rank
        is_local = (local >= 0) & (local < self.slots_per_rank)
        return local, is_local


def default_phy2log(num_layers: int, num_experts: int, num_slots: int) -> torch.Tensor:
    """The placement without a map file: slot ``i`` holds expert ``i % num_experts``
    (vLLM's initial placement: redundant slots repeat the first experts)."""
    row = torch.arange(num_slots, dtype=torch.int64) % num_experts
    return row.expand(num_layers, -1).clone()


@dataclass
class _PendingReplan:
    triggered_at: int  # completed steps when planning started
    apply_at: int  # completed steps when it is applied
    load: torch.Tensor  # [layers, experts] the window it plans from
    future: concurrent.futures.Future | None  # rank 0 only


HISTORY_LENGTH = 256  # rearrangements (and failures) kept in EplbStats.history


@dataclass
class EplbStats:
    rearrangements: int = 0
    failed_replans: int = 0
    skipped_replans: int = 0
    experts_moved: int = 0  # copies, all ranks
    bytes_moved: int = 0  # all ranks, local copies included
    bytes_between_ranks: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # the latest ones

    def add(self, entry: dict[str, Any]) -> None:
        self.history.append(entry)
        del self.history[:-HISTORY_LENGTH]


class EplbRuntime:
    """Placement, slot buffers, recording and rearrangement of one rank (module doc)."""

    def __init__(
        self,
        settings: EplbSettings,
        *,
        num_layers: int,
        num_ranks: int = 1,
        rank: int = 0,
        control_group: dist.ProcessGroup | None = None,
        weight_group: dist.ProcessGroup | None = None,
        expert_bytes: int = 0,
    ) -> None:
        self.settings = settings
        self.num_layers = num_layers
        self.num_ranks = positive_int("num_ranks", num_ranks)
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, {num_ranks}), got {rank}")
        self.rank = rank
        if settings.num_slots % num_ranks:
            raise ValueError(
                f"experts + redundant experts = {settings.num_experts} + "
                f"{settings.num_redundant_experts} = {settings.num_slots} slots cannot be spread "
                f"evenly over {num_ranks} expert-parallel ranks; choose num_redundant_experts so "
                f"that the sum is a multiple of {num_ranks}"
            )
        check_policy(settings.policy)
        self.control_group = control_group
        self.weight_group = weight_group
        self.expert_bytes = expert_bytes
        window = settings.window_steps or settings.heat_collection_interval
        self.recorder = ExpertLoadRecorder(num_layers, settings.num_experts, window, settings.phase)
        self.placement: Placement | None = None
        self.initial_placement: torch.Tensor | None = None  # phy2log served first
        self.weights: LayerWeights | None = None
        self.stats = EplbStats()
        self.steps_completed = 0
        self._step_open = False
        self._last_trigger = 0
        self._pending: _PendingReplan | None = None
        self._planner: concurrent.futures.ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ start

    @property
    def slots_per_rank(self) -> int:
        return self.settings.num_slots // self.num_ranks

    def initial_phy2log(self, expert_map: ExpertMap | None = None) -> torch.Tensor:
        """The first placement: ``expert_map`` (checked against the model) or the default."""
        s = self.settings
        if expert_map is None:
            return default_phy2log(self.num_layers, s.num_experts, s.num_slots)
        problems = []
        if expert_map.num_layers != self.num_layers:
            problems.append(f"{expert_map.num_layers} MoE layers, the model has {self.num_layers}")
        if expert_map.num_experts != s.num_experts:
            problems.append(
                f"{expert_map.num_experts} experts per layer, the model has {s.num_experts}"
            )
        if expert_map.num_gpus != self.num_ranks:
            problems.append(
                f"{expert_map.num_gpus} ranks, this deployment has {self.num_ranks} "
                "expert-parallel ranks"
            )
        if expert_map.num_replicas != s.num_slots:
            problems.append(
                f"{expert_map.num_replicas} slots per layer, but experts + "
                f"num_redundant_experts = {s.num_experts} + {s.num_redundant_experts} = "
                f"{s.num_slots} (set num_redundant_experts to "
                f"{expert_map.num_replicas - s.num_experts})"
            )
        if problems:
            raise ValueError("the expert map does not fit this model: " + "; ".join(problems))
        return expert_map.phy2log.clone()

    def start(
        self,
        sources: LayerWeights,
        source_phy2log: torch.Tensor,
        initial_phy2log: torch.Tensor | None = None,
    ) -> LayerWeights:
        """Build this rank's slot buffers for ``initial_phy2log`` and put it in service.

        Args:
            sources: ``sources[layer][p]``: the expert-major weights as loaded,
                ``[source slots per rank, ...]``.
            source_phy2log: [layers, ranks * source slots per rank]: which expert each
                loaded row holds (e.g. vLLM's: rank r loaded experts r*E/R ...).
            initial_phy2log: the first placement; default: ``initial_phy2log()``.

        Returns the slot buffers (``[slots_per_rank, ...]`` per layer and parameter),
        which the MoE kernel must read from now on; rearrangements update them in place.
        """
        if self.placement is not None:
            raise RuntimeError("EplbRuntime.start was already called")
        s = self.settings
        if initial_phy2log is None:
            initial_phy2log = self.initial_phy2log()
        initial = check_phy2log(
            initial_phy2log, s.num_experts, self.num_ranks, name="initial placement",
            num_layers=self.num_layers, num_replicas=s.num_slots,
        )
        plan = plan_initial_transfers(
            source_phy2log, initial, self.num_ranks, self.expert_bytes,
            num_nodes=s.num_nodes, num_experts=s.num_experts,
        )
        staged = stage_expert_weights(plan, sources, self.rank, group=self.weight_group)
        buffers = [
            [
                torch.empty((self.slots_per_rank,) + tuple(t.shape[1:]), dtype=t.dtype,
                            device=t.device)
                for t in params
            ]
            for params in sources
        ]
        commit_staged_weights(staged, buffers)
        device = sources[0][0].device if sources and sources[0] else "cpu"
        self.weights = buffers
        self.placement = Placement.from_phy2log(plan.phy2log, s.num_experts, self.num_ranks,
                                                device)
        self.initial_placement = plan.phy2log.clone()
        logger.info(
            "EPLB placement in service: %d MoE layers, %d experts + %d redundant over %d "
            "rank(s), %d slots each; initial copies: %d (%d bytes, %d between ranks)",
            self.num_layers, s.num_experts, s.num_redundant_experts, self.num_ranks,
            self.slots_per_rank, plan.num_moves, plan.total_bytes, plan.bytes_between_ranks,
        )
        return buffers

    # ------------------------------------------------------------------ serving

    def route(self, layer: int, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(local_slot, is_local)`` of each (token, choice) on this rank."""
        placement = self._in_service()
        return placement.route(layer, topk_ids, self.rank)

    def route_physical(self, layer: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Global physical slot (``[0, experts + redundant)``) of each (token, choice), for
        MoE paths that send each row to the rank of its slot themselves."""
        return self._in_service().physical(layer, topk_ids)

    def record(
        self, layer: int, topk_ids: torch.Tensor, prefill_mask: torch.Tensor | None = None
    ) -> None:
        if self.settings.dynamic:
            self.recorder.record(layer, topk_ids, prefill_mask)

    def on_step_boundary(self) -> None:
        """Call before the first MoE layer of every real forward step.

        Closes the previous step's recording, then applies a replan whose time has
        come and starts the next one when ``heat_collection_interval`` steps passed.
        """
        self._in_service()
        if self._step_open:
            self.recorder.end_step()
            self.steps_completed += 1
        self._step_open = True
        if not self.settings.dynamic:
            return
        if self._pending is not None and self.steps_completed >= self._pending.apply_at:
            pending, self._pending = self._pending, None
            self._apply(pending)
        if (
            self._pending is None
            and self.steps_completed - self._last_trigger >= self.settings.heat_collection_interval
        ):
            self._trigger()

    def close(self) -> None:
        if self._planner is not None:
            self._planner.shutdown(wait=False, cancel_futures=True)
            self._planner = None

    def summary(self) -> dict[str, Any]:
        """Counters and the placement in service, for logs, probes and tests."""
        stats = self.stats
        placement = self.placement
        return {
            "rank": self.rank,
            "num_ranks": self.num_ranks,
            "num_layers": self.num_layers,
            "num_experts": self.settings.num_experts,
            "num_redundant_experts": self.settings.num_redundant_experts,
            "slots_per_rank": self.slots_per_rank,
            "policy": self.settings.policy,
            "dynamic": self.settings.dynamic,
            "steps": self.steps_completed,
            "recorded_steps": self.recorder.steps_committed,  # steps with tokens of the phase
            "rearrangements": stats.rearrangements,
            "failed_replans": stats.failed_replans,
            "skipped_replans": stats.skipped_replans,
            "experts_moved": stats.experts_moved,
            "bytes_moved": stats.bytes_moved,
            "bytes_between_ranks": stats.bytes_between_ranks,
            "history": list(stats.history),
            "phy2log": None if placement is None else placement.phy2log.tolist(),
            "initial_phy2log": (
                None if self.initial_placement is None else self.initial_placement.tolist()
            ),
            "window_load": self.recorder.window_load().tolist(),
        }

    # ------------------------------------------------------------------ replanning

    def _in_service(self) -> Placement:
        if self.placement is None:
            raise RuntimeError("EplbRuntime.start must be called before serving")
        return self.placement

    def _trigger(self) -> None:
        self._last_trigger = self.steps_completed
        load = self.recorder.window_load().clone()
        future = None
        if self.rank == 0:
            if self._planner is None:
                self._planner = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix="eplb-planner"
                )
            previous = self._in_service().phy2log.clone()
            future = self._planner.submit(self._plan, load, previous)
        self._pending = _PendingReplan(
            self.steps_completed, self.steps_completed + self.settings.execution_delay,
            load, future,
        )

    def _plan(
        self, load: torch.Tensor, previous: torch.Tensor
    ) -> tuple[torch.Tensor | None, float]:
        """Rank 0, planner thread: the policy's placement, or None when there is no load."""
        started = time.perf_counter()
        if not bool(load.any()):
            return None, 0.0
        s = self.settings
        phy2log, _, _ = ascend_eplb.rebalance_experts(
            load, s.num_slots, s.num_groups, s.num_nodes, self.num_ranks,
            policy=s.policy, previous=previous,
        )
        return torch.as_tensor(phy2log), (time.perf_counter() - started) * 1e3

    def _apply(self, pending: _PendingReplan) -> None:
        step = self.steps_completed
        status, new_phy2log, planning_ms, reason = self._planned_result(pending)
        if status == _SKIP:
            self.stats.skipped_replans += 1
            logger.info("EPLB replan at step %d skipped: no expert load recorded in the window "
                        "(phase %r); keeping the placement in service", step, self.settings.phase)
            return
        if status == _FAILED:
            self._fail(step, reason)
            return
        old = self._in_service()
        s = self.settings
        try:
            new_phy2log = check_phy2log(
                new_phy2log, s.num_experts, self.num_ranks, name=f"policy {s.policy!r} placement",
                num_layers=self.num_layers, num_replicas=s.num_slots,
            )
            plan = plan_transfers(old.phy2log, new_phy2log, self.num_ranks, self.expert_bytes,
                                  num_nodes=s.num_nodes, num_experts=s.num_experts)
        except (ValueError, TypeError) as err:  # the same on every rank: same inputs
            self._fail(step, f"inconsistent plan: {err}")
            return
        staged = None
        error = ""
        try:
            staged = stage_expert_weights(plan, self._weights(), self.rank, group=self.weight_group)
        except Exception as err:  # noqa: BLE001 - reported, then the ranks agree below
            error = f"rank {self.rank} could not stage expert weights: {type(err).__name__}: {err}"
            logger.exception("EPLB: %s", error)
        if not self._all_ranks_agree(staged is not None):
            self._fail(step, error or "another rank could not stage its expert weights")
            return
        commit_staged_weights(staged, self._weights())
        self.placement = Placement.from_phy2log(plan.phy2log, s.num_experts, self.num_ranks,
                                                old.log2phy.device)
        self._record_success(step, pending, old, plan, planning_ms, staged)

    def _planned_result(
        self, pending: _PendingReplan
    ) -> tuple[int, torch.Tensor | None, float, str]:
        """Rank 0's planning outcome, broadcast to every rank: (status, phy2log, ms, reason)."""
        status, phy2log, planning_ms, reason = _FAILED, None, 0.0, ""
        if self.rank == 0:
            assert pending.future is not None
            try:
                phy2log, planning_ms = pending.future.result()
                status = _SKIP if phy2log is None else _OK
            except (UnknownEplbPolicyError, RegistryError) as err:
                reason = f"policy {self.settings.policy!r}: {err}"
            except Exception as err:  # noqa: BLE001 - any policy failure keeps the old placement
                reason = f"policy {self.settings.policy!r} raised {type(err).__name__}: {err}"
                logger.debug("EPLB planning failure", exc_info=True)
            if status == _OK:
                phy2log = torch.as_tensor(phy2log)
                if phy2log.shape != (self.num_layers, self.settings.num_slots):
                    # Broadcast needs the agreed shape; a wrong one is a failed plan.
                    reason = (
                        f"inconsistent plan: policy {self.settings.policy!r} returned a "
                        f"placement shaped {tuple(phy2log.shape)}, expected "
                        f"{(self.num_layers, self.settings.num_slots)}"
                    )
                    status, phy2log = _FAILED, None
        if self.num_ranks == 1:
            return status, phy2log, planning_ms, reason
        header = torch.tensor([status, round(planning_ms * 1e3)], dtype=torch.int64)
        dist.broadcast(header, group=self.control_group, group_src=0)
        status, planning_ms = int(header[0]), int(header[1]) / 1e3
        if status != _OK:
            return status, None, planning_ms, reason or "planning failed on rank 0"
        buffer = torch.empty(self.num_layers, self.settings.num_slots, dtype=torch.int64)
        if self.rank == 0:
            buffer.copy_(phy2log.to(torch.int64))
        dist.broadcast(buffer, group=self.control_group, group_src=0)
        return status, buffer, planning_ms, reason

    def _all_ranks_agree(self, ok: bool) -> bool:
        if self.num_ranks == 1:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.control_group)
        return bool(flag.item())

    def _fail(self, step: int, reason: str) -> None:
        self.stats.failed_replans += 1
        self.stats.add({"step": step, "ok": False, "reason": reason})
        logger.error("EPLB replan at step %d failed, keeping the placement in service "
                     "(nothing was changed): %s", step, reason)

    def _record_success(
        self,
        step: int,
        pending: _PendingReplan,
        old: Placement,
        plan: TransferPlan,
        planning_ms: float,
        staged: Any,
    ) -> None:
        stats = self.stats
        stats.rearrangements += 1
        stats.experts_moved += plan.num_moves
        stats.bytes_moved += plan.total_bytes
        stats.bytes_between_ranks += plan.bytes_between_ranks
        new = self._in_service()
        before = balancedness(pending.load, old.phy2log, old.logcnt.cpu(), self.num_ranks)
        after = balancedness(pending.load, new.phy2log, new.logcnt.cpu(), self.num_ranks)
        entry = {
            "step": step, "ok": True, "planned_at": pending.triggered_at,
            "moves": plan.num_moves, "bytes": plan.total_bytes,
            "bytes_between_ranks": plan.bytes_between_ranks,
            "rows_sent": staged.rows_sent, "rows_received": staged.rows_received,
            "balancedness_before": before, "balancedness_after": after,
            "planning_ms": planning_ms,
        }
        stats.add(entry)
        logger.info(
            "EPLB rearrangement %d at step %d (policy %s, planned at step %d in %.1f ms): "
            "%d expert copies, %d bytes moved (%d between ranks; this rank sent %d and "
            "received %d experts), balancedness of the window %.3f -> %.3f",
            stats.rearrangements, step, self.settings.policy, pending.triggered_at,
            planning_ms, plan.num_moves, plan.total_bytes, plan.bytes_between_ranks,
            staged.rows_sent, staged.rows_received, before, after,
        )
        if self.settings.record_path and self.rank == 0:
            try:
                save_expert_map(
                    self.settings.record_path, new.phy2log, self.num_ranks,
                    num_experts=self.settings.num_experts,
                    metadata={"policy": self.settings.policy, "step": step,
                              "rearrangement": stats.rearrangements,
                              "balancedness": after},
                )
            except OSError as err:
                logger.warning("EPLB: could not record the expert map to %s: %s",
                               self.settings.record_path, err)

    def _weights(self) -> LayerWeights:
        if self.weights is None:
            raise RuntimeError("EplbRuntime.start must be called before serving")
        return self.weights


_OK, _SKIP, _FAILED = 0, 1, 2


def check_policy(name: str) -> None:
    """Raise ``UnknownEplbPolicyError`` (listing the known ones) for an unknown policy."""
    ascend_eplb.register()
    try:
        EPLB_POLICIES.get(name)
    except RegistryError as err:
        raise UnknownEplbPolicyError(f"eplb_config.policy: {err}") from None
