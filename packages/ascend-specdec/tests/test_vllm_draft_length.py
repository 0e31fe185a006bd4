"""The draft-length controller's vLLM glue: where the config hook installs its scheduler, the
bounds it checks, and what it reads from a step's output."""

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from ascend_core.config import AscendConfigError  # noqa: E402
from ascend_core.registry import CONFIG_HOOKS  # noqa: E402
from ascend_specdec import DRAFT_LENGTH_HOOK, register  # noqa: E402
from ascend_specdec.vllm.draft_length import (  # noqa: E402
    SCHEDULER,
    _verified,
    full_decode_graphs,
    install_draft_length_scheduler,
    skip_empty_draft_fetch,
)

ON = {"draft_length_config": {"dynamic": True}}


def config(k=3, additional=ON, dp=1, scheduler_cls=None, per_batch_size=None):
    spec = None if k is None else SimpleNamespace(
        num_speculative_tokens=k, num_speculative_tokens_per_batch_size=per_batch_size)
    return SimpleNamespace(
        speculative_config=spec, additional_config=additional,
        parallel_config=SimpleNamespace(data_parallel_size=dp),
        scheduler_config=SimpleNamespace(scheduler_cls=scheduler_cls))


def test_register_adds_the_config_hook():
    register()
    assert DRAFT_LENGTH_HOOK in CONFIG_HOOKS


def test_on_when_asked_for_with_a_method_configured():
    vllm_config = config()
    assert install_draft_length_scheduler(vllm_config)
    assert vllm_config.scheduler_config.scheduler_cls == SCHEDULER
    assert not install_draft_length_scheduler(config(k=None))


@pytest.mark.parametrize("kwargs", [
    {"additional": {}},  # off by default
    {"additional": {"draft_length_config": {"dynamic": False}}},
    {"dp": 2},  # ranks would choose different lengths and wait on each other
    {"scheduler_cls": "my.Scheduler"},
    {"per_batch_size": [(1, 8, 3), (9, 256, 1)]},  # vLLM's own static schedule
])
def test_left_to_vllm(kwargs):
    vllm_config = config(**kwargs)
    assert not install_draft_length_scheduler(vllm_config)
    assert vllm_config.scheduler_config.scheduler_cls == kwargs.get("scheduler_cls")


@pytest.mark.parametrize("bounds, message", [
    ({"max_num_speculative_tokens": 4},
     "additional_config key 'draft_length_config.max_num_speculative_tokens' is 4, more than "
     "speculative_config's num_speculative_tokens=3: use at most 3."),
    ({"min_num_speculative_tokens": 3, "max_num_speculative_tokens": 2},
     "additional_config key 'draft_length_config.min_num_speculative_tokens' is 3, more than "
     "the largest draft length 2: use 0 to 2."),
])
def test_bounds_beyond_the_configured_length_stop_the_start_in_one_line(bounds, message):
    with pytest.raises(AscendConfigError) as info:
        install_draft_length_scheduler(
            config(additional={"draft_length_config": {"dynamic": True, **bounds}}))
    assert str(info.value) == message


def test_a_step_reports_drafts_scored_and_accepted_per_request():
    scheduler_output = SimpleNamespace(
        scheduled_spec_decode_tokens={"a": [5, 6, 7], "b": [8, 9, -1], "c": [1], "gone": [2]},
        num_invalid_spec_tokens={"b": 1})
    runner_output = SimpleNamespace(
        req_id_to_index={"a": 0, "b": 1, "c": 2, "d": 3},
        sampled_token_ids=[[5, 6, 0], [8], [], [4]])
    # a: 3 drafts, 2 accepted (+ the bonus); b: 2 valid drafts, none accepted; c: no token
    # this step (e.g. a discarded one); "gone" is not in the output; d had no drafts.
    assert _verified(scheduler_output, runner_output) == [("a", 3, 2), ("b", 2, 0)]
    # d was asked for drafts and its proposer found none.
    assert _verified(scheduler_output, runner_output, asked=["d", "a"]) == [
        ("a", 3, 2), ("b", 2, 0), ("d", 0, 0)]
    nothing = SimpleNamespace(scheduled_spec_decode_tokens={}, num_invalid_spec_tokens=None)
    assert _verified(nothing, runner_output) == []


def test_full_decode_graphs_keep_the_configured_length():
    from vllm.config import CUDAGraphMode

    def graphs(mode, eager=False):
        return SimpleNamespace(compilation_config=SimpleNamespace(cudagraph_mode=mode),
                               model_config=SimpleNamespace(enforce_eager=eager))

    assert full_decode_graphs(graphs(CUDAGraphMode.FULL_DECODE_ONLY))
    assert not full_decode_graphs(graphs(CUDAGraphMode.FULL_DECODE_ONLY, eager=True))
    assert not full_decode_graphs(graphs(CUDAGraphMode.PIECEWISE))
    assert not full_decode_graphs(graphs(CUDAGraphMode.NONE))


@pytest.mark.parametrize("params, seeded", [
    ({"temperature": 0.8, "seed": 7}, True),
    ({"temperature": 0.8, "seed": None}, False),
    ({"temperature": 0.0, "seed": 7}, False),  # greedy: the same tokens at any length
])
def test_seeded_sampled_requests_keep_the_full_length(params, seeded):
    from ascend_specdec.vllm.draft_length import _seeded

    assert _seeded(SimpleNamespace(sampling_params=SimpleNamespace(**params))) is seeded
    assert not _seeded(SimpleNamespace(sampling_params=None))


def test_only_steps_that_verify_and_draft_one_length_for_every_request_are_timed():
    """A step's time covers verifying the drafts of the step before and drafting its own: it
    is one length's only where both steps gave every request that length."""
    from ascend_specdec.vllm.draft_length import DraftLengthMixin

    class Base:
        def __init__(self, vllm_config):
            self.vllm_config = vllm_config
            self.requests = {r: SimpleNamespace(num_computed_tokens=0, num_tokens_with_spec=1,
                                                sampling_params=None) for r in ("a", "b")}
            self.requests["c"] = SimpleNamespace(num_computed_tokens=0, num_tokens_with_spec=40,
                                                 sampling_params=None)

        def schedule(self):
            # The third step also holds the last 40-token chunk of a prompt ("c" samples
            # its first token then, as a decoding request does).
            prompt = {"c": 40} if len(timed_steps) == 2 else {}
            output = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1, **prompt},
                                     scheduled_spec_decode_tokens={})
            timed_steps.append(output)
            self._update_after_schedule(output)
            return output

        def _update_after_schedule(self, output):
            pass

        def update_from_output(self, output, runner_output):
            return {}

    class Scheduler(DraftLengthMixin, Base):
        pass

    timed_steps = []
    scheduler = Scheduler(config())
    script = iter([(2, {"a": 2, "b": 2}), (2, {"a": 2, "b": 2}), (2, {"a": 2, "b": 2}),
                   (2, {"a": 2, "b": 0}), (2, {"a": 2, "b": 2}), (3, {"a": 3, "b": 3}),
                   (3, {"a": 3, "b": 3}), (0, {"a": 0, "b": 0})])
    timed = []
    scheduler.draft_controller.choose = lambda req_ids, full=(): next(script)
    scheduler.draft_controller.observe_step = lambda n, k, seconds: timed.append((n, k))
    runner_output = SimpleNamespace(sampled_token_ids=[[1], [1]],
                                    req_id_to_index={"a": 0, "b": 1})
    for step in range(8):
        output = scheduler.schedule()
        output.num_invalid_spec_tokens = None
        output.finished_req_ids = set()
        scheduler.update_from_output(output, runner_output)
        scheduler.finish_step(0.0)  # the engine core's post_step
        assert output.num_spec_tokens_to_schedule == (2 if step < 5 else 3 if step < 7 else 0)
        assert scheduler.drafts_this_step == (step < 7)  # the engine fetches drafts or not
    # Timed: the second step (after a full 2) and the last (after a full 3); not the one
    # with a prompt's last chunk, the trimmed one, the one after it, nor the first 3 (it
    # verified 2s).
    assert timed == [(2, 2), (2, 3)]
    assert not scheduler._timed_steps and not scheduler._asked


def test_the_engine_fetches_no_drafts_after_a_step_of_length_0(monkeypatch):
    """vLLM's synchronous engine core asks the worker for drafts after every step; after a
    step the controller gave length 0 it does not (no request would keep one)."""
    from vllm.v1.engine.core import EngineCore

    monkeypatch.setattr(EngineCore, "post_step", EngineCore.post_step)  # undone after
    skip_empty_draft_fetch()
    skip_empty_draft_fetch()  # wraps once
    fetched, finished = [], []

    def take():
        time.sleep(0.05)  # the round trip to the worker
        fetched.append(1)
        return "d"

    core = SimpleNamespace(
        check_for_draft_tokens=True, async_scheduling=False,
        model_executor=SimpleNamespace(take_draft_token_ids=take),
        scheduler=SimpleNamespace(update_draft_token_ids=fetched.append,
                                  finish_step=finished.append))
    for drafts, executed, expected in ((False, True, []), (True, True, [1, "d"]),
                                       (False, False, [])):
        fetched.clear()
        core.scheduler.drafts_this_step = drafts
        EngineCore.post_step(core, executed)
        assert fetched == expected
    # The fetch's time goes to the scheduler's step time; a skipped fetch costs nothing.
    assert finished[0] < 0.05 <= finished[1] and finished[2] < 0.05
    del core.scheduler.drafts_this_step, core.scheduler.finish_step  # vLLM's scheduler
    EngineCore.post_step(core, True)
    assert fetched == [1, "d"]


def test_a_timed_steps_time_includes_the_fetch_of_its_drafts():
    from ascend_specdec.vllm.draft_length import DraftLengthMixin

    scheduler = DraftLengthMixin.__new__(DraftLengthMixin)
    observed = []
    scheduler.draft_controller = SimpleNamespace(
        observe_step=lambda n, k, seconds: observed.append((n, k, seconds)))
    scheduler._step_to_finish = (4, 1, 0.010)
    scheduler.finish_step(0.002)
    scheduler.finish_step(0.002)  # once
    assert observed == [(4, 1, pytest.approx(0.012))]
