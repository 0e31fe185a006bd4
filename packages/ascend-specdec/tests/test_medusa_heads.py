"""The heads' math: residual blocks, top-1 chains, shared LM head, truncated vocabulary."""

import pytest
import torch
from torch.nn import functional as F

from ascend_specdec.medusa import MedusaConfigError, last_accepted_rows

from medusa_cases import random_heads


def reference_logits(heads, hidden):
    """Spelled out per head: x <- x + SiLU(W x + b) per layer, then that head's LM head."""
    out = []
    for i, block in enumerate(heads.blocks):
        x = hidden
        for layer in block.layers:
            bias = layer.bias if layer.bias is not None else 0
            x = x + F.silu(x @ layer.weight.t() + bias)
        out.append(x @ heads.head_weight(i).t())
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("fields", [{}, {"num_hidden_layers": 2}, {"medusa_fc_bias": True},
                                    {"original_lm_head": True}])
def test_logits_follow_the_residual_block_definition(fields):
    heads = random_heads(**fields)
    hidden = torch.randn(5, 16)
    torch.testing.assert_close(heads.logits(hidden), reference_logits(heads, hidden))


def test_top1_chain_is_each_heads_argmax():
    heads = random_heads()
    hidden = torch.randn(7, 16)
    drafts = heads.propose(hidden)
    assert drafts.shape == (7, 3) and drafts.dtype == torch.long
    assert torch.equal(drafts, reference_logits(heads, hidden).argmax(-1))


def test_fewer_speculative_tokens_use_the_first_heads():
    heads = random_heads()
    hidden = torch.randn(4, 16)
    assert torch.equal(heads.propose(hidden, 2), heads.propose(hidden)[:, :2])
    with pytest.raises(MedusaConfigError, match="asked for 4 draft tokens from 3 Medusa heads"):
        heads.propose(hidden, 4)


def test_shared_lm_head_equals_per_head_copies_of_it():
    shared = random_heads(original_lm_head=True)
    per_head = random_heads(seed=1)
    with torch.no_grad():
        for mine, theirs in zip(per_head.blocks, shared.blocks):
            mine.load_state_dict(theirs.state_dict())
        for lm_head in per_head.lm_heads:
            lm_head.weight.copy_(shared.lm_head.weight)
    hidden = torch.randn(6, 16)
    torch.testing.assert_close(shared.logits(hidden), per_head.logits(hidden))


@pytest.mark.parametrize("original_lm_head", [False, True])
def test_truncated_vocabulary_maps_drafts_through_the_token_map(original_lm_head):
    heads = random_heads(truncated_vocab_size=12, original_lm_head=original_lm_head)
    hidden = torch.randn(9, 16)
    # vLLM's way: scatter the truncated logits into a full-vocabulary row of -inf, argmax.
    full = torch.full((9, 3, 40), float("-inf"))
    full[..., heads.token_map] = heads.logits(hidden)
    drafts = heads.propose(hidden)
    assert torch.equal(drafts, full.argmax(-1))
    assert set(drafts.flatten().tolist()) <= set(heads.token_map.tolist())


def test_logit_scale_does_not_change_the_drafts():
    heads = random_heads(logit_scale=0.25)
    hidden = torch.randn(3, 16)
    torch.testing.assert_close(heads.logits(hidden), 0.25 * reference_logits(heads, hidden))
    assert torch.equal(heads.propose(hidden), reference_logits(heads, hidden).argmax(-1))


def test_zero_initialised_blocks_are_the_identity():
    heads = random_heads()
    heads.zero_init_blocks()
    hidden = torch.randn(3, 16)
    for i in range(3):
        torch.testing.assert_close(heads.hidden(hidden)[:, i], hidden)


def test_last_accepted_rows():
    # Request 0: 3 drafts, 2 accepted (+1 sampled) -> its third row; request 1: a prefill
    # (no drafts); request 2: 2 drafts, none accepted -> its first row.
    assert last_accepted_rows([3, 0, 2], [3, 1, 1]) == [2, 4, 5]
    # All accepted: the bonus row.
    assert last_accepted_rows([2, 2], [3, 3]) == [2, 5]
    with pytest.raises(ValueError, match="at most drafts \\+ 1"):
        last_accepted_rows([1], [3])


def all_gather_between_threads(world_size: int):
    """``gather`` callables for ranks run as threads: each call stacks every rank's tensor."""
    import itertools
    import threading

    slots: dict[int, list] = {}
    barrier = threading.Barrier(world_size)

    def for_rank(rank: int):
        calls = itertools.count()

        def gather(tensor: torch.Tensor) -> torch.Tensor:
            call = next(calls)
            slots.setdefault(call, [None] * world_size)[rank] = tensor
            barrier.wait()
            return torch.stack(slots[call])
        return gather
    return for_rank


@pytest.mark.parametrize("world_size", [2, 3, 7])
@pytest.mark.parametrize("fields", [{}, {"original_lm_head": True},
                                    {"truncated_vocab_size": 12}])
def test_lm_heads_sharded_across_ranks_draft_what_the_whole_heads_draft(world_size, fields):
    """Each rank keeps a contiguous share of the rows (vLLM's vocab-parallel LM head); the
    ranks' best rows, all-gathered, give the whole heads' argmax, ties to the lower row."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    whole = random_heads(**fields)
    hidden = torch.randn(9, 16)
    hidden[0] = 0.0  # every logit of request 0 is 0 on every rank: row 0 must win
    shards = []
    for rank in range(world_size):
        shard = copy.deepcopy(whole)
        shard.shard_lm_heads(rank, world_size)
        shards.append(shard)
    rows = [shard.head_weight(0).shape[0] for shard in shards]
    assert sum(rows) == whole.config.draft_vocab_size and max(rows) - min(rows) <= 1
    assert [shard.row_offset for shard in shards] == [sum(rows[:r]) for r in range(world_size)]
    gathers = all_gather_between_threads(world_size)
    with ThreadPoolExecutor(world_size) as pool:
        drafts = list(pool.map(lambda r: shards[r].propose(hidden, gather=gathers(r)),
                               range(world_size)))
    expected = whole.propose(hidden)
    for rank_drafts in drafts:
        assert torch.equal(rank_drafts, expected)
    assert torch.equal(expected[0], whole.draft_vocab_to_base(torch.zeros(3, dtype=torch.long)))


def test_sharding_refuses_more_ranks_than_rows():
    with pytest.raises(MedusaConfigError, match="cannot shard 12 LM-head rows"):
        random_heads(truncated_vocab_size=12).shard_lm_heads(0, 13)
