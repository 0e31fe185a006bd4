"""The pull protocol: a prefill worker serves leases, a decode worker pulls blocks.

Decode worker, per request: *claim* the lease on the side channel of each prefill rank
it reads (the same rank when both sides have equal TP sizes; ``k`` ranks when the
prefill node has ``k`` times the decode node's TP size), which checks the engine id, the
block ids and that the blocks hold the decode request's own prompt, and renews the lease;
check that the caches fit; read every plane's blocks with one batched read per prefill
rank; then *release* the leases. Every failure is reported, never retried into a
half-written cache: the caller marks the request's local blocks as failed to load. No
vLLM.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ascend_core.distributed.kv_transfer.layout import (
    KVLayout,
    KVLayoutError,
    check_block_ids,
    check_compatible,
    read_plan,
)
from ascend_core.distributed.kv_transfer.leases import LeaseTable
from ascend_core.distributed.kv_transfer.params import RemotePrefill
from ascend_core.distributed.kv_transfer.side_channel import SideChannelError, ask
from ascend_core.distributed.kv_transfer.transfer_engine import MooncakeEngine

logger = logging.getLogger(__name__)

# Between claims the prefill worker has not registered yet (it does so at its next step).
_PENDING_RETRY_S = 0.02


class PullError(RuntimeError):
    """A pull that did not happen; the message says why, in one line."""


@dataclass(frozen=True)
class PullTask:
    request_id: str  # this (decode) instance's request id
    local_block_ids: tuple[int, ...]  # empty: nothing to read, only release the lease
    remote: RemotePrefill
    prompt: str | None = None  # leases.prompt_digest of this request's prompt


class PrefillSide:
    """Answers decode workers' claims and releases for one prefill rank."""

    def __init__(self, engine_id: str, session: str, layout: KVLayout, leases: LeaseTable,
                 address: str):
        self.engine_id = engine_id
        self.session = session
        self.layout = layout
        self.leases = leases
        self.address = address

    def handle(self, message: dict) -> dict:
        op = message.get("op")
        request_id = str(message.get("request_id"))
        if message.get("engine_id") != self.engine_id:
            return {"status": "refused",
                    "message": f"kv_transfer_params remote_engine_id "
                               f"{message.get('engine_id')!r} is not the engine at "
                               f"{self.address}, which is {self.engine_id!r}"}
        if op == "release":
            self.leases.release(request_id)
            return {"status": "ok"}
        if op != "claim":
            return {"status": "refused", "message": f"unknown side-channel op {op!r}"}
        block_ids = message.get("block_ids")
        if not isinstance(block_ids, list):
            return {"status": "refused", "message": f"claim without block ids: {block_ids!r}"}
        try:
            check_block_ids(block_ids, self.layout.num_blocks,
                            "kv_transfer_params remote_block_ids")
        except KVLayoutError as err:
            return {"status": "refused", "message": str(err)}
        claim = self.leases.claim(request_id, block_ids, message.get("prompt"))
        if claim.status != "ok":
            return {"status": claim.status, "message": claim.message}
        return {"status": "ok", "session": self.session, "layout": self.layout.to_wire()}


class DecodeSide:
    """Pulls requests' blocks for one decode rank from the prefill ranks that hold them."""

    def __init__(self, engine: MooncakeEngine, layout: KVLayout, tp_rank: int, tp_size: int,
                 timeout_s: float, pending_timeout_s: float | None = None):
        self.engine = engine
        self.layout = layout
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.timeout_s = timeout_s  # for each answer of the side channel
        # How long a claim is asked again while the prefill node answers that it is still
        # prefilling the request (its lease is registered at its next engine step).
        self.pending_timeout_s = timeout_s if pending_timeout_s is None else pending_timeout_s

    def prefill_ranks(self, remote: RemotePrefill) -> list[int]:
        if remote.tp_size % self.tp_size:
            raise PullError(f"the prefill node's tp_size {remote.tp_size} is not a multiple "
                            f"of this decode node's {self.tp_size}")
        ratio = remote.tp_size // self.tp_size
        return [self.tp_rank * ratio + j for j in range(ratio)]

    def _ask(self, remote: RemotePrefill, rank: int, message: dict, timeout_s: float) -> dict:
        return ask(remote.host, remote.port + rank,
                   {**message, "engine_id": remote.engine_id,
                    "request_id": remote.request_id}, timeout_s)

    def release(self, remote: RemotePrefill, ranks: list[int]) -> None:
        for rank in ranks:
            try:
                self._ask(remote, rank, {"op": "release"}, self.timeout_s)
            except SideChannelError as err:
                logger.warning("could not release request %s's blocks on %s:%d (the lease "
                               "will expire there): %s", remote.request_id, remote.host,
                               remote.port + rank, err)

    def _claim(self, remote: RemotePrefill, rank: int, block_ids: list[int],
               prompt: str | None) -> dict:
        where = f"{remote.host}:{remote.port + rank}"
        message = {"op": "claim", "block_ids": block_ids, "prompt": prompt}
        give_up = time.monotonic() + self.pending_timeout_s
        while True:
            try:
                reply = self._ask(remote, rank, message, self.timeout_s)
            except SideChannelError as err:
                raise PullError(str(err)) from err
            if reply.get("status") != "pending":
                break
            if time.monotonic() > give_up:
                raise PullError(f"the prefill node at {where} was still prefilling request "
                                f"{remote.request_id!r} after {self.pending_timeout_s:g} s")
            time.sleep(_PENDING_RETRY_S)
        if reply.get("status") != "ok":
            raise PullError(f"the prefill node at {where} refused: {reply.get('message')}")
        return reply

    def pull(self, task: PullTask) -> int:
        """Read the task's blocks; the number of bytes read. Raises PullError."""
        remote = task.remote
        ranks = self.prefill_ranks(remote)
        if not task.local_block_ids:
            self.release(remote, ranks)
            return 0
        if len(task.local_block_ids) > len(remote.block_ids):
            raise PullError(f"{len(task.local_block_ids)} blocks to fill but the prefill "
                            f"node holds {len(remote.block_ids)}")
        # A local prefix-cache hit leaves only the last blocks to fill.
        remote_ids = list(remote.block_ids[len(remote.block_ids) - len(task.local_block_ids):])
        claimed: list[int] = []
        try:
            plans = []
            for index, rank in enumerate(ranks):
                reply = self._claim(remote, rank, remote_ids, task.prompt)
                claimed.append(rank)
                try:
                    remote_layout = KVLayout.from_wire(reply["layout"])
                    check_compatible(self.layout, remote_layout,
                                     f"{remote.host}:{remote.port + rank}", len(ranks))
                    check_block_ids(remote_ids, remote_layout.num_blocks,
                                    "kv_transfer_params remote_block_ids")
                    check_block_ids(task.local_block_ids, self.layout.num_blocks,
                                    "the local blocks")
                    plan = read_plan(self.layout, remote_layout, task.local_block_ids,
                                     remote_ids, len(ranks), index)
                except (KVLayoutError, KeyError, TypeError) as err:
                    raise PullError(str(err)) from err
                plans.append((reply["session"], plan))
            read = 0
            for session, plan in plans:
                if not plan[0]:
                    continue  # replicated planes only, read from the first rank
                status = self.engine.read(session, *plan)
                if status < 0:
                    raise PullError(f"the transfer engine's read of {len(remote_ids)} blocks "
                                    f"from {session} failed (status {status})")
                read += sum(plan[2])
            return read
        finally:
            self.release(remote, claimed)
