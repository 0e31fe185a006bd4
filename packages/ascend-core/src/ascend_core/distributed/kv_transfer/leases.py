"""The blocks a prefill node holds for decode nodes, until pulled or expired.

A lease starts when the prefill request finishes (its blocks are kept, not freed). While
the request is still being prefilled here it is *expected*: a claim for it is answered
"pending" (the decode node asks again), where a claim for a request this node never
prefilled, or no longer remembers, is refused at once. A decode node *claims* a lease
before reading (which also renews it, so it cannot expire mid-read) and *releases* it
after. A lease nobody claims within the timeout expires: its blocks go back to vLLM and a
late claim is refused, so a decode node never reads blocks that were handed to another
request. A lease remembers a digest of the prompt its blocks hold (``prompt_digest``); a
claim for another prompt is refused, so a decode request can only ever read the KV of its
own prompt. Thread-safe: the side channel's thread claims and releases while the worker's
step collects finished leases. No vLLM.
"""

from __future__ import annotations

import array
import hashlib
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# How many ended leases are remembered, to answer a late or repeated claim clearly.
_ENDED_MEMORY = 4096


def prompt_digest(token_ids: Sequence[int] | None) -> str | None:
    """A short digest of a prompt's token ids (None for a prompt given as embeddings)."""
    if token_ids is None:
        return None
    words = array.array("i", token_ids)  # C ints; one pass, not a bytes object per token
    if sys.byteorder == "big":
        words.byteswap()  # the digest is of little-endian words on every host
    return hashlib.sha256(words.tobytes()).hexdigest()[:32]


@dataclass
class _Lease:
    block_ids: tuple[int, ...]
    deadline: float
    prompt: str | None  # prompt_digest of the prompt whose KV the blocks hold


@dataclass(frozen=True)
class Claim:
    status: str  # "ok", "pending" (still being prefilled here), "refused"
    message: str = ""


class LeaseTable:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, _Lease] = {}
        self._released: set[str] = set()
        self._expected: set[str] = set()  # being prefilled here, no lease yet
        self._ended: OrderedDict[str, str] = OrderedDict()  # request id -> why

    def expect(self, request_id: str) -> None:
        """The request is being prefilled here for a decode node."""
        with self._lock:
            if request_id not in self._leases and request_id not in self._ended:
                self._expected.add(request_id)

    def drop(self, request_id: str, why: str) -> None:
        """An expected request ended without keeping its blocks (aborted, for instance)."""
        with self._lock:
            if request_id in self._expected:
                self._end(request_id, why)

    def add(self, request_id: str, block_ids: Sequence[int], prompt: str | None) -> None:
        with self._lock:
            self._expected.discard(request_id)
            self._leases[request_id] = _Lease(tuple(block_ids),
                                              self._clock() + self.timeout_s, prompt)

    def claim(self, request_id: str, block_ids: Sequence[int], prompt: str | None) -> Claim:
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or request_id in self._released:
                why = "released" if request_id in self._released else self._ended.get(
                    request_id)
                if why is None and request_id in self._expected:
                    return Claim("pending")
                if why is None:
                    return Claim("refused", f"no request {request_id!r} is or was "
                                            f"prefilled here for a decode node (or it ended "
                                            f"too long ago to be remembered)")
                return Claim("refused", f"the blocks of request {request_id!r} are no "
                                        f"longer held here: {why}")
            if self._clock() > lease.deadline:
                return Claim("refused", f"the lease on request {request_id!r}'s blocks "
                                        f"expired after {self.timeout_s:g} s")
            if prompt is None or prompt != lease.prompt:
                return Claim("refused", f"the blocks of request {request_id!r} hold the KV "
                                        f"of another prompt than the claim's")
            outside = [b for b in block_ids if b not in set(lease.block_ids)]
            if outside:
                return Claim("refused",
                             f"block id {outside[0]} is not one of the {len(lease.block_ids)} "
                             f"blocks held for request {request_id!r} ({list(lease.block_ids)})")
            lease.deadline = self._clock() + self.timeout_s
            return Claim("ok")

    def release(self, request_id: str) -> bool:
        """The decode node is done with the blocks (pulled, or not needed)."""
        with self._lock:
            if request_id not in self._leases or request_id in self._released:
                return False
            self._released.add(request_id)
            return True

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(released, expired) request ids since the last call; their blocks may go."""
        now = self._clock()
        with self._lock:
            released = set(self._released)
            expired = {rid for rid, lease in self._leases.items()
                       if rid not in released and now > lease.deadline}
            for rid in released:
                self._end(rid, "a decode node already pulled them")
            for rid in expired:
                self._end(rid, f"their lease expired after {self.timeout_s:g} s")
            self._released.clear()
            return released, expired

    def _end(self, request_id: str, why: str) -> None:
        self._leases.pop(request_id, None)
        self._expected.discard(request_id)
        self._ended[request_id] = why
        while len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    def held_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())
