"""The EAGLE bookkeeping ops against a per-request loop written from their definitions."""

import pytest
import torch

from ascend_kernels.spec_decode import (
    next_token_ids_padded,
    sample_indices_padded,
    step_positions_and_slots,
)


def _sampled(requests: int, width: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (requests, width), generator=g)
    accepted = torch.randint(0, width + 1, (requests,), generator=g)
    for row, n in enumerate(accepted.tolist()):
        tokens[row, n:] = -1  # rejected tail
    tokens[0, 0] = vocab + 5  # an out-of-vocabulary id counts as invalid
    discard = torch.rand(requests, generator=g) < 0.2
    backup = torch.randint(0, vocab, (requests,), generator=g)
    return tokens, discard, backup


@pytest.mark.parametrize("seed", range(4))
def test_next_token_ids_padded_follows_its_definition(seed):
    vocab = 100
    tokens, discard, backup = _sampled(13, 4, vocab, seed)
    next_ids, counts = next_token_ids_padded(tokens, discard, backup, vocab)
    for row in range(tokens.shape[0]):
        valid = [t for t in tokens[row].tolist() if t != -1 and t < vocab]
        if discard[row]:
            want = (int(backup[row]), 0)
        elif valid:
            want = (valid[-1], len(valid))
        else:
            want = (int(backup[row]), 0)
        assert (int(next_ids[row]), int(counts[row])) == want
    assert next_ids.dtype == counts.dtype == torch.int32


def test_sample_indices_padded_follows_its_definition():
    num_drafts = torch.tensor([3, 0, 2, 3, 1])
    valid = torch.tensor([1, 1, 3, 2, 2])  # 1 + accepted
    query_lens = num_drafts + 1
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), query_lens.cumsum(0)])
    indices, rejected = sample_indices_padded(num_drafts.cumsum(0), valid, query_start_loc)
    want_rejected = [3, 0, 0, 2, 0]
    assert rejected.tolist() == want_rejected
    assert indices.tolist() == [int(query_start_loc[i + 1]) - 1 - want_rejected[i]
                                for i in range(5)]


def test_step_positions_and_slots_follows_its_definition():
    block_size, max_len = 4, 20
    positions = torch.tensor([0, 3, 7, 18, 19, 11])
    block_table = torch.tensor([[9, 2, 5, 7, 1], [4, 8, 3, 6, 0], [1, 2, 3, 4, 5],
                                [5, 4, 3, 2, 1], [6, 6, 6, 6, 6], [0, 1, 2, 3, 4]],
                               dtype=torch.int32)
    seq_lens = torch.tensor([1, 4, 8, 19, 20, 12], dtype=torch.int32)
    out_positions = torch.full((6,), -7, dtype=torch.int64)
    out_slots = torch.full((8,), -7, dtype=torch.int64)  # two padding rows
    step_positions_and_slots(positions, block_table, seq_lens, block_size=block_size,
                             max_model_len=max_len, out_positions=out_positions,
                             out_slot_mapping=out_slots)
    for row, pos in enumerate(positions.tolist()):
        new = pos + 1
        if new >= max_len:
            assert (out_positions[row], out_slots[row]) == (0, -1)
            assert seq_lens[row] == 1
            continue
        assert out_positions[row] == new
        assert out_slots[row] == block_table[row, new // block_size] * block_size \
            + new % block_size
    assert seq_lens.tolist()[:3] == [2, 5, 9] and seq_lens[3] == 20
    assert out_slots[6:].tolist() == [-1, -1]


def test_bad_shapes_say_what_was_expected():
    with pytest.raises(ValueError, match=r"discard_mask must have shape \[3\], got \(2,\)"):
        next_token_ids_padded(torch.zeros(3, 2, dtype=torch.long),
                              torch.zeros(2, dtype=torch.bool), torch.zeros(3), 10)
    with pytest.raises(ValueError, match=r"query_start_loc must have shape \[3\]"):
        sample_indices_padded(torch.ones(2), torch.ones(2), torch.zeros(2))
