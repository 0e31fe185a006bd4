"""Suffix trees: counts, depth bound, removal, the cache's FIFO bound, and drafts."""

from collections import Counter

import numpy as np
import pytest

from ascend_specdec.suffix import (
    SuffixConfigError,
    SuffixDecodingCache,
    SuffixTree,
    check_speculation_parameters,
)


def substring_counts(sequences, depth):
    counts = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(start + depth, len(seq)) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def tree_counts(tree):
    counts = Counter()

    def visit(node, path):
        for token, child in node.children.items():
            assert child.count > 0
            assert node.continued == sum(c.count for c in node.children.values())
            counts[path + (token,)] = child.count
            visit(child, path + (token,))

    visit(tree.root, ())
    return counts


def test_counts_every_substring_up_to_the_depth_even_when_built_in_pieces():
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 4, size=n).tolist() for n in (0, 1, 7, 30, 55)]
    tree = SuffixTree(max_depth=5)
    for i, seq in enumerate(sequences):
        cut = len(seq) // 3
        tree.extend(i, seq[:cut])
        tree.extend(i, np.array(seq[cut:], dtype=np.int32))
    expected = substring_counts(sequences, 5)
    assert tree_counts(tree) == expected
    assert max(len(path) for path in expected) == 5
    assert tree.num_nodes == 1 + len(expected)
    assert tree.count([1, 2]) == expected[(1, 2)]
    assert tree.count([]) == sum(len(s) for s in sequences)


def test_removal_leaves_exactly_the_other_sequences():
    rng = np.random.default_rng(1)
    sequences = {i: rng.integers(0, 3, size=40).tolist() for i in range(6)}
    tree = SuffixTree(max_depth=6)
    for i, seq in sequences.items():
        tree.extend(i, seq)
    for gone in (2, 0, 5):
        tree.remove(gone)
        del sequences[gone]
        expected = substring_counts(sequences.values(), 6)
        assert tree_counts(tree) == expected
        assert tree.num_nodes == 1 + len(expected)
    for i in list(sequences):
        tree.remove(i)
    assert tree.num_nodes == 1 and not tree.root.children and tree.root.continued == 0


def test_draft_follows_the_most_frequent_continuation_with_its_probability():
    tree = SuffixTree(max_depth=8)
    tree.extend("a", [1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4])
    draft = tree.speculate([9, 1, 2, 3], max_spec_tokens=4, min_token_prob=0.0)
    # After [1, 2, 3]: 4 twice, 5 once (the trailing [1, 2, 3, 4] ends the sequence).
    assert draft.match_len == 3
    assert draft.token_ids[0] == 4
    assert draft.probs[0] == pytest.approx(2 / 3)
    assert draft.score == pytest.approx(sum(draft.probs))
    # Path probabilities only fall; min_token_prob cuts the draft where they drop below it.
    assert all(a >= b for a, b in zip(draft.probs, draft.probs[1:]))
    # The match of 3 tokens allows 3 (max_spec_factor 1); every step keeps 2/3.
    assert tree.speculate([9, 1, 2, 3], 4, min_token_prob=0.6).token_ids == [4, 1, 2]
    assert tree.speculate([9, 1, 2, 3], 4, min_token_prob=0.7).token_ids == []
    tree.extend("b", [1, 2, 3, 4, 6])
    # After [1, 2, 3, 4]: 1 once, 6 once (1 wins the tie by its smaller id): 3/4 * 1/2.
    cut = tree.speculate([9, 1, 2, 3], max_spec_tokens=4, min_token_prob=0.5)
    assert cut.token_ids == [4]
    assert cut.probs == pytest.approx([3 / 4])
    longer = tree.speculate([9, 1, 2, 3], max_spec_tokens=4, min_token_prob=0.3)
    assert longer.token_ids == [4, 1, 2] and longer.probs == pytest.approx([3 / 4, 3 / 8, 3 / 8])


def test_spec_factor_limits_the_draft_by_the_match_length():
    tree = SuffixTree(max_depth=16)
    tree.extend(0, list(range(10)) * 2)
    assert tree.speculate([3], max_spec_tokens=8).token_ids == [4]
    assert tree.speculate([2, 3], max_spec_tokens=8).token_ids == [4, 5]
    assert tree.speculate([2, 3], max_spec_tokens=8, max_spec_factor=2).token_ids == [4, 5, 6, 7]
    assert tree.speculate([2, 3], max_spec_tokens=3, max_spec_factor=2).token_ids == [4, 5, 6]
    assert tree.speculate([2, 3], max_spec_tokens=8, max_spec_factor=0).token_ids == []
    assert tree.speculate([42], max_spec_tokens=8).token_ids == []


def test_cache_drafts_from_the_request_itself_and_from_past_responses():
    cache = SuffixDecodingCache(max_tree_depth=12, max_cached_requests=4)
    cache.start_request("old", [100, 101])
    cache.add_active_response("old", [7, 8, 9, 10, 11, 12])
    cache.stop_request("old")
    assert cache.active_requests == set() and cache.cached_requests == {"old"}

    cache.start_request("new", [50, 51, 52, 50, 51])
    assert cache.active_requests == {"new"}
    # From its own prompt: [50, 51] was followed by 52.
    assert cache.speculate("new", [50, 51], 3).token_ids == [52, 50]
    # From the global tree: another request answered 8, 9, 10 after 7.
    cache.add_active_response("new", [7, 8])
    draft = cache.speculate("new", [50, 51, 7, 8], max_spec_tokens=3)
    assert draft.token_ids == [9, 10]
    assert cache.speculate("new", [7, 8], 0).token_ids == []


def test_global_tree_is_bounded_by_fifo_eviction_of_the_oldest_requests():
    rng = np.random.default_rng(2)
    limit = 3
    cache = SuffixDecodingCache(max_tree_depth=5, max_cached_requests=limit)
    responses = {}
    for i in range(8):
        cache.start_request(i, rng.integers(0, 50, size=5))
        responses[i] = rng.integers(0, 6, size=int(rng.integers(5, 30))).tolist()
        cache.add_active_response(i, responses[i][:3])
        cache.add_active_response(i, responses[i][3:])
        if i % 2:
            cache.stop_request(i)
        kept = list(range(max(0, i + 1 - limit), i + 1))
        assert sorted(cache.cached_requests) == kept
        assert tree_counts(cache.global_tree) == substring_counts(
            [responses[j] for j in kept], 5)
    assert cache.active_requests == {0, 2, 4, 6}
    # An evicted request that is still running keeps drafting from its own tree only.
    cache.add_active_response(0, [1, 2, 3])
    assert 0 not in cache.global_tree
    # A finished, cached request starting again must be evicted first (vLLM's proposer does).
    with pytest.raises(ValueError, match="still has a cached response"):
        cache.start_request(7, [1])
    cache.evict_cached_response(7)
    cache.start_request(7, [1])


def test_zero_cached_requests_turns_the_global_tree_off():
    cache = SuffixDecodingCache(max_tree_depth=8, max_cached_requests=0)
    cache.start_request("a", [1])
    cache.add_active_response("a", [4, 5, 6])
    cache.stop_request("a")
    cache.start_request("b", [4, 5])
    assert cache.cached_requests == set() and cache.global_tree.num_nodes == 1
    assert cache.speculate("b", [4, 5], 3).token_ids == []


def test_unknown_requests_and_bad_parameters_are_clear_errors():
    cache = SuffixDecodingCache(max_tree_depth=4, max_cached_requests=2)
    with pytest.raises(KeyError, match="'x' is not running"):
        cache.add_active_response("x", [1])
    with pytest.raises(KeyError, match="'x' has no cached response"):
        cache.evict_cached_response("x")
    cache.start_request("x", [1])
    with pytest.raises(ValueError, match="'x' is already running"):
        cache.start_request("x", [1])
    with pytest.raises(SuffixConfigError, match="integer >= 1 .* got 0"):
        SuffixDecodingCache(max_tree_depth=0)
    with pytest.raises(SuffixConfigError, match=">= 0 .* got -1"):
        SuffixDecodingCache(max_cached_requests=-1)
    with pytest.raises(SuffixConfigError, match="min_token_prob must be in \\[0, 1\\], got 1.5"):
        check_speculation_parameters(1.0, 1.5)
    with pytest.raises(SuffixConfigError, match="max_spec_factor must be >= 0, got -1"):
        check_speculation_parameters(-1, 0.1)
