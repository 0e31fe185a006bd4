"""Medusa's tree verification: the static candidate tree, its attention mask, and the
walk that verifies a scored tree (greedy and sampled). Imports no vLLM.

A tree is a list of paths, as in Medusa's papers: ``[0]`` is head 0's best candidate,
``[0, 1]`` head 1's second-best candidate following it, ``[2, 0, 0]`` three heads deep.
Every head reads the same hidden state (the last accepted token's), so a node's token is
the top-``path[-1]`` candidate of head ``len(path) - 1`` whatever its parents are.

Nodes are kept in breadth-first order (by depth, then path), so parents come before
children and the first ``m`` nodes of a tree are a tree themselves: a request verifying
``m`` draft tokens (the draft-length controller's choice) verifies that prefix.

A request verifies its last accepted token (the root, row 0) and its ``m`` nodes (rows
``1..m``): each row attends to the context, its ancestors and itself (``ancestor_mask``),
at position ``root + depth``. Node ``j``'s token is checked against the target's row of its
parent; the longest path of accepted nodes wins, and the next token comes from the row of
its last node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from ascend_specdec.medusa.config import MedusaConfigError

# Candidates a head may offer a tree: top-k of each head's logits, k at most this.
MAX_TOP_K = 16


@dataclass(frozen=True)
class MedusaTree:
    """A checked tree (build it with :func:`parse_tree`). ``paths`` in breadth-first order."""

    paths: tuple[tuple[int, ...], ...]

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def depth(self) -> int:
        return max(len(path) for path in self.paths)

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Each node's parent node index, -1 for the root."""
        index = {path: i for i, path in enumerate(self.paths)}
        return tuple(index[path[:-1]] if len(path) > 1 else -1 for path in self.paths)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        return tuple(len(path) for path in self.paths)

    @cached_property
    def top_k(self) -> tuple[int, ...]:
        """Candidates each head must offer: ``top_k[h]`` for head ``h`` (0 where unused)."""
        needed = [0] * self.depth
        for path in self.paths:
            needed[len(path) - 1] = max(needed[len(path) - 1], path[-1] + 1)
        return tuple(needed)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Node indices under each row: ``children[0]`` the root's, ``children[j + 1]``
        node ``j``'s, in path order."""
        rows: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for node, parent in enumerate(self.parents):
            rows[parent + 1].append(node)
        return tuple(tuple(row) for row in rows)

    @cached_property
    def _ancestors(self) -> torch.Tensor:
        mask = torch.zeros((self.num_nodes + 1, self.num_nodes + 1), dtype=torch.bool)
        mask[:, 0] = True
        for node, parent in enumerate(self.parents):
            mask[node + 1, node + 1] = True
            if parent >= 0:
                mask[node + 1] |= mask[parent + 1]
        return mask

    def ancestor_mask(self, num_nodes: int | None = None) -> torch.Tensor:
        """``[m + 1, m + 1]`` bool over the root and the first ``m`` nodes: row ``i`` may
        attend to column ``j`` when ``j`` is ``i`` or one of its ancestors (the root is
        everyone's). Built once per tree (a prefix's ancestors are in the prefix); read
        only."""
        m = self.num_nodes if num_nodes is None else num_nodes
        return self._ancestors[:m + 1, :m + 1]

    def node_tokens(self, candidates: Sequence[torch.Tensor], num_nodes: int) -> torch.Tensor:
        """Draft tokens of the first ``num_nodes`` nodes: ``candidates[h]`` is head ``h``'s
        ``[requests, top_k[h]]`` best tokens, best first. -> ``[requests, num_nodes]``."""
        columns = [candidates[len(path) - 1][:, path[-1]] for path in self.paths[:num_nodes]]
        if not columns:
            return candidates[0][:, :0]
        return torch.stack(columns, dim=1)


def parse_tree(spec: object, *, num_heads: int, num_nodes: int,
               where: str = "medusa_tree_config.paths") -> MedusaTree:
    """Check a tree given as a list of paths, for heads of ``num_heads`` heads verifying
    ``num_nodes`` draft tokens per step (``num_speculative_tokens``)."""
    if not isinstance(spec, Sequence) or isinstance(spec, str) or not spec:
        raise MedusaConfigError(f"{where} must be a non-empty list of paths such as "
                                f"[[0], [0, 0], [1]], got {spec!r}")
    paths = []
    for path in spec:
        if (not isinstance(path, Sequence) or isinstance(path, str) or not path
                or not all(isinstance(i, int) and not isinstance(i, bool) for i in path)):
            raise MedusaConfigError(f"{where}: each path must be a non-empty list of candidate "
                                    f"indices (integers), got {path!r}")
        paths.append(tuple(path))
    for path in paths:
        if len(path) > num_heads:
            raise MedusaConfigError(
                f"{where}: path {list(path)} is {len(path)} deep, but the Medusa heads have "
                f"{num_heads} heads (one per depth): use paths of at most {num_heads} indices")
        bad = [i for i in path if not 0 <= i < MAX_TOP_K]
        if bad:
            raise MedusaConfigError(
                f"{where}: path {list(path)} has candidate index {bad[0]}; each head offers "
                f"its top {MAX_TOP_K} candidates, so indices must be 0 to {MAX_TOP_K - 1}")
    seen: set[tuple[int, ...]] = set()
    for path in paths:
        if path in seen:
            raise MedusaConfigError(f"{where}: path {list(path)} is given twice; give each "
                                    "path once")
        seen.add(path)
    for path in paths:
        if len(path) > 1 and path[:-1] not in seen:
            raise MedusaConfigError(
                f"{where}: path {list(path)} has no parent path {list(path[:-1])} in the "
                "tree; add it (every prefix of a path is a node too)")
    if len(paths) != num_nodes:
        raise MedusaConfigError(
            f"{where}: the tree has {len(paths)} nodes but num_speculative_tokens="
            f"{num_nodes} (the draft tokens a step verifies per request): set "
            f"num_speculative_tokens to {len(paths)}, or give a tree of {num_nodes} nodes")
    return MedusaTree(tuple(sorted(paths, key=lambda path: (len(path), path))))


def verify_greedy(tree: MedusaTree, drafts: Sequence[int], target: Sequence[int]
                  ) -> tuple[list[int], int]:
    """One request's greedy verification: ``drafts`` its first ``m`` nodes' tokens,
    ``target`` the target's argmax at rows ``0..m``. Returns the tokens to emit (the
    accepted path, then the target's next token) and the row of the path's last node."""
    m = len(drafts)
    row, emitted = 0, []
    while True:
        want = target[row]
        child = next((node for node in tree.children[row] if node < m and drafts[node] == want),
                     None)
        if child is None:
            return emitted + [want], row
        emitted.append(want)
        row = child + 1


def verify_sampled(tree: MedusaTree, drafts: Sequence[int], probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """One request's sampled verification: ``probs [m + 1, V]`` the target's distribution
    at rows ``0..m``. The drafts are deterministic (a head's top candidates), so at each
    node its children are tried in turn: a child is accepted with the probability the
    remaining distribution gives its token; a rejected token's mass is removed and the rest
    renormalised; when every child is rejected, the next token is drawn from what remains.
    The emitted tokens follow the target's distribution exactly (recursive rejection
    sampling with point-mass drafts). Returns the tokens and the last node's row."""
    m = len(drafts)
    row, emitted = 0, []
    while True:
        remaining = probs[row].double().clone()
        total = remaining.sum()
        accepted = None
        for node in tree.children[row]:
            if node >= m:
                continue
            token = drafts[node]
            draw = torch.rand((), generator=generator, dtype=torch.float64)
            if draw * total < remaining[token]:
                accepted = node
                break
            total -= remaining[token]
            remaining[token] = 0.0
        if accepted is None:
            token = int(torch.multinomial(remaining, 1, generator=generator))
            return emitted + [token], row
        emitted.append(drafts[accepted])
        row = accepted + 1


def accepted_path_nodes(tree: MedusaTree, last_row: int) -> list[int]:
    """The node indices of the accepted path ending at ``last_row`` (0: none), root first."""
    nodes = []
    node = last_row - 1
    while node >= 0:
        nodes.append(node)
        node = tree.parents[node]
    return nodes[::-1]


# The trainer's record of how often each path is accepted, beside the heads.
PATHS_FILE = "medusa_paths.json"


def path_frequencies(ranks: torch.Tensor, max_paths: int = 1024
                     ) -> list[tuple[tuple[int, ...], float]]:
    """How often each path would be accepted: ``ranks [rows, heads]`` holds, per held-out
    row, the rank of the true token among each head's candidates (``MAX_TOP_K``: not among
    them); a path is accepted at a row when every head along it ranks the true token at the
    path's index there. Returns the accepted paths with the fraction of rows accepting them,
    most frequent first (parents before children on ties, so that every prefix of the list
    is a tree), at most ``max_paths``."""
    rows = ranks.shape[0]
    found: list[tuple[tuple[int, ...], float]] = []
    alive = torch.ones(rows, dtype=torch.bool)
    for depth in range(1, ranks.shape[1] + 1):
        alive &= ranks[:, depth - 1] < MAX_TOP_K
        if not bool(alive.any()):
            break
        prefixes, counts = torch.unique(ranks[alive, :depth], dim=0, return_counts=True)
        found += [(tuple(path), count / rows)
                  for path, count in zip(prefixes.tolist(), counts.tolist(), strict=True)]
    found.sort(key=lambda item: (-item[1], len(item[0]), item[0]))
    return found[:max_paths]


def choose_tree(frequencies: Sequence[tuple[Sequence[int], float]], num_nodes: int,
                *, num_heads: int, where: str = "medusa_tree_config.auto") -> MedusaTree:
    """The ``num_nodes``-node tree that accepts the most tokens per step on the measured
    rows: the ``num_nodes`` most frequent paths (a child is never more frequent than its
    parent, so they form a tree), among those at most ``num_heads`` deep."""
    usable = [tuple(path) for path, _ in frequencies if len(path) <= num_heads]
    if len(usable) < num_nodes:
        raise MedusaConfigError(
            f"{where}: the heads' measured paths ({PATHS_FILE}) hold {len(usable)} paths the "
            f"heads ever got right, fewer than num_speculative_tokens={num_nodes}: lower "
            f"num_speculative_tokens to at most {len(usable)}")
    return parse_tree([list(path) for path in usable[:num_nodes]], num_heads=num_heads,
                      num_nodes=num_nodes, where=where)


def accepted_per_row(ranks: torch.Tensor, tree: MedusaTree) -> torch.Tensor:
    """``[rows]``: the draft tokens a greedy tree step accepts at each row of ``ranks``
    (the depth of the longest tree path matching the row's ranks)."""
    accepted = torch.zeros(ranks.shape[0], dtype=torch.long)
    paths = set(tree.paths)
    for depth in range(1, tree.depth + 1):
        prefixes = [tuple(row) for row in ranks[:, :depth].tolist()]
        hit = torch.tensor([prefix in paths for prefix in prefixes])
        accepted = torch.where(hit & (accepted == depth - 1), depth, accepted)
    return accepted
