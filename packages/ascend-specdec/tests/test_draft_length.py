"""The draft-length controller: calibration, the choice under cost and acceptance, per-request
counts, exploration, and its bounds."""

import statistics

import pytest

from ascend_specdec.draft_length import DraftLengthController, DraftLengthError, StepTimes

K = 3


def served(controller, req_ids, accept, seconds, steps=40):
    """Run ``steps`` steps: each request accepts its first ``accept[r]`` drafts (of those it
    got), a step of k drafts takes ``seconds(len(req_ids), k)``; the lengths chosen."""
    chosen = []
    for _ in range(steps):
        k_max, counts = controller.choose(req_ids)
        chosen.append(k_max)
        assert set(counts) == set(req_ids)
        assert all(controller.min_k <= c <= k_max for c in counts.values()), counts
        accepted = {r: min(accept[r], counts[r]) for r in req_ids}
        controller.observe_verification((r, counts[r], accepted[r]) for r in req_ids)
        controller.observe_step(len(req_ids), k_max, seconds(len(req_ids), k_max))
    return chosen


def test_first_steps_try_every_length_then_drafts_in_full_where_drafts_are_free():
    controller = DraftLengthController(max_k=K, calibration_rounds=2, explore_every=0)
    chosen = served(controller, ["a"], {"a": K}, lambda n, k: 0.01)
    assert chosen[:8] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert set(chosen[8:]) == {K}
    assert controller.chosen == {k: chosen.count(k) for k in range(K + 1)}


def test_no_drafts_when_none_are_accepted():
    controller = DraftLengthController(max_k=K, explore_every=0)
    chosen = served(controller, ["a", "b"], {"a": 0, "b": 0}, lambda n, k: 0.01 * (1 + k))
    assert set(chosen[-20:]) == {0}


def test_each_length_is_judged_at_its_own_time_even_below_a_shorter_ones():
    """Medusa at batch 1 on the host (an ad-hoc look, per-request ms): length 0 10.1,
    length 1 15.5, length 3 13.2; 1.0 / 1.34 / 1.49 / 1.52 tokens per step. Length 3 is the
    best (0.115 tokens per ms against 0.099); judged at length 1's time, as a rule that
    scoring more drafts never takes less time would, it loses to length 0."""
    times = {0: 0.0101, 1: 0.0155, 2: 0.0140, 3: 0.0132}
    controller = DraftLengthController(max_k=K, explore_every=0, calibration_rounds=1)
    # Positions accepted with 0.34, then 0.44, then 0.2 (after the ones before).
    results = ([("r", 3, 0)] * 66 + [("r", 3, 1)] * 19 + [("r", 3, 2)] * 12
               + [("r", 3, 3)] * 3) * 10
    controller.observe_verification(results)
    for _ in range(K + 1):  # calibration: one step of each length
        k_max, _ = controller.choose(["a"])
        controller.observe_step(1, k_max, times[k_max])
    expected = controller.expected_tokens()
    assert expected[3] / times[3] > 1.1 * expected[0] / times[0]
    assert expected[3] / times[1] < expected[0] / times[0]  # what the old rule saw
    assert controller.choose(["a"]) == (3, {"a": 3})


def test_the_length_follows_the_batch_size():
    """Small batches: a step costs the same whatever its length (a device's spare compute),
    so the first draft, accepted half the time, pays; the later ones are never accepted and
    are not drafted. Large batches: each draft token costs as much as a verified one, so
    drafts accepted half the time lose, and the controller stops drafting there."""
    controller = DraftLengthController(max_k=K, explore_every=0)
    small = [f"s{i}" for i in range(2)]
    large = [f"l{i}" for i in range(64)]
    # Half the requests accept their first draft, the other half none.
    accept = {r: i % 2 for i, r in enumerate(small + large)}

    def seconds(n, k):
        return 0.01 if n <= 2 else 0.01 * n * (1 + k) / 64

    # (A second draft is tried again now and then while its estimate decays to 0.)
    last = served(controller, small, accept, seconds)[-10:]
    assert set(last) <= {1, 2} and last.count(1) >= 7, last
    assert set(served(controller, large, accept, seconds)[-10:]) == {0}
    # The small batches' choice is kept: each batch-size range has its own times.
    assert set(served(controller, small, accept, seconds, steps=5)) <= {1, 2}


def test_a_request_whose_drafts_are_rejected_drafts_less_than_one_whose_drafts_are_accepted():
    controller = DraftLengthController(max_k=K, explore_every=0)
    batch = [f"r{i}" for i in range(8)]
    accept = {r: K if i < 4 else 0 for i, r in enumerate(batch)}

    def seconds(n, k):  # half the step is fixed, half grows with the tokens
        return 0.01 + 0.01 * (1 + k) / 4

    served(controller, batch, accept, seconds)
    k_max, counts = controller.choose(batch)
    assert k_max > 0
    assert min(counts[r] for r in batch[:4]) > max(counts[r] for r in batch[4:]), counts
    assert controller.chain_probabilities("r0")[0] > controller.chain_probabilities("r7")[0]


@pytest.mark.parametrize("costly", ["the proposer's pass", "each verified draft"])
def test_a_requests_drafts_are_trimmed_by_what_one_more_draft_costs(costly):
    """n-gram under load on the host (an ad-hoc look): the proposer's pass costs most of
    what a length costs over length 0 and each verified draft little, and trimming the
    drafts of requests that accepted less than the batch lost tokens for nothing (their
    drafts were scored almost for free, the pass ran anyway). A request whose drafts are
    accepted a third of the time keeps them where a draft costs little to verify (each
    length on its own would lose to length 0 for it: the old per-request rule) and loses
    them where each draft costs much."""
    if costly == "the proposer's pass":
        def per_request(k):
            return 0.001 if k == 0 else 0.0016 + 0.00002 * k
    else:
        def per_request(k):
            return 0.001 + 0.0004 * k
    batch = ["g0", "g1", "g2", "poor"]
    controller = DraftLengthController(max_k=K, explore_every=0, calibration_rounds=1)
    good = [(r, 3, 3) for r in batch[:3]]
    controller.observe_verification([*good, ("poor", 3, 1)] * 20 + [*good, ("poor", 3, 0)] * 20)
    for _ in range(K + 1):  # calibration: one step of each length
        k_max, _ = controller.choose(batch)
        controller.observe_step(len(batch), k_max, len(batch) * per_request(k_max))
    own = [1.0]
    for p in controller.chain_probabilities("poor"):
        own.append(own[-1] + p)
    k_max, counts = controller.choose(batch)
    assert k_max == K and all(counts[r] == K for r in batch[:3])
    if costly == "the proposer's pass":
        assert all(own[k] / per_request(k) < 1 / per_request(0) for k in range(1, K + 1))
        assert counts["poor"] == K
    else:
        assert counts["poor"] == 0


def explorations(chosen: list[int]) -> list[tuple[int, int]]:
    """``(1-based step, length)`` where a run of a length other than 0 (the choice) starts
    after the calibration."""
    return [(i + 1, k) for i, k in enumerate(chosen) if i > K and k and chosen[i - 1] != k]


def test_exploration_drafts_every_other_length_in_full_in_turns():
    controller = DraftLengthController(max_k=K, explore_every=4, calibration_rounds=1)
    batch = ["a", "b"]
    # Each draft costs 10% more than none and none is accepted: length 1 is within 15% of
    # length 0 (looked at every 4th step), lengths 2 and 3 are further (ever less often).
    chosen = served(controller, batch, {"a": 0, "b": 0}, lambda n, k: 0.01 * (1 + 0.1 * k),
                    steps=24)
    assert explorations(chosen) == [(5, 1), (9, 2), (13, 3), (17, 1), (21, 2)]
    assert chosen[4:7] == [1, 1, 0]  # two steps, then the choice again
    # The step due to explore (the 25th): lengths 1 and 3 are both due since step 21, and
    # the nearer one is looked at, every request drafting in full.
    k_max, counts = controller.choose(batch)
    assert k_max == 1 and set(counts.values()) == {1}


def test_a_length_far_below_the_choice_is_explored_ever_less_often():
    """Each draft doubles the step's time and none is accepted: the gap between looks at
    each length doubles, up to 8 x explore_every; no look is due at step 29."""
    controller = DraftLengthController(max_k=K, explore_every=4, calibration_rounds=1)
    chosen = served(controller, ["a", "b"], {"a": 0, "b": 0}, lambda n, k: 0.01 * (1 + k),
                    steps=100)
    assert explorations(chosen) == [
        (5, 1), (9, 2), (13, 3), (17, 1), (21, 2), (25, 3), (33, 1), (37, 2), (41, 3),
        (65, 1), (69, 2), (73, 3), (97, 1)]


def test_a_longer_length_is_found_past_a_neighbour_that_loses():
    """One draft loses to none (the proposer's pass costs the same for one draft as for
    three) while three win, and the first steps of lengths 2 and 3 were slow (one-off
    costs at start-up). Looking only at the neighbour of the choice, the controller would
    keep length 0; every length is looked at again, and length 3 is found."""
    first = set()

    def seconds(n, k):
        slow = k >= 2 and k not in first
        first.add(k)
        return 0.03 if slow else {0: 0.010, 1: 0.016, 2: 0.0165, 3: 0.017}[k]

    controller = DraftLengthController(max_k=K, explore_every=4, calibration_rounds=1)
    # One request accepts every draft, the other none: 1 / 1.5 / 2 / 2.5 tokens per step.
    chosen = served(controller, ["a", "b"], {"a": K, "b": 0}, seconds, steps=60)
    assert chosen[10] == 0  # after the calibration: length 0
    assert chosen[-10:].count(K) >= 8, chosen


def test_min_and_max_bound_every_choice():
    controller = DraftLengthController(max_k=2, min_k=1, explore_every=3)
    chosen = served(controller, ["a"], {"a": 0}, lambda n, k: 0.01 * (1 + k))
    assert set(chosen) == {1, 2}
    pinned = DraftLengthController(max_k=2, min_k=2)
    assert set(served(pinned, ["a"], {"a": 0}, lambda n, k: 0.01)) == {2}


def test_a_position_never_tried_is_judged_like_the_one_before_it():
    controller = DraftLengthController(max_k=K, decay=1.0)
    assert controller.position_rates() == [0.5, 0.5, 0.5]
    controller.observe_verification([("a", 2, 2)] * 30)  # position 3 never drafted
    rates = controller.position_rates()
    assert rates[0] > 0.95 and rates[2] == pytest.approx(rates[1])


def test_acceptance_estimates_hold_while_nothing_is_drafted():
    """Steps of length 0 verify nothing: the estimates keep what the last drafts showed
    (first drafts accepted a fifth of the time) instead of fading to the priors (one half),
    which would make length 1 look worth its time again on no evidence."""
    controller = DraftLengthController(max_k=K)
    controller.observe_verification([("a", 1, 1)] * 20 + [("a", 1, 0)] * 80)
    before = controller.position_rates()[0]
    for _ in range(2000):
        controller.observe_verification([])
    assert controller.position_rates()[0] == before < 0.25
    controller.observe_verification([("a", 1, 1)])  # a step with drafts decays the old ones
    assert controller.position_rates()[0] > before


def test_finished_requests_are_forgotten():
    controller = DraftLengthController(max_k=K)
    controller.observe_verification([("gone", 3, 0)])
    assert controller.chain_probabilities("gone") != controller.chain_probabilities(None)
    controller.forget_request("gone")
    assert controller.chain_probabilities("gone") == controller.chain_probabilities(None)


def test_acceptance_is_counted_per_position():
    controller = DraftLengthController(max_k=K, decay=1.0)
    # Three drafts, two accepted: positions 1 and 2 accepted, 3 tried and rejected.
    controller.observe_verification([("a", 3, 2)] * 30)
    rates = controller.position_rates()
    assert rates[0] > 0.9 and rates[1] > 0.9 and rates[2] < 0.1
    chain = controller.chain_probabilities("a")
    assert chain == sorted(chain, reverse=True) and chain[2] < 0.1


@pytest.mark.parametrize("kwargs, message", [
    ({"max_k": 0}, "max_k=0: the draft length must be an integer of at least 1"),
    ({"max_k": 2, "min_k": 3}, "min_k=3: must be an integer from 0 to max_k=2"),
    ({"max_k": 2, "min_k": -1}, "min_k=-1: must be an integer from 0 to max_k=2"),
])
def test_bad_bounds_are_refused_in_one_line(kwargs, message):
    with pytest.raises(DraftLengthError) as info:
        DraftLengthController(**kwargs)
    assert str(info.value) == message


def test_a_timed_step_is_kept_for_its_batch_size_range_and_length():
    """(Which steps are timed is the caller's part: test_vllm_draft_length.py.)"""
    controller = DraftLengthController(max_k=K)
    controller.observe_step(4, 2, 1.0)
    assert controller.times.table() == {(4, 2): (1.0, 0.25)}


def test_step_times_are_kept_per_batch_size_range():
    times = StepTimes(window=2)
    assert [StepTimes.bucket(n) for n in (1, 2, 3, 4, 5, 64, 65)] == [1, 2, 4, 4, 8, 64, 128]
    times.observe(3, 1, 2.0)
    times.observe(4, 1, 4.0)  # same range as 3
    assert times.per_request(3, 1) == (2 / 3 + 1) / 2
    assert times.per_request(5, 1) is None
    times.observe(3, 1, float("nan"))
    times.observe(3, 1, -1.0)
    assert times.per_request(4, 1) == (2 / 3 + 1) / 2
    times.observe(3, 1, 1.0)  # the first step left the window of two
    assert times.per_request(4, 1) == (1 + 1 / 3) / 2
    assert times.table() == {(4, 1): (2.5, (1 + 1 / 3) / 2)}


def test_a_steps_fixed_part_is_fitted_and_each_length_judged_at_the_batch_size():
    """Steps cost 8 ms plus 0.5 ms per request at length 0, 0.8 ms at length 1. Length 0 is
    timed over a range's whole spread (a round's tail: 9 to 16 requests), length 1 only in
    full batches: per request over the steps as they came, length 0 read dearer than it is
    at 16 requests."""
    times = StepTimes()
    for n in (9, 10, 11, 12, 13, 14, 15, 16, 16, 16):
        times.observe(n, 0, 0.008 + 0.0005 * n)
    for _ in range(4):
        times.observe(16, 1, 0.008 + 0.0008 * 16)
    assert times.fixed() == pytest.approx(0.008)
    assert times.per_request(16, 0) == pytest.approx(0.008 / 16 + 0.0005)
    assert times.per_request(12, 1) == pytest.approx(0.008 / 12 + 0.0008)
    # First drafts accepted a fifth of the time (1.2 tokens per request-step at length 1):
    # the controller drafts nothing for 16 requests, where judging length 0 by its steps'
    # median time per request, as it came, would have drafted.
    controller = DraftLengthController(max_k=1, explore_every=0, calibration_rounds=0)
    controller.times = times
    controller.observe_verification([("a", 1, 1)] * 20 + [("a", 1, 0)] * 80)
    expected = controller.expected_tokens()
    assert controller.choose([f"r{i}" for i in range(16)])[0] == 0
    as_they_came = statistics.median(
        (0.008 + 0.0005 * n) / n for n in (9, 10, 11, 12, 13, 14, 15, 16, 16, 16))
    assert expected[1] / times.per_request(16, 1) > expected[0] / as_they_came


def test_the_fixed_part_stays_within_the_recorded_steps():
    times = StepTimes()
    times.observe(3, 1, 2.0)
    times.observe(4, 1, 4.0)  # a line through both would cost -4 s at no requests
    assert times.fixed() == 0.0
    times = StepTimes()
    for n in (3, 4):
        times.observe(n, 0, 1.0 + 0.001 * n)  # nearly flat: a fitted part of 1 s
    assert times.fixed() == pytest.approx(0.9 * 1.003)  # kept below the cheapest step


def test_requests_that_need_the_full_length_keep_it():
    controller = DraftLengthController(max_k=K, explore_every=0)
    served(controller, ["a", "b"], {"a": 0, "b": 0}, lambda n, k: 0.01 * (1 + k))
    assert controller.choose(["a", "b"]) == (0, {"a": 0, "b": 0})
    assert controller.choose(["a", "b"], full=["b", "not running"]) == (K, {"a": 0, "b": K})


def test_a_step_without_decoding_requests_chooses_nothing_and_is_not_counted():
    controller = DraftLengthController(max_k=K, min_k=1)
    assert controller.choose([]) == (1, {})
    assert sum(controller.chosen.values()) == 0


def test_requests_whose_proposer_finds_no_drafts_lower_the_yield_not_the_acceptance():
    """n-gram / suffix: a request asked for drafts that found none (0 scored) emits one token;
    the drafts that were found are judged on their own."""
    controller = DraftLengthController(max_k=K, decay=1.0)
    controller.observe_verification([("a", 3, 3)] * 50)
    full = controller.expected_tokens()[K]
    controller.observe_verification([("b", 0, 0)] * 50)
    assert controller.chain_probabilities("b") == controller.chain_probabilities(None)
    assert controller.position_rates()[0] > 0.9
    assert controller.expected_tokens()[K] == pytest.approx(1 + (full - 1) * 51 / 101)
    assert controller.expected_tokens()[0] == 1.0
