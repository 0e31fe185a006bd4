"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from suffix trees of past tokens.

Imports no vLLM. Two kinds of tree, both of depth at most ``max_tree_depth``:

- a **per-request tree** over the request's prompt and its response so far, alive while the
  request runs;
- one **global tree** over the responses of the most recent ``max_cached_requests`` requests
  (running or finished), first in, first out: starting one request more removes the oldest
  request's counts from the tree, so its size stays bounded. ``max_cached_requests = 0`` turns
  the global tree off.

A tree node counts how often the token path from the root to it occurs in the sequences added
(every substring of at most ``max_tree_depth`` tokens is counted once per occurrence). To draft,
each suffix of the recent tokens (the *pattern*) that occurs in a tree, from one token up, is a
candidate match; from the matched node the draft follows the most frequent next token while the
path probability, the product of ``count(child) / count(continuations of node)``, stays at or
above ``min_token_prob``; a match of ``m`` tokens drafts at most ``floor(max_spec_factor * m)``
tokens and at most ``max_spec_tokens``. Of all candidates of both trees the draft with the largest
score (the sum of its tokens' path probabilities: the expected number of accepted tokens) wins;
on equal scores the longer match, then the per-request tree.

The cache has the interface vLLM's ``SuffixDecodingProposer`` drives (``start_request``,
``add_active_response``, ``speculate``, ``stop_request``, ``evict_cached_response``,
``active_requests``, ``cached_requests``), so vLLM's proposer loop runs on it unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np


class SuffixConfigError(ValueError):
    """A suffix-decoding parameter out of range."""


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # path probability after each token
    score: float = 0.0  # sum of probs: the expected number of accepted tokens
    match_len: int = 0  # tokens of the pattern the draft continues


class _Node:
    __slots__ = ("children", "continued", "count")

    def __init__(self) -> None:
        self.count = 0  # occurrences of the path root..node
        self.continued = 0  # of those, how many continue to a child (sum of children's counts)
        self.children: dict[int, _Node] = {}


def _tokens(values: Iterable[int] | np.ndarray) -> list[int]:
    if isinstance(values, np.ndarray):
        return values.astype(np.int64, copy=False).ravel().tolist()
    return [int(v) for v in values]


def _check_depth(max_depth: int) -> None:
    if not isinstance(max_depth, (int, np.integer)) or isinstance(max_depth, bool) \
            or max_depth < 1:
        raise SuffixConfigError(
            f"suffix tree depth must be an integer >= 1 (suffix_decoding_max_tree_depth), "
            f"got {max_depth!r}")


class SuffixTree:
    """Substring counts (up to ``max_depth`` tokens) of sequences that grow and can be removed."""

    def __init__(self, max_depth: int) -> None:
        _check_depth(max_depth)
        self.max_depth = int(max_depth)
        self.root = _Node()
        self.num_nodes = 1
        self._sequences: dict[Hashable, list[int]] = {}
        # Per sequence: the nodes ending its suffixes shorter than max_depth, longest first.
        self._open: dict[Hashable, list[_Node]] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._sequences

    def sequence(self, seq_id: Hashable) -> list[int]:
        return list(self._sequences[seq_id])

    def extend(self, seq_id: Hashable, tokens: Iterable[int] | np.ndarray) -> None:
        """Append tokens to a sequence (a new id starts a new one)."""
        sequence = self._sequences.setdefault(seq_id, [])
        open_nodes = self._open.setdefault(seq_id, [])
        root = self.root
        for token in _tokens(tokens):
            sequence.append(token)
            grown = []
            for node in (*open_nodes, root):
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = _Node()
                    self.num_nodes += 1
                child.count += 1
                node.continued += 1
                grown.append(child)
            if len(grown) == self.max_depth:
                grown.pop(0)  # that suffix reached the depth limit
            open_nodes = grown
        self._open[seq_id] = open_nodes

    def remove(self, seq_id: Hashable) -> None:
        """Take a sequence's counts out of the tree, deleting nodes no other sequence uses."""
        sequence = self._sequences.pop(seq_id)
        del self._open[seq_id]
        for start in range(len(sequence)):
            path = sequence[start:start + self.max_depth]
            node = self.root
            for depth, token in enumerate(path, start=1):
                child = node.children[token]
                child.count -= 1
                node.continued -= 1
                if child.count == 0:
                    # Only this occurrence passed through child: the rest of the path is
                    # its whole subtree.
                    del node.children[token]
                    self.num_nodes -= len(path) - depth + 1
                    break
                node = child

    def count(self, path: Sequence[int]) -> int:
        """Occurrences of a token path (0 if absent); the empty path counts suffix starts."""
        node = self._walk(_tokens(path))
        if node is None:
            return 0
        return node.continued if node is self.root else node.count

    def _walk(self, path: list[int]) -> _Node | None:
        node = self.root
        for token in path:
            node = node.children.get(token)
            if node is None:
                return None
        return node

    def speculate(self, pattern: Sequence[int] | np.ndarray, max_spec_tokens: int,
                  max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> SuffixDraft:
        """The best-scoring draft continuing a suffix of ``pattern`` (see the module's rule)."""
        pattern = _tokens(pattern)[-self.max_depth:]
        best = SuffixDraft()
        for match_len in range(1, len(pattern) + 1):
            node = self._walk(pattern[len(pattern) - match_len:])
            if node is None:
                break  # a longer suffix contains this one, so it does not occur either
            budget = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-9))
            if budget <= 0:
                continue
            draft = self._follow(node, budget, min_token_prob)
            draft.match_len = match_len
            if draft.token_ids and draft.score >= best.score:
                best = draft
        return best

    @staticmethod
    def _follow(node: _Node, budget: int, min_token_prob: float) -> SuffixDraft:
        draft = SuffixDraft()
        prob = 1.0
        while len(draft.token_ids) < budget and node.continued:
            # The most frequent continuation; the smaller token id on equal counts.
            token, child = max(node.children.items(), key=lambda item: (item[1].count, -item[0]))
            prob *= child.count / node.continued
            if prob < min_token_prob:
                break
            draft.token_ids.append(token)
            draft.probs.append(prob)
            draft.score += prob
            node = child
        return draft


class SuffixDecodingCache:
    """Per-request trees and the bounded global tree, driven by vLLM's suffix proposer."""

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000) -> None:
        _check_depth(max_tree_depth)
        if not isinstance(max_cached_requests, (int, np.integer)) \
                or isinstance(max_cached_requests, bool) or max_cached_requests < 0:
            raise SuffixConfigError(
                "max_cached_requests (suffix_decoding_max_cached_requests) must be an integer "
                f">= 0 (0 turns the global tree off), got {max_cached_requests!r}")
        self.max_tree_depth = int(max_tree_depth)
        self.max_cached_requests = int(max_cached_requests)
        self.global_tree = SuffixTree(self.max_tree_depth)
        self._local_trees: dict[Hashable, SuffixTree] = {}
        self._cached: OrderedDict[Hashable, None] = OrderedDict()  # oldest first

    @property
    def active_requests(self) -> set:
        return set(self._local_trees)

    @property
    def cached_requests(self) -> set:
        """Requests whose response is counted in the global tree (running or finished)."""
        return set(self._cached)

    def start_request(self, req_id: Hashable, prompt_token_ids: Sequence[int] | np.ndarray
                      ) -> None:
        if req_id in self._local_trees:
            raise ValueError(f"suffix decoding: request {req_id!r} is already running")
        if req_id in self._cached:
            raise ValueError(f"suffix decoding: request {req_id!r} still has a cached response; "
                             "evict_cached_response it before starting it again")
        local = SuffixTree(self.max_tree_depth)
        local.extend(0, prompt_token_ids)
        self._local_trees[req_id] = local
        if self.max_cached_requests:
            self._cached[req_id] = None
            self.global_tree.extend(req_id, ())
            while len(self._cached) > self.max_cached_requests:
                self.evict_cached_response(next(iter(self._cached)))

    def add_active_response(self, req_id: Hashable, token_ids: Sequence[int] | np.ndarray
                            ) -> None:
        tokens = _tokens(token_ids)
        self._local_tree(req_id).extend(0, tokens)
        if req_id in self._cached:
            self.global_tree.extend(req_id, tokens)

    def stop_request(self, req_id: Hashable) -> None:
        """The request finished: drop its tree; its response stays in the global tree."""
        self._local_tree(req_id)
        del self._local_trees[req_id]

    def evict_cached_response(self, req_id: Hashable) -> None:
        if req_id not in self._cached:
            raise KeyError(f"suffix decoding: request {req_id!r} has no cached response")
        del self._cached[req_id]
        self.global_tree.remove(req_id)

    def speculate(self, req_id: Hashable, pattern: Sequence[int] | np.ndarray,
                  max_spec_tokens: int, max_spec_factor: float = 1.0,
                  min_token_prob: float = 0.1) -> SuffixDraft:
        if max_spec_tokens <= 0:
            return SuffixDraft()
        pattern = _tokens(pattern)
        best = self._local_tree(req_id).speculate(pattern, max_spec_tokens, max_spec_factor,
                                                  min_token_prob)
        if self.max_cached_requests:
            other = self.global_tree.speculate(pattern, max_spec_tokens, max_spec_factor,
                                               min_token_prob)
            if (other.score, other.match_len) > (best.score, best.match_len):
                best = other
        return best

    def _local_tree(self, req_id: Hashable) -> SuffixTree:
        tree = self._local_trees.get(req_id)
        if tree is None:
            raise KeyError(f"suffix decoding: request {req_id!r} is not running "
                           "(start_request it first)")
        return tree


def check_speculation_parameters(max_spec_factor: float, min_token_prob: float) -> None:
    if not max_spec_factor >= 0:
        raise SuffixConfigError(
            f"suffix_decoding_max_spec_factor must be >= 0, got {max_spec_factor!r}")
    if not 0 <= min_token_prob <= 1:
        raise SuffixConfigError(
            f"suffix_decoding_min_token_prob must be in [0, 1], got {min_token_prob!r}")


def suffix_proposer_factory(vllm_config, device, runner):
    """What ascend-core's model runners call for method "suffix" (vLLM is imported here)."""
    from ascend_specdec.vllm.suffix_proposer import AscendSuffixProposer

    return AscendSuffixProposer(vllm_config, device, runner)
