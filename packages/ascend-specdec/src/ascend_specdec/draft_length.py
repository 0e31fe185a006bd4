"""How many draft tokens each request gets in the next step: chosen from load and acceptance.

Fixed-length speculation wins at batch 1 and loses under load: a verification step scores
``1 + k`` tokens per request, and once the batch fills the device that work costs about as
much as the tokens it would have saved. ``DraftLengthController`` decides online, every step:

- **Acceptance**: per draft position ``j``, the rate at which the ``j``-th draft is accepted
  when the ones before it were (counts over all requests, decayed with each step that
  verified drafts), and per request how its
  own rate compares with the global one (a few pseudo-observations of the global rate, so a
  new request starts at the global estimate). The chance that a request's first ``j`` drafts
  are all accepted is the product of its rates up to ``j``.
- **Cost, measured**: per batch-size range (powers of two) and draft length ``k_max`` (the
  length the proposer ran and the verification scored), the recent decode steps' time per
  request at the batch's size (a fixed part per step and a part per request, see
  ``StepTimes``). A step's time is far from linear in its tokens (a device is
  about as fast for 8 tokens as for 1 until its compute fills) and depends on the proposer,
  so it is measured where it is used rather than modelled. A step verifies the drafts of the
  step before it, so a step is timed only where both steps gave every request the same
  length (the caller's part, see ``observe_step``). The first
  steps in each range try every allowed length a few steps in a row (calibration on the real
  traffic); afterwards every ``explore_every``-th step there starts two steps of another
  length, drafted in full, so a change in load is seen: the one due longest ago, each
  length looked at again after ``explore_every`` steps while it is within ``far_margin``
  of the choice, after twice its last gap (up to ``8 * explore_every``) while it is further
  below (each look costs what that length loses). Every length, not only the neighbours:
  the step's cost is not convex in the length (a proposer's pass and the drafts' fetch
  cost the same for one draft as for three), so one draft can lose to none where three
  win.
- **Yield, modelled**: the tokens a request emits per step at length ``k``, one plus the
  chances that its first ``1 .. k`` drafts are all accepted (the acceptance estimates above,
  from every verified draft, times the share of requests asked for drafts whose proposer
  found any: n-gram and suffix often find none). Counting tokens per step instead would be
  far noisier: a step's yield swings with the text.
- **Choice**: the length with the most expected tokens per second of request time in this
  batch-size range (the shortest one within ``margin`` of it, so noise buys no drafts).
  Each length at its own measured time, not one bounded by a shorter length's: a step
  that scores more drafts can take less time (measured on the host: Medusa at batch 1
  stepped faster at length 3 than at length 1). Then each request keeps the drafts, up to
  the step's length, whose own expected tokens (its acceptance in place of the global one)
  per second of verification beat the step's tokens per second: a draft's cost there is
  the time one more verified draft adds to a request (the slope of the time over the
  lengths from 1), not a share of the proposer's pass, which the step runs anyway. So
  requests whose drafts are rarely accepted draft fewer, and where drafts cost nothing to
  verify every request keeps them. ``k_max`` is what the proposer drafts; each request's
  own count is at most that.

Greedy outputs do not depend on the count (verification is exact); the sampled path keeps
the target distribution for any count. Pure Python: no torch, no vLLM.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass


class DraftLengthError(ValueError):
    """A bad controller setting: what was wrong, the value, what would be right."""


class StepTimes:
    """Decode steps per (batch-size range, draft length): the last ``window`` steps' seconds
    and request counts, for the time per request in a step of a given batch size.

    A step costs a fixed part (the scheduler, the runner's bookkeeping, one pass over the
    weights) and a part per request that grows with the draft length. On a small model the
    fixed part is most of a step, so a range's steps cost far more per request at its low end
    (a round's tail, requests finishing) than at its top: a range's time per request taken
    over its steps as they came would favour whichever length happened to be measured at
    larger batches. So one fixed part is fitted for all steps (least squares, each range and
    length with its own slope, so only the spread of batch sizes within a group tells the
    fixed part), and a group's per-request part is the median of its steps' (a step the
    machine stalled in does not count); the time per request at ``n`` requests is the fixed
    part over ``n`` plus that."""

    def __init__(self, window: int = 24) -> None:
        self.window = window
        self._steps: dict[tuple[int, int], deque[tuple[float, int]]] = {}
        # Per group: its steps' count, sums of s, n, n*s and n*n, and its cheapest step.
        self._sums: dict[tuple[int, int], tuple[float, ...]] = {}
        self._fixed: float | None = None  # None: to fit again

    @staticmethod
    def bucket(num_requests: int) -> int:
        """The batch-size range: the next power of two at or above ``num_requests``."""
        return 1 << max(num_requests - 1, 0).bit_length()

    def observe(self, num_requests: int, k_max: int, seconds: float) -> None:
        if num_requests <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return
        key = (self.bucket(num_requests), k_max)
        steps = self._steps.setdefault(key, deque(maxlen=self.window))
        steps.append((seconds, num_requests))
        self._sums[key] = (len(steps), sum(s for s, _ in steps), sum(n for _, n in steps),
                           sum(n * s for s, n in steps), sum(n * n for _, n in steps),
                           min(s for s, _ in steps))
        self._fixed = None

    def fixed(self) -> float:
        """Seconds of a step that do not depend on its number of requests: the least-squares
        intercept ``a`` with a slope per group, at least 0 and below every recorded step."""
        if self._fixed is None:
            # A group's residuals are u - a v with u = s - n A, v = 1 - n B (its slope is
            # A - a B, A = sum ns / sum nn, B = sum n / sum nn): a = sum uv / sum vv.
            uv = vv = 0.0
            lowest = math.inf
            for m, sum_s, sum_n, sum_ns, sum_nn, cheapest in self._sums.values():
                a, b = sum_ns / sum_nn, sum_n / sum_nn
                uv += sum_s - b * sum_ns - a * sum_n + a * b * sum_nn
                vv += m - 2 * b * sum_n + b * b * sum_nn
                lowest = min(lowest, cheapest)
            self._fixed = min(max(uv / vv, 0.0), 0.9 * lowest) if vv > 1e-9 else 0.0
        return self._fixed

    def per_request(self, num_requests: int, k_max: int) -> float | None:
        """Seconds per request in a step of ``num_requests`` requests at ``k_max``, or None
        before any step of that range and length."""
        steps = self._steps.get((self.bucket(num_requests), k_max))
        if not steps:
            return None
        fixed = self.fixed()
        return fixed / num_requests + statistics.median((s - fixed) / n for s, n in steps)

    def table(self) -> dict[tuple[int, int], tuple[float, float]]:
        """``{(batch-size range, length): (mean seconds, seconds per request at the range's
        top)}``."""
        return {key: (sum(s for s, _ in steps) / len(steps), self.per_request(key[0], key[1]))
                for key, steps in sorted(self._steps.items())}


@dataclass
class _Counts:
    tried: float = 0.0
    accepted: float = 0.0


class DraftLengthController:
    """Chooses ``k_max`` for the proposer and each request's count (see the module doc).

    ``max_k``: the configured ``num_speculative_tokens``; counts stay in ``[min_k, max_k]``.
    ``ragged``: whether requests may get fewer drafts than ``k_max`` (the caller applies
    per-request counts); if not, every request gets ``k_max``.
    """

    def __init__(self, max_k: int, min_k: int = 0, *, decay: float = 0.995,
                 request_prior: float = 4.0, explore_every: int = 32,
                 calibration_rounds: int = 3, window: int = 24,
                 margin: float = 0.03, far_margin: float = 0.15,
                 ragged: bool = True) -> None:
        if not isinstance(max_k, int) or max_k < 1:
            raise DraftLengthError(
                f"max_k={max_k!r}: the draft length must be an integer of at least 1")
        if not isinstance(min_k, int) or not 0 <= min_k <= max_k:
            raise DraftLengthError(
                f"min_k={min_k!r}: must be an integer from 0 to max_k={max_k}")
        self.max_k, self.min_k = max_k, min_k
        self.decay, self.request_prior, self.position_prior = decay, request_prior, 2.0
        self.explore_every, self.margin, self.ragged = explore_every, margin, ragged
        self.far_margin = far_margin
        self.times = StepTimes(window)
        self.calibration_rounds = calibration_rounds
        # Global per position (1-based j at index j-1); the priors are in position_rates.
        self._positions = [_Counts() for _ in range(max_k)]
        # Of the requests asked for drafts, those whose proposer found some ("accepted").
        self._found = _Counts(1.0, 1.0)
        self._requests: dict[str, _Counts] = {}
        # Per batch-size range: the lengths still to try at start-up, the steps seen and the
        # step of the next exploration; per range and length: the step that length is due to
        # be looked at again, and the steps between its last two looks.
        self._calibration: dict[int, list[int]] = {}
        self._steps: dict[int, int] = {}
        self._next_explore: dict[int, int] = {}
        self._due: dict[tuple[int, int], int] = {}
        self._explore_gap: dict[tuple[int, int], int] = {}
        # How often each k_max was chosen (the controller's histogram).
        self.chosen: dict[int, int] = {k: 0 for k in range(min_k, max_k + 1)}

    # ------------------------------------------------------------------ what was seen

    def observe_verification(self, results: Iterable[tuple[str, int, int]]) -> None:
        """One step's verified drafts: ``(request id, drafts scored, drafts accepted)``; 0
        drafts scored: the request was asked for drafts and its proposer found none (n-gram,
        suffix), which costs nothing to verify and says nothing of its drafts' acceptance.
        The counts decay with each step that verified something, not with steps of length 0:
        while nothing is drafted the estimates keep what was last seen (decaying towards the
        priors instead, a rarely drafting controller would come to judge drafts by their
        priors and start drafting again on no evidence)."""
        results = list(results)
        if not results:
            return
        for counts in (*self._positions, self._found):
            counts.tried *= self.decay
            counts.accepted *= self.decay
        for req_id, drafts, accepted in results:
            self._found.tried += 1.0
            if drafts <= 0:
                continue
            self._found.accepted += 1.0
            accepted = max(0, min(accepted, drafts))
            # Positions 1..accepted were accepted; the next one (if any) was tried and lost.
            for j in range(min(accepted + 1, drafts)):
                self._positions[j].tried += 1.0
                if j < accepted:
                    self._positions[j].accepted += 1.0
            own = self._requests.setdefault(req_id, _Counts())
            own.tried += min(accepted + 1, drafts)
            own.accepted += accepted

    def observe_step(self, num_requests: int, k_max: int, seconds: float) -> None:
        """A decode step's wall time and number of requests, where every request verified
        ``k_max`` drafts (the step before drafted that length for all) and drafted ``k_max``
        (a step that verifies trimmed or other-length drafts is neither length's)."""
        self.times.observe(num_requests, k_max, seconds)

    def forget_request(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    # ------------------------------------------------------------------ estimates

    def position_rates(self) -> list[float]:
        """Global acceptance rate of each draft position, given the earlier ones accepted.
        Each position's counts are pulled towards the rate of the position before it (a few
        pseudo-observations; the first towards one half): a position seldom drafted (the
        lengths chosen stop short of it) is judged like its neighbour until it is tried,
        instead of keeping a start-up guess that keeps it from being tried."""
        rates, prior = [], 0.5
        for counts in self._positions:
            prior = ((counts.accepted + self.position_prior * prior)
                     / (counts.tried + self.position_prior))
            rates.append(prior)
        return rates

    def _global_rate(self) -> float:
        """Over all positions (with the first position's pseudo-observations)."""
        tried = sum(c.tried for c in self._positions) + self.position_prior
        return (sum(c.accepted for c in self._positions) + 0.5 * self.position_prior) / tried

    def expected_tokens(self) -> list[float]:
        """``[k]``: the tokens a request emits in a step that verifies ``k`` drafts (global
        rates), for k from 0 to ``max_k``: the bonus token and each draft whose predecessors
        were accepted with it, where its proposer finds drafts."""
        return _expected(self.chain_probabilities(), self._found_share())

    def _found_share(self) -> float:
        """Of the requests asked for drafts, the share whose proposer found any."""
        return self._found.accepted / self._found.tried

    def chain_probabilities(self, req_id: str | None = None) -> list[float]:
        """``p[j-1]``: the chance the request's first ``j`` drafts are all accepted."""
        return self._chain(req_id, self.position_rates(), self._global_rate())

    def _chain(self, req_id: str | None, rates: list[float], overall: float) -> list[float]:
        scale = 1.0
        own = self._requests.get(req_id) if req_id is not None else None
        if own is not None and overall > 0:
            blended = ((own.accepted + self.request_prior * overall)
                       / (own.tried + self.request_prior))
            scale = blended / overall
        chain, p = [], 1.0
        for rate in rates:
            p *= min(rate * scale, 0.999)
            chain.append(p)
        return chain

    # ------------------------------------------------------------------ the choice

    def choose(self, req_ids: list[str], full: Iterable[str] = ()
               ) -> tuple[int, dict[str, int]]:
        """``(k_max, {request id: count})`` for the next step of these decoding requests;
        those in ``full`` draft ``max_k`` whatever the choice, and so the proposer too (a
        seeded sampled request: which random draws verify its drafts depends on how many it
        has, so only a fixed count gives the same tokens from run to run)."""
        if not req_ids:
            return self.min_k, {}
        k_max, counts = self._choose(req_ids)
        full = [r for r in full if r in counts]
        if full:
            k_max = self.max_k
            counts.update((r, self.max_k) for r in full)
        self.chosen[k_max] = self.chosen.get(k_max, 0) + 1
        return k_max, counts

    def _choose(self, req_ids: list[str]) -> tuple[int, dict[str, int]]:
        bucket = StepTimes.bucket(len(req_ids))
        steps = self._steps[bucket] = self._steps.get(bucket, 0) + 1
        # Lengths still to run in this range: calibration at first, then explorations.
        todo = self._calibration.setdefault(bucket, [
            k for k in range(self.min_k, self.max_k + 1)
            for _ in range(self.calibration_rounds)])
        if todo:
            k_max = todo.pop(0)
            counts = {r: k_max for r in req_ids}
        else:
            found = self._found_share()
            seconds = {k: t for k in range(self.min_k, self.max_k + 1)
                       if (t := self.times.per_request(len(req_ids), k))}
            positions, overall = self.position_rates(), self._global_rate()  # once per step
            k_max, rates, best = self._pick(self._chain(None, positions, overall), found,
                                            seconds)
            if self.explore_every and steps >= self._next_explore.setdefault(
                    bucket, self.explore_every) and (
                    explored := self._explore(bucket, steps, k_max, rates, best)) is not None:
                k_max = explored
                todo.append(k_max)  # two steps of it: the second one is timed
                counts = {r: k_max for r in req_ids}
            elif self.ragged and (draft_cost := _draft_seconds(seconds)) is not None:
                # Each request: the drafts whose expected tokens per second of verification
                # beat the step's rate, at most k_max (requests that accept as the batch
                # does keep k_max); its chain only falls, so those are its first drafts.
                bar = rates[k_max] * draft_cost
                counts = {r: max(self.min_k, sum(found * p >= bar for p in
                                                 self._chain(r, positions, overall)[:k_max]))
                          for r in req_ids}
            else:  # one length for all, or no draft's own cost known yet
                counts = {r: k_max for r in req_ids}
        return k_max, counts

    def _explore(self, bucket: int, steps: int, choice: int, rates: dict[int, float],
                 best: float) -> int | None:
        """The length to look at in this step instead of ``choice`` (drafted in full by
        every request: its time and its acceptance are measured, not inferred from a choice
        that avoids them), or None where none is due. Of the lengths due, the one due
        longest ago (of those due as long, the nearest to the choice)."""
        due = [(self._due.get((bucket, k), 0), abs(k - choice), k)
               for k in range(self.min_k, self.max_k + 1) if k != choice]
        due = [entry for entry in due if entry[0] <= steps]
        if not due:
            return None
        k = min(due)[2]
        gap = self._explore_gap.get((bucket, k), self.explore_every)
        far = rates.get(k, best) < best / (1 + self.far_margin)
        gap = min(2 * gap, 8 * self.explore_every) if far else self.explore_every
        self._explore_gap[bucket, k], self._due[bucket, k] = gap, steps + gap
        self._next_explore[bucket] = steps + self.explore_every
        return k

    def _pick(self, chain: list[float], found: float, seconds: dict[int, float]
              ) -> tuple[int, dict[int, float], float]:
        """``(length, {length: expected tokens per second of request time}, the best of
        those)`` for requests whose first ``j`` drafts are all accepted with ``chain[j - 1]``
        where their proposer finds drafts (a ``found`` share of them); ``seconds``: each
        timed length's time per request. The shortest length within ``margin`` of the best
        (drafting on noise costs); ``max_k`` before any length is timed."""
        expected = _expected(chain, found)
        rates = {k: expected[k] / t for k, t in seconds.items()}
        best = max(rates.values(), default=0.0)
        pick = min((k for k, r in rates.items() if r >= best / (1 + self.margin)),
                   default=self.max_k)
        return pick, rates, best


def _draft_seconds(seconds: dict[int, float]) -> float | None:
    """The time per request that one more verified draft adds, at least 0: the least-squares
    slope of the time per request over the timed lengths from 1 (the proposer's pass, which
    length 0 skips and every other length pays alike, is left out: trimming one request's
    drafts does not save it), or None with fewer than two of them."""
    lengths = [k for k in seconds if k > 0]
    if len(lengths) < 2:
        return None
    fit = statistics.linear_regression(lengths, [seconds[k] for k in lengths])
    return max(fit.slope, 0.0)


def _expected(chain: list[float], found: float) -> list[float]:
    """Tokens per request-step at each length from 0: the bonus token, and each draft with
    its chance that it and those before it are accepted, where drafts are found."""
    expected = [1.0]
    for p in chain:
        expected.append(expected[-1] + found * p)
    return expected
