"""The draft-length controller inside vLLM's scheduler (both targets).

vLLM 0.32 already lets its scheduler pick a step's draft length: ``SchedulerOutput.
num_spec_tokens_to_schedule`` is what every proposer drafts at the end of the step (vLLM's
static ``num_speculative_tokens_per_batch_size`` schedule fills it from the batch size), and
the model runners score whatever count each request brings. The scheduler here fills it from
``ascend_specdec.draft_length.DraftLengthController`` instead, from the acceptance it sees and
the step times it measures, and (with vLLM's synchronous scheduler) trims each request's new
drafts to that request's own count. So one mechanism serves every method (Medusa, EAGLE /
EAGLE-3 / MTP, n-gram, suffix) and both model runners.

The config hook (core's ``CONFIG_HOOKS``) installs it whenever speculation is configured and
``additional_config["draft_length_config"]["dynamic"]`` is on (off by default: see
``benchmarks/results/draft_length.md``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from ascend_specdec.draft_length import DraftLengthController

logger = logging.getLogger(__name__)

SCHEDULER = "ascend_specdec.vllm.draft_length.make_scheduler"


class _FromController:
    """Stands in for vLLM's batch-size lookup (``dynamic_sd_lookup``): a non-None lookup also
    turns off vLLM's padding of decode requests to the full draft length. The real choice is
    made in ``_update_after_schedule``, which sees the whole batch."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __getitem__(self, batch_size: int) -> int:
        return self.k


class DraftLengthMixin:
    """Mixed in before vLLM's ``Scheduler`` or ``AsyncScheduler``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        min_k, max_k = draft_length_bounds(self.vllm_config)
        # Per-request counts reach the drafts through update_draft_token_ids, which vLLM
        # calls with the synchronous scheduler only.
        self.draft_controller = DraftLengthController(
            max_k=max_k, min_k=min_k, ragged=not isinstance(self, AsyncScheduler))
        self.dynamic_sd_lookup = _FromController(self.draft_controller.max_k)
        self._counts: dict[str, int] = {}
        # Per step in flight: the requests that were asked for drafts it verifies.
        self._asked: dict[int, list[str]] = {}
        self._decode_only = False
        # The length the last step drafted, or None where requests drafted different counts.
        self._last_k: int | None = None
        # Per step in flight that is timed (decode only, every request verifying and
        # drafting one length): when it was scheduled and how many requests it has.
        self._timed_steps: dict[int, tuple[float, int]] = {}
        self.drafts_this_step = True
        # A timed step's (requests, length, seconds) until the engine core has fetched its
        # drafts (finish_step).
        self._step_to_finish: tuple[int, int, float] | None = None
        logger.info("draft length: chosen every step from %d to %d draft tokens "
                    "(ascend_specdec.draft_length)", self.draft_controller.min_k,
                    self.draft_controller.max_k)

    def schedule(self, *args: Any, **kwargs: Any):
        start, verified = time.perf_counter(), self._last_k
        output = super().schedule(*args, **kwargs)
        if self._decode_only and verified is not None and verified == self._last_k:
            self._timed_steps[id(output)] = (start, len(output.num_scheduled_tokens))
        return output

    def _update_after_schedule(self, scheduler_output) -> None:
        decoding = [req_id for req_id, num in scheduler_output.num_scheduled_tokens.items()
                    if self.requests[req_id].num_computed_tokens + num
                    >= self.requests[req_id].num_tokens_with_spec]  # it samples this step
        # Steps with prefill chunks are not timed: their time is the prefill's. That includes
        # a prompt's last chunk (its request samples this step too): a timed step schedules
        # each request its one new token and its drafts, nothing more.
        spec = scheduler_output.scheduled_spec_decode_tokens
        self._decode_only = bool(decoding) and len(decoding) == len(
            scheduler_output.num_scheduled_tokens) and all(
            num == 1 + len(spec.get(req_id, ()))
            for req_id, num in scheduler_output.num_scheduled_tokens.items())
        self._asked[id(scheduler_output)] = [r for r in decoding if self._counts.get(r, 0)]
        seeded = [req_id for req_id in decoding if _seeded(self.requests[req_id])]
        k_max, self._counts = self.draft_controller.choose(decoding, full=seeded)
        scheduler_output.num_spec_tokens_to_schedule = k_max
        # Length 0: every request's drafts of this step would be trimmed to none, so the
        # engine need not fetch them (see skip_empty_draft_fetch).
        self.drafts_this_step = k_max > 0
        ragged = self.draft_controller.ragged and any(
            count != k_max for count in self._counts.values())
        self._last_k = None if ragged else k_max
        super()._update_after_schedule(scheduler_output)

    def update_from_output(self, scheduler_output, model_runner_output):
        self.finish_step()  # a step the engine core did not report on
        step = self._timed_steps.pop(id(scheduler_output), None)
        if step is not None:
            # Its time covers verifying the drafts it brought and drafting k_max new ones;
            # the engine core's fetch of those drafts follows (finish_step).
            self._step_to_finish = (step[1], scheduler_output.num_spec_tokens_to_schedule,
                                    time.perf_counter() - step[0])
        self.draft_controller.observe_verification(
            _verified(scheduler_output, model_runner_output, self._asked.pop(
                id(scheduler_output), ())))
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for req_id in scheduler_output.finished_req_ids:
            self.draft_controller.forget_request(req_id)
        return outputs

    def finish_step(self, fetch_seconds: float = 0.0) -> None:
        """The engine core's part after ``update_from_output`` (see skip_empty_draft_fetch):
        the timed step's time with the fetch of its drafts, which a step of length 0 skips
        (left out, a length's fetch would count for nothing and longer lengths look cheap)."""
        if self._step_to_finish is not None:
            num_requests, k_max, seconds = self._step_to_finish
            self._step_to_finish = None
            self.draft_controller.observe_step(num_requests, k_max, seconds + fetch_seconds)

    def update_draft_token_ids(self, draft_token_ids) -> None:
        """Each request keeps the first drafts of its own count. vLLM calls this with the
        synchronous scheduler only; async scheduling drafts one count for all."""
        draft_token_ids.draft_token_ids = [
            drafts[:self._counts.get(req_id, len(drafts))]
            for req_id, drafts in zip(draft_token_ids.req_ids,
                                      draft_token_ids.draft_token_ids, strict=True)]
        super().update_draft_token_ids(draft_token_ids)


def _seeded(request) -> bool:
    """A sampled request with its own seed: it keeps the configured draft length."""
    params = request.sampling_params
    return params is not None and params.seed is not None and params.temperature > 0


def _verified(scheduler_output, model_runner_output, asked=()):
    """``(request id, drafts scored, drafts accepted)`` for each request that had drafts, and
    ``(request id, 0, 0)`` for each one in ``asked`` (it was asked for drafts) that sampled
    without any (a proposer that found nothing: n-gram, suffix)."""
    if not model_runner_output.sampled_token_ids:
        return []
    scheduled = scheduler_output.scheduled_spec_decode_tokens or {}
    invalid = scheduler_output.num_invalid_spec_tokens or {}
    index = model_runner_output.req_id_to_index
    results = []
    for req_id in [*scheduled, *(r for r in asked if r not in scheduled)]:
        row = index.get(req_id)
        if row is None or row >= len(model_runner_output.sampled_token_ids):
            continue
        generated = model_runner_output.sampled_token_ids[row]
        if not generated:
            continue
        scored = len(scheduled.get(req_id, ())) - invalid.get(req_id, 0)
        results.append((req_id, scored, len(generated) - 1) if scored > 0
                       else (req_id, 0, 0))
    return results


class AscendDraftLengthScheduler(DraftLengthMixin, Scheduler):
    pass


class AscendAsyncDraftLengthScheduler(DraftLengthMixin, AsyncScheduler):
    pass


def make_scheduler(*args: Any, vllm_config, **kwargs: Any):
    """vLLM's ``scheduler_cls``: with the controller where it is on, the synchronous or async
    variant as vLLM resolved it; vLLM's own where it is off or FULL decode graphs are
    captured (npu: they are captured for the configured length only, and a batch of another
    length would run without them). A server of Medusa trees gets grammar masks per tree
    row (``medusa_tree.TreeGrammar``) either way."""
    async_scheduling = vllm_config.scheduler_config.async_scheduling
    controlled = controller_wanted(vllm_config)
    if controlled and full_decode_graphs(vllm_config):
        logger.info("draft length: fixed at %d, the length the FULL decode graphs hold",
                    vllm_config.speculative_config.num_speculative_tokens)
        controlled = False
    if controlled:
        cls = (AscendAsyncDraftLengthScheduler if async_scheduling
               else AscendDraftLengthScheduler)
        skip_empty_draft_fetch()
    else:
        cls = AsyncScheduler if async_scheduling else Scheduler
    scheduler = cls(*args, vllm_config=vllm_config, **kwargs)
    from ascend_specdec.vllm.medusa_tree import TreeGrammar, configured_tree

    tree = configured_tree(vllm_config)
    if tree is not None:
        scheduler.structured_output_manager = TreeGrammar(
            scheduler.structured_output_manager, tree)
    return scheduler


def skip_empty_draft_fetch() -> None:
    """With the synchronous scheduler, vLLM's engine core asks the worker for the step's
    drafts after every step (``EngineCore.post_step``: ``take_draft_token_ids``, one more
    round trip to the worker process). In a step whose length the controller chose 0 no
    request keeps a draft, so the engine core skips that fetch, and a length-0 step costs
    what a step without speculation costs (on a loaded 2-core host that round trip was
    most of what a `vllm serve` Medusa server drafting nothing lost to one without
    speculation). The fetch's time is the step's too: the scheduler's ``finish_step`` gets
    it. Wraps ``post_step`` once; a scheduler without ``drafts_this_step`` keeps vLLM's
    behaviour."""
    from vllm.v1.engine.core import EngineCore

    original = EngineCore.post_step
    if getattr(original, "_ascend_skips_empty_drafts", False):
        return

    def post_step(self, model_executed: bool) -> None:
        start = time.perf_counter()
        if not model_executed or getattr(self.scheduler, "drafts_this_step", True):
            original(self, model_executed)
        if finish := getattr(self.scheduler, "finish_step", None):
            finish(time.perf_counter() - start)

    post_step._ascend_skips_empty_drafts = True
    EngineCore.post_step = post_step


def full_decode_graphs(vllm_config) -> bool:
    mode = vllm_config.compilation_config.cudagraph_mode
    return (not vllm_config.model_config.enforce_eager and mode is not None
            and mode.has_full_cudagraphs())


def draft_length_settings(vllm_config):
    from ascend_core.config import AscendConfig

    return AscendConfig.from_dict(vllm_config.additional_config).draft_length_config


def draft_length_bounds(vllm_config) -> tuple[int, int]:
    """``(min_k, max_k)`` from ``draft_length_config``, checked against
    ``num_speculative_tokens``."""
    from ascend_core.config import AscendConfigError

    settings = draft_length_settings(vllm_config)
    configured = vllm_config.speculative_config.num_speculative_tokens
    max_k = settings.max_num_speculative_tokens or configured
    min_k = settings.min_num_speculative_tokens
    where = "additional_config key 'draft_length_config."
    if max_k > configured:
        raise AscendConfigError([
            f"{where}max_num_speculative_tokens' is {max_k}, more than speculative_config's "
            f"num_speculative_tokens={configured}: use at most {configured}."])
    if min_k > max_k:
        raise AscendConfigError([
            f"{where}min_num_speculative_tokens' is {min_k}, more than the largest draft "
            f"length {max_k}: use 0 to {max_k}."])
    return min_k, max_k


def _why_not_controlled(vllm_config) -> str | None:
    """Why vLLM's rules keep the draft length fixed although the controller is asked for."""
    if vllm_config.speculative_config.num_speculative_tokens_per_batch_size:
        return "speculative_config.num_speculative_tokens_per_batch_size is set"
    if vllm_config.parallel_config.data_parallel_size > 1:
        return "data-parallel ranks would choose different lengths"
    return None


def controller_wanted(vllm_config) -> bool:
    """Whether the draft length is the controller's: speculation configured,
    ``draft_length_config.dynamic`` on, and none of vLLM's rules against it."""
    spec = vllm_config.speculative_config
    return bool(spec is not None and spec.num_speculative_tokens
                and draft_length_settings(vllm_config).dynamic
                and _why_not_controlled(vllm_config) is None)


def install_draft_length_scheduler(vllm_config) -> bool:
    """Core's config hook: use the controller's scheduler where it applies; whether it did."""
    spec = vllm_config.speculative_config
    if spec is None or not spec.num_speculative_tokens:
        return False
    if not draft_length_settings(vllm_config).dynamic:
        logger.info("draft length: fixed at %d (draft_length_config.dynamic is off)",
                    spec.num_speculative_tokens)
        return False
    scheduler_config = vllm_config.scheduler_config
    why_not = _why_not_controlled(vllm_config)
    if why_not is None and scheduler_config.scheduler_cls not in (None, SCHEDULER):
        why_not = f"scheduler_cls is {scheduler_config.scheduler_cls!r}"
    if why_not:
        logger.info("draft length: fixed (vLLM's rules) because %s", why_not)
        return False
    draft_length_bounds(vllm_config)  # a bad bound stops the start here, in one line
    scheduler_config.scheduler_cls = SCHEDULER
    return True
