"""Medusa's candidate trees (no vLLM): parsing and its errors, the ancestor mask, node
tokens from each head's candidates, greedy and sampled verification (the sampled walk's
output distribution, chi-squared), and the heads' top-k candidates, sharded or whole."""

from __future__ import annotations

import pytest
import torch

from ascend_specdec.medusa import MedusaConfigError, MedusaHeads, MedusaHeadsConfig
from ascend_specdec.medusa.tree import (
    MAX_TOP_K,
    accepted_path_nodes,
    parse_tree,
    verify_greedy,
    verify_sampled,
)

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
# Upper 0.1% points of the chi-squared distribution by degrees of freedom (standard tables).
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


def tree(paths=TREE, heads=3):
    return parse_tree(paths, num_heads=heads, num_nodes=len(paths))


def test_nodes_are_breadth_first_with_parents_depths_and_top_k():
    t = tree([[0, 0], [1], [0], [0, 0, 0], [1, 0], [0, 1]])
    assert t.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert t.parents == (-1, -1, 0, 0, 1, 2)
    assert t.depths == (1, 1, 2, 2, 2, 3)
    assert t.top_k == (2, 2, 1)
    assert t.children == ((0, 1), (2, 3), (4,), (5,), (), (), ())
    # Every prefix of the node list is a tree: a parent comes before its children.
    assert all(parent < node for node, parent in enumerate(t.parents))


def test_ancestor_mask_lets_each_row_see_its_path_only():
    mask = tree().ancestor_mask()
    # rows/columns: root, [0], [1], [0,0], [0,1], [1,0], [0,0,0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0],
        [1, 0, 1, 0, 0, 1, 0],
        [1, 1, 0, 1, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert torch.equal(tree().ancestor_mask(3), expected[:4, :4])


def test_node_tokens_take_each_heads_candidate():
    candidates = [torch.tensor([[10, 11], [20, 21]]), torch.tensor([[30, 31], [40, 41]]),
                  torch.tensor([[50], [60]])]
    tokens = tree().node_tokens(candidates, 6)
    assert tokens.tolist() == [[10, 11, 30, 31, 30, 50], [20, 21, 40, 41, 40, 60]]
    assert tree().node_tokens(candidates, 2).tolist() == [[10, 11], [20, 21]]
    assert tree().node_tokens(candidates, 0).shape == (2, 0)


@pytest.mark.parametrize(("paths", "heads", "nodes", "message"), [
    ([], 3, 0, "non-empty list of paths"),
    ("[[0]]", 3, 1, "non-empty list of paths"),
    ([[0], 1], 3, 2, "each path must be a non-empty list"),
    ([[0], []], 3, 2, "each path must be a non-empty list"),
    ([[0], [True]], 3, 2, "each path must be a non-empty list"),
    ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], 3, 4, "4 deep, but the Medusa heads have 3"),
    ([[0], [MAX_TOP_K]], 3, 2, f"candidate index {MAX_TOP_K}"),
    ([[0], [-1]], 3, 2, "candidate index -1"),
    ([[0], [1], [0]], 3, 3, "path [0] is given twice"),
    ([[0], [1, 0]], 3, 2, "no parent path [1]"),
    ([[0], [1]], 3, 3, "the tree has 2 nodes but num_speculative_tokens=3"),
    ([[0], [1], [2]], 3, 2, "set num_speculative_tokens to 3"),
])
def test_bad_trees_are_refused_with_what_to_change(paths, heads, nodes, message):
    with pytest.raises(MedusaConfigError, match="medusa_tree_config.paths") as error:
        parse_tree(paths, num_heads=heads, num_nodes=nodes)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_greedy_takes_the_longest_path_the_target_agrees_with():
    t = tree()
    # node tokens: [0]=5 [1]=6 [0,0]=7 [0,1]=8 [1,0]=7 [0,0,0]=9
    drafts = [5, 6, 7, 8, 7, 9]
    # target argmax per row: root, then after each node
    target = [6, 0, 7, 0, 0, 0, 0]
    # root says 6: node [1]; after [1] the target says 7: node [1,0]; then 0: stop.
    tokens, last = verify_greedy(t, drafts, target)
    assert tokens == [6, 7, 0] and last == 5
    assert accepted_path_nodes(t, last) == [1, 4]
    # Root says 5: node [0]; after it 8: node [0,1]; after that 3 -> next token 3.
    tokens, last = verify_greedy(t, drafts, [5, 8, 0, 0, 3, 0, 0])
    assert tokens == [5, 8, 3] and accepted_path_nodes(t, last) == [0, 3]
    # Nothing accepted: the target's token at the root.
    tokens, last = verify_greedy(t, drafts, [4, 0, 0, 0, 0, 0, 0])
    assert tokens == [4] and last == 0 and accepted_path_nodes(t, last) == []
    # Only the first two nodes drafted: [0,1] is out of reach.
    tokens, last = verify_greedy(t, drafts[:2], [5, 8, 0])
    assert tokens == [5, 8] and accepted_path_nodes(t, last) == [0]


def chi_squared(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    expected = probs * counts.sum()
    support = expected > 0
    assert int(counts[~support].sum()) == 0, "a token without probability was emitted"
    statistic = float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())
    return statistic, int(support.sum()) - 1


def assert_distribution(counts, probs, what):
    statistic, dof = chi_squared(counts.double(), probs.double())
    assert statistic < CHI2_CRITICAL_0_001[dof], f"{what}: chi-squared {statistic:.1f}"


def test_sampled_walk_emits_the_targets_distribution_at_every_depth():
    t = tree([[0], [1], [0, 0], [0, 1]], heads=2)
    vocab = 5
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(5, vocab, generator=generator), dim=-1)
    # The root's children are its two likeliest tokens, node [0]'s children its own two:
    # rejections move much mass, which a wrong residual would misplace.
    drafts = [4, 2, 0, 3]  # [0]=4 [1]=2 [0,0]=0 [0,1]=3
    first = torch.zeros(vocab)
    after_node_0 = torch.zeros(vocab)  # second tokens after the first token 1 (node [0])
    after_node_1 = torch.zeros(vocab)
    samples = 20000
    for _ in range(samples):
        tokens, last = verify_sampled(t, drafts, probs, generator)
        first[tokens[0]] += 1
        # The first token equals a root child's token exactly when that child was accepted.
        if tokens[0] == 4:
            after_node_0[tokens[1]] += 1
        elif tokens[0] == 2:
            after_node_1[tokens[1]] += 1
        else:
            assert len(tokens) == 1 and last == 0
    assert probs[0].topk(2).indices.tolist() == [4, 2]
    assert probs[1].topk(2).indices.tolist() == [0, 3]
    assert_distribution(first, probs[0], "first token")
    assert_distribution(after_node_0, probs[1], "after node [0]")
    assert_distribution(after_node_1, probs[2], "after node [1]")


def test_the_distribution_check_can_fail():
    """Emitting the first draft whenever the target gives it any mass is no sampler."""
    probs = torch.tensor([0.5, 0.3, 0.2])
    counts = torch.tensor([0.0, 20000.0, 0.0])
    statistic, dof = chi_squared(counts, probs)
    assert statistic > 10 * CHI2_CRITICAL_0_001[dof]


def test_sampled_walk_follows_a_seeded_generator():
    t = tree()
    probs = torch.softmax(torch.randn(7, 11, generator=torch.Generator().manual_seed(1)), -1)
    drafts = [1, 2, 3, 4, 5, 6]
    runs = [verify_sampled(t, drafts, probs, torch.Generator().manual_seed(7))
            for _ in range(2)]
    assert runs[0] == runs[1]


def heads(num_heads=3, vocab=40, hidden=16, seed=0):
    config = MedusaHeadsConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads)
    torch.manual_seed(seed)
    model = MedusaHeads(config)
    for parameter in model.parameters():
        torch.nn.init.normal_(parameter, std=0.5)
    return model


def test_top_k_candidates_are_each_heads_best_tokens_best_first():
    model = heads()
    hidden = torch.randn(4, 16)
    candidates = model.propose_top_k(hidden, [3, 2])
    logits = model.logits(hidden, 2)
    assert [c.shape for c in candidates] == [(4, 3), (4, 2)]
    for head, k in enumerate([3, 2]):
        assert torch.equal(candidates[head], logits[:, head].topk(k).indices)
    # The best candidate is the chain's draft.
    assert torch.equal(torch.stack([c[:, 0] for c in candidates], 1), model.propose(hidden, 2))


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_heads_offer_the_same_candidates(world_size):
    whole = heads()
    hidden = torch.randn(5, 16)
    shards = []
    for rank in range(world_size):
        shard = heads()
        shard.shard_lm_heads(rank, world_size)
        shards.append(shard)
    offers = []

    def gather(tensor):  # an all-gather: every rank's offer, stacked in rank order
        offers.append(tensor)
        return torch.stack([s._offer for s in shards])

    for shard in shards:
        # Each rank's offer is what propose_top_k would give the collective on that rank.
        captured = []
        shard.propose_top_k(hidden, [4, 2, 1], lambda t, c=captured: c.append(t) or t[None])
        shard._offer = captured[0]
    got = [shard.propose_top_k(hidden, [4, 2, 1], gather) for shard in shards]
    expected = whole.propose_top_k(hidden, [4, 2, 1])
    for per_rank in got:
        for candidates, want in zip(per_rank, expected, strict=True):
            assert torch.equal(candidates, want)


def test_path_frequencies_choose_trees_and_count_accepted_tokens():
    from ascend_specdec.medusa.tree import accepted_per_row, choose_tree, path_frequencies

    # Rows' ranks of the true token per head (MAX_TOP_K: not among the candidates).
    ranks = torch.tensor([[0, 0, 0], [0, 1, MAX_TOP_K], [1, 0, 0], [0, 0, 2],
                          [MAX_TOP_K, 0, 0], [0, 1, 0]])
    found = dict(path_frequencies(ranks))
    assert found[(0,)] == 4 / 6 and found[(1,)] == 1 / 6
    assert found[(0, 0)] == 2 / 6 and found[(0, 1)] == 2 / 6 and found[(0, 0, 0)] == 1 / 6
    assert (MAX_TOP_K,) not in found and (0, 1, MAX_TOP_K) not in found
    ordered = [path for path, _ in path_frequencies(ranks)]
    assert ordered[:3] == [(0,), (0, 0), (0, 1)]  # parents first among equals
    tree = choose_tree(path_frequencies(ranks), 3, num_heads=3)
    assert tree.paths == ((0,), (0, 0), (0, 1))
    assert accepted_per_row(ranks, tree).tolist() == [2, 2, 0, 2, 0, 2]
    with pytest.raises(MedusaConfigError, match="fewer than num_speculative_tokens=40"):
        choose_tree(path_frequencies(ranks), 40, num_heads=3)
    # Paths deeper than the served heads are left out.
    assert choose_tree(path_frequencies(ranks), 2, num_heads=1).paths == ((0,), (1,))


class RisingGrammar:
    """A grammar of tokens that rise by 1 or 2; its state is the last token, which
    ``fill_bitmask`` writes as the row (so a test reads back the state each row was
    masked from)."""

    def __init__(self, last: int, end: int = 99) -> None:
        self.stack, self.end = [last], end

    def validate_tokens(self, tokens):
        taken, last = [], self.stack[-1]
        for token in tokens:
            if token - last not in (1, 2) or last == self.end:
                break
            taken.append(token)
            last = token
        return taken

    def accept_tokens(self, req_id, tokens):
        assert self.validate_tokens(tokens) == list(tokens)
        self.stack += tokens
        return True

    def rollback(self, n):
        del self.stack[len(self.stack) - n:]

    def is_terminated(self):
        return self.stack[-1] == self.end

    def fill_bitmask(self, bitmask, row):
        bitmask[row] = self.stack[-1]


def test_tree_grammar_masks_each_node_row_after_its_own_path():
    from types import SimpleNamespace

    from ascend_specdec.vllm.medusa_tree import TreeGrammar

    grammars = {"a": RisingGrammar(10), "b": RisingGrammar(5), "c": RisingGrammar(40, end=41)}
    requests = {r: SimpleNamespace(structured_output_request=SimpleNamespace(grammar=g))
                for r, g in grammars.items()}
    backend = SimpleNamespace(allocate_token_bitmask=lambda n: torch.zeros(n, 1, dtype=torch.int32))
    manager = SimpleNamespace(backend=backend, accept_tokens=lambda *a: "the manager's")
    grammar = TreeGrammar(manager, tree([[0], [1], [0, 0], [0, 1], [1, 0]], heads=2))
    # Nodes (parents): 0 (root), 1 (root), 2 (0), 3 (0), 4 (1). "a" drafts all five, the
    # last one breaking its grammar after node 1's 12; "b" drafts none; "c" three, its
    # grammar ending at 41 (node 0, and node 2 below it, whose own 43 is never taken).
    drafts = {"a": [11, 12, 12, 13, 20], "c": [41, 42, 43]}
    bitmask = grammar.grammar_bitmask(requests, ["a", "b", "c"], drafts)
    assert bitmask[:, 0].tolist() == [
        10, 11, 12, 12, 13, 12,  # a: root, then each node's path (11, 12, 11-12, 11-13, 12-)
        5,  # b: its one row
        40, -1, 42, -1]  # c: root, node 0 (ended: every token allowed), node 1, node 2
    assert all(g.stack == [g.stack[0]] for g in grammars.values())  # every state rolled back
    # A tree keeps every node (vLLM cuts a chain at the first the grammar refuses).
    assert grammar.validate_tokens(requests["a"], [11, 20, 12]) == [11, 20, 12]
    assert grammar.accept_tokens() == "the manager's"
    assert grammar.grammar_bitmask(requests, [], drafts) is None
