"""The n-gram proposer's rule, batched numpy against the plain reference and by hand."""

import numpy as np
import pytest

from ascend_specdec.ngram import (
    NgramConfig,
    NgramConfigError,
    propose,
    propose_batch,
    propose_reference,
)


def test_longest_suffix_wins_over_a_later_shorter_one():
    # Suffix [1, 2, 3]: the 3-gram occurs at 0 (then 7), the 2-gram [2, 3] also at 4 (then 9).
    history = [1, 2, 3, 7, 2, 3, 9, 1, 2, 3]
    assert propose(NgramConfig(min_n=2, max_n=3, k=2), history) == [7, 2]
    assert propose(NgramConfig(min_n=2, max_n=2, k=2), history) == [7, 2]  # earliest [2, 3]


def test_earliest_occurrence_of_the_winning_length():
    history = [5, 6, 1, 5, 6, 2, 5, 6]
    assert propose(NgramConfig(min_n=2, max_n=4, k=1), history) == [1]


def test_occurrence_may_overlap_the_suffix():
    # [4, 4, 4] occurs at 0 and 1 (overlapping the suffix at 2..4): the earliest is at 0.
    assert propose(NgramConfig(min_n=3, max_n=3, k=3), [4, 4, 4, 4, 4]) == [4, 4]


def test_draft_stops_at_k_at_the_end_and_at_max_model_len():
    history = [1, 2, 3, 4, 5, 6, 1, 2]
    assert propose(NgramConfig(1, 2, k=3), history) == [3, 4, 5]
    assert propose(NgramConfig(1, 2, k=3), history, k=2) == [3, 4]
    assert propose(NgramConfig(1, 2, k=3, max_model_len=10), history) == [3, 4]
    assert propose(NgramConfig(1, 2, k=3, max_model_len=8), history) == []
    assert propose(NgramConfig(1, 1, k=5), [9, 8, 9]) == [8, 9]


def test_no_match_short_history_and_too_long_min_n():
    assert propose(NgramConfig(1, 3, k=3), [1, 2, 3, 4]) == []
    assert propose(NgramConfig(3, 3, k=3), [1, 1]) == []
    assert propose(NgramConfig(3, 3, k=3), [1, 1, 1]) == []  # needs an earlier occurrence
    assert propose(NgramConfig(2, 3, k=3), [1, 2, 3, 1, 4, 2, 3]) == [1, 4, 2]
    assert propose(NgramConfig(3, 3, k=3), [1, 2, 3, 1, 4, 2, 3]) == []


@pytest.mark.parametrize("vocab", [2, 3, 20])
def test_batched_numpy_equals_the_reference_on_random_histories(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(40):
        min_n = int(rng.integers(1, 5))
        config = NgramConfig(min_n, int(rng.integers(min_n, 9)), int(rng.integers(1, 6)),
                             max_model_len=int(rng.integers(40, 70)))
        token_ids = rng.integers(0, vocab, size=(12, 64)).astype(np.int32)
        num_tokens = rng.integers(0, 65, size=12)
        rows = np.flatnonzero(rng.random(12) < 0.8)
        drafts, lengths = propose_batch(config, token_ids, num_tokens, rows)
        for j, row in enumerate(rows):
            expected = propose_reference(config, token_ids[row, :num_tokens[row]].tolist())
            assert drafts[j, :lengths[j]].tolist() == expected, (config, row)
            assert not drafts[j, lengths[j]:].any()


def test_repetitive_history_is_capped_at_max_n():
    history = [7] * 200 + [1, 2] * 50
    config = NgramConfig(2, 6, k=4)
    assert propose(config, history) == propose_reference(config, history) == [1, 2, 1, 2]


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_n=0, max_n=3, k=2), "min_n must be an integer >= 1, got 0"),
    (dict(min_n=4, max_n=3, k=2), "min_n=4 is larger than max_n=3"),
    (dict(min_n=1, max_n=3, k=0), "k must be an integer >= 1, got 0"),
    (dict(min_n=1, max_n=3, k=2, max_model_len=0), "max_model_len must be >= 1"),
])
def test_bad_configuration_is_a_clear_error(kwargs, message):
    with pytest.raises(NgramConfigError, match=message):
        NgramConfig(**kwargs)


def test_bad_call_is_a_clear_error():
    config = NgramConfig(1, 2, k=2)
    with pytest.raises(NgramConfigError, match="k=3 is outside 0..2"):
        propose(config, [1, 2, 1], k=3)
    with pytest.raises(NgramConfigError, match="claims 9 tokens, more than the 4 columns"):
        propose_batch(config, np.zeros((1, 4), dtype=np.int32), np.array([9]))
