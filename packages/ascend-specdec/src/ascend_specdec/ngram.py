"""N-gram (prompt lookup) drafting, vectorised over a batch with numpy. Imports no vLLM.

The rule is vLLM's ``NgramProposer`` exactly, so drafts are equal on the same history:

- the suffix to look up is the last ``n`` tokens, ``min_n <= n <= max_n``; the longest ``n``
  that occurs earlier wins;
- "earlier" means an occurrence that ends before the last token (it may overlap the suffix);
  among occurrences of the winning length, the earliest one (smallest start) is used;
- the draft is what followed that occurrence: up to ``k`` tokens, fewer where the history
  ends first, and never past ``max_model_len - len(history)`` tokens;
- a history shorter than ``min_n`` drafts nothing.

vLLM finds the occurrence with a KMP scan over the reversed history, one request at a time in
numba. Here every request of the batch is searched at once: the candidate end positions of a
match are the earlier places of the last token; each round keeps those whose match extends by
one more token backwards. On text that does not repeat much, the candidates thin out after a
round or two, so a batch costs about one comparison over its tokens. On repetitive text they
do not, but there a full ``max_n`` match is usually among a row's first candidates: those are
tried first and settle the row. What stays expensive (``max_n`` rounds over many candidates) is
text where many places match the suffix for almost, but not quite, ``max_n`` tokens.
benchmarks/bench_ngram.py compares it with vLLM's on vLLM's benchmark setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Candidates per row tried at full length before the round-by-round search.
PROBES = 4


class NgramConfigError(ValueError):
    """Lookup lengths or draft length out of range."""


@dataclass(frozen=True)
class NgramConfig:
    min_n: int
    max_n: int
    k: int
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        for name in ("min_n", "max_n", "k"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise NgramConfigError(f"n-gram {name} must be an integer >= 1, got {value!r}")
        if self.min_n > self.max_n:
            raise NgramConfigError(
                f"n-gram min_n={self.min_n} is larger than max_n={self.max_n}; "
                "min_n must be <= max_n (vLLM: prompt_lookup_min <= prompt_lookup_max)")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise NgramConfigError(
                f"max_model_len must be >= 1 or None, got {self.max_model_len!r}")


def propose_batch(config: NgramConfig, token_ids: np.ndarray, num_tokens: np.ndarray,
                  rows: Sequence[int] | np.ndarray | None = None,
                  k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Drafts for ``rows`` of a padded batch of histories.

    token_ids: [batch, width], row ``r`` holding its history in ``[:num_tokens[r]]``;
    rows: the rows to draft for (default: all); k: at most ``config.k`` (default).
    Returns ``drafts [len(rows), k]`` (int32, zero beyond each length) and ``lengths``.
    """
    k = config.k if k is None else k
    if not 0 <= k <= config.k:
        raise NgramConfigError(f"k={k} is outside 0..{config.k} (the configured draft length)")
    token_ids = np.asarray(token_ids)
    if token_ids.ndim != 2:
        raise NgramConfigError(f"token_ids must be [batch, width], got shape {token_ids.shape}")
    num_tokens = np.asarray(num_tokens)
    rows = np.arange(token_ids.shape[0]) if rows is None else np.asarray(rows, dtype=np.intp)
    drafts = np.zeros((rows.size, k), dtype=np.int32)
    lengths = np.zeros(rows.size, dtype=np.int32)
    if rows.size == 0 or k == 0:
        return drafts, lengths

    total = num_tokens[rows].astype(np.int64)
    if np.any(total > token_ids.shape[1]):
        bad = int(rows[np.argmax(total > token_ids.shape[1])])
        raise NgramConfigError(f"row {bad} claims {int(num_tokens[bad])} tokens, more than the "
                               f"{token_ids.shape[1]} columns of token_ids")
    budget = np.full(rows.size, k, dtype=np.int64)
    if config.max_model_len is not None:
        budget = np.minimum(budget, config.max_model_len - total)
    # A match needs an earlier occurrence, so at least min_n + 1 tokens.
    searched = np.flatnonzero((total > config.min_n) & (budget > 0))
    if searched.size == 0:
        return drafts, lengths

    total_s = total[searched]
    num = searched.size
    width = int(total_s.max())
    picked = rows[searched]
    if token_ids.flags.c_contiguous:
        # Gathers index the caller's buffer in place (vLLM's [max_num_reqs, max_model_len]).
        flat = token_ids.reshape(-1)
        row_start = picked.astype(np.int64) * token_ids.shape[1]
    else:
        flat = np.ascontiguousarray(token_ids[picked, :width]).reshape(-1)
        row_start = np.arange(num, dtype=np.int64) * width
    history = token_ids[picked[0]:picked[0] + num, :width] \
        if picked[-1] - picked[0] == num - 1 and np.all(np.diff(picked) == 1) \
        else token_ids[picked, :width]
    # tail[r, j]: the token j places before the last one (the suffix read backwards).
    depth = min(config.max_n, width)
    tail = flat[row_start[:, None] + np.maximum(total_s[:, None] - 1
                                                - np.arange(depth)[None, :], 0)]
    # Round 1: end positions e <= total - 2 holding the last token.
    mask = history == tail[:, :1]
    if np.all(total_s == width):
        mask[:, width - 1] = False
    else:
        mask &= np.arange(width)[None, :] <= (total_s - 2)[:, None]
    cand = np.flatnonzero(mask)  # row-major: rows ascending, ends ascending within a row
    cand_row = cand // width
    cand_end = cand - cand_row * width

    best_len = np.zeros(num, dtype=np.int64)
    best_end = np.zeros(num, dtype=np.int64)
    if depth == config.max_n and cand.size:
        # Repetitive rows keep many candidates through every round. Their answer is usually
        # among the first few: a match of max_n tokens, the earliest among those probed,
        # settles the row (no longer match exists, and no earlier candidate is that long).
        # Probed: the first candidates of each row that leave room for max_n tokens.
        first = np.searchsorted(cand, np.arange(num) * width + depth - 1)
        probe = (first[:, None] + np.arange(PROBES)[None, :]).ravel()
        owner = np.repeat(np.arange(num), PROBES)
        inside = probe < cand.size
        probe, owner = probe[inside], owner[inside]
        probe = probe[cand_row[probe] == owner]
        probe_row, probe_end = cand_row[probe], cand_end[probe]
        back = (row_start[probe_row] + probe_end)[:, None] - np.arange(depth)[None, :]
        whole = np.all(flat[back] == tail[probe_row], axis=1)
        settled, at = np.unique(probe_row[whole], return_index=True)
        if settled.size:
            best_len[settled] = depth
            best_end[settled] = probe_end[whole][at]
            is_settled = np.zeros(num, dtype=bool)
            is_settled[settled] = True
            keep = ~is_settled[cand_row]
            cand_row, cand_end = cand_row[keep], cand_end[keep]
    length = 1
    while cand_row.size:
        # Candidates come row-major with ascending ends: the first per row is the earliest.
        first = np.ones(cand_row.size, dtype=bool)
        first[1:] = cand_row[1:] != cand_row[:-1]
        best_len[cand_row[first]] = length
        best_end[cand_row[first]] = cand_end[first]
        if length == depth:
            break
        keep = cand_end >= length
        cand_row, cand_end = cand_row[keep], cand_end[keep]
        keep = flat[row_start[cand_row] + cand_end - length] == tail[cand_row, length]
        cand_row, cand_end = cand_row[keep], cand_end[keep]
        length += 1

    found = np.flatnonzero(best_len >= config.min_n)
    if found.size == 0:
        return drafts, lengths
    start = best_end[found] + 1
    count = np.minimum(budget[searched[found]], total_s[found] - start)
    offsets = np.arange(k)
    columns = np.minimum(start[:, None] + offsets[None, :], width - 1)
    values = history[found[:, None], columns]
    values = np.where(offsets[None, :] < count[:, None], values, 0)
    drafts[searched[found]] = values
    lengths[searched[found]] = count
    return drafts, lengths


def propose(config: NgramConfig, history: Sequence[int] | np.ndarray,
            k: int | None = None) -> list[int]:
    """The draft for one history (a list of token ids)."""
    history = np.asarray(history, dtype=np.int64).reshape(1, -1)
    drafts, lengths = propose_batch(config, history, np.array([history.shape[1]]), k=k)
    return drafts[0, : lengths[0]].tolist()


def propose_reference(config: NgramConfig, history: Sequence[int], k: int | None = None
                      ) -> list[int]:
    """The same rule, written plainly (the specification the tests hold both to)."""
    k = config.k if k is None else k
    tokens = list(history)
    total = len(tokens)
    if total < config.min_n:
        return []
    if config.max_model_len is not None:
        k = min(k, config.max_model_len - total)
    if k <= 0:
        return []
    for n in range(min(config.max_n, total - 1), config.min_n - 1, -1):
        suffix = tokens[total - n:]
        for start in range(0, total - n):
            if tokens[start:start + n] == suffix:
                follow = start + n
                return tokens[follow:follow + k]
    return []


def ngram_proposer_factory(vllm_config, device, runner):
    """What ascend-core's model runners call for method "ngram" (vLLM is imported here)."""
    from ascend_specdec.vllm.ngram_proposer import AscendNgramProposer

    return AscendNgramProposer(vllm_config, device, runner)
