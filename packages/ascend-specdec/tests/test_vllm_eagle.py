"""Our EAGLE proposer's overridden steps against vLLM's own, on random batches.

vLLM's CPU backend runs the EAGLE bookkeeping through C++ ops (``vllm._C``) standing in for
its Triton kernels; ``ascend_kernels.spec_decode`` must give the same results. The greedy
truncated-vocabulary draft must pick the token vLLM's ``Eagle3LlamaForCausalLM`` picks.
"""

from types import SimpleNamespace

import pytest
import torch
import vllm._C  # noqa: F401  (registers torch.ops._C on the CPU build)
from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
from vllm.utils import cpu_triton_utils as vllm_cpu

from ascend_kernels.spec_decode import (
    next_token_ids_padded,
    sample_indices_padded,
    step_positions_and_slots,
)


@pytest.mark.parametrize("seed", range(6))
def test_next_token_ids_match_vllm(seed):
    g = torch.Generator().manual_seed(seed)
    requests, width, vocab = 9, 4, 50
    tokens = torch.randint(0, vocab, (requests, width), generator=g, dtype=torch.int32)
    for row, n in enumerate(torch.randint(0, width + 1, (requests,), generator=g).tolist()):
        tokens[row, n:] = -1
    discard = torch.rand(requests, generator=g) < 0.25
    backup = torch.randint(0, vocab, (requests,), generator=g, dtype=torch.int32)
    theirs_ids = torch.empty(requests, dtype=torch.int32)
    theirs_count = torch.empty(requests, dtype=torch.int32)
    vllm_cpu._eagle_prepare_next_token_padded_kernel_impl(
        tokens, discard, backup, theirs_ids, theirs_count, vocab, width, requests)
    ours_ids, ours_count = next_token_ids_padded(tokens, discard, backup, vocab)
    assert torch.equal(ours_ids, theirs_ids) and torch.equal(ours_count, theirs_count)


@pytest.mark.parametrize("seed", range(6))
def test_sample_indices_match_vllm(seed):
    g = torch.Generator().manual_seed(seed)
    requests, k = 11, 3
    num_drafts = torch.randint(0, k + 1, (requests,), generator=g)
    valid = (torch.rand(requests, generator=g) * (num_drafts + 1)).long() + 1
    valid = torch.minimum(valid, num_drafts + 1).to(torch.int32)
    query_lens = num_drafts + 1 + torch.randint(0, 2, (requests,), generator=g) * (num_drafts == 0)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long),
                                 query_lens.cumsum(0)]).to(torch.int32)
    cu = num_drafts.cumsum(0).to(torch.int32)
    theirs_idx = torch.empty(requests, dtype=torch.int32)
    theirs_rej = torch.empty(requests, dtype=torch.int32)
    vllm_cpu._eagle_prepare_inputs_padded_kernel_impl(cu, valid, query_start_loc, theirs_idx,
                                                      theirs_rej, requests)
    ours_idx, ours_rej = sample_indices_padded(cu, valid, query_start_loc)
    assert torch.equal(ours_idx, theirs_idx) and torch.equal(ours_rej, theirs_rej)


@pytest.mark.parametrize("seed", range(6))
def test_step_positions_and_slots_match_vllm(seed):
    g = torch.Generator().manual_seed(seed)
    requests, blocks, block_size, max_len = 10, 8, 16, 120
    positions = torch.randint(0, max_len, (requests,), generator=g)
    positions[0] = max_len - 1  # reaches the limit: parked
    block_table = torch.randint(0, 500, (requests, blocks), generator=g, dtype=torch.int32)
    seq_lens = (positions + 1).to(torch.int32)
    theirs_lens, ours_lens = seq_lens.clone(), seq_lens.clone()
    theirs_pos = torch.zeros(requests, dtype=torch.int64)
    theirs_slots = torch.zeros(requests, dtype=torch.int64)
    vllm_cpu._eagle_step_slot_mapping_metadata_kernel_impl(
        positions, block_table, block_table.stride(0), theirs_lens, theirs_pos, theirs_slots,
        block_size, max_len, blocks, -1)
    ours_pos = torch.zeros(requests, dtype=torch.int64)
    ours_slots = torch.zeros(requests + 3, dtype=torch.int64)  # with padding rows
    step_positions_and_slots(positions, block_table, ours_lens, block_size=block_size,
                             max_model_len=max_len, out_positions=ours_pos,
                             out_slot_mapping=ours_slots)
    assert torch.equal(ours_pos, theirs_pos)
    assert torch.equal(ours_slots[:requests], theirs_slots)
    assert torch.equal(ours_lens, theirs_lens)
    assert ours_slots[requests:].tolist() == [-1, -1, -1]


def _eagle3_head(vocab: int, draft_vocab: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    kept = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    lm_head = torch.randn(draft_vocab, hidden, generator=g)
    return SimpleNamespace(
        config=SimpleNamespace(vocab_size=vocab, draft_vocab_size=draft_vocab),
        lm_head=lm_head,
        logits_processor=lambda head, states: states @ head.T,
        draft_id_to_target_id=kept - torch.arange(draft_vocab),
    )


@pytest.mark.parametrize("seed", range(4))
def test_truncated_vocab_greedy_draft_matches_vllm(seed):
    from ascend_specdec.vllm.eagle_proposer import AscendEagleProposer

    head = _eagle3_head(vocab=300, draft_vocab=64, hidden=16, seed=seed)
    states = torch.randn(12, 16, generator=torch.Generator().manual_seed(100 + seed))
    states[3] = 0  # all logits tie: both must pick the lowest target id
    head.compute_logits = lambda h: Eagle3LlamaForCausalLM.compute_logits(head, h)
    proposer = object.__new__(AscendEagleProposer)
    proposer.model = head
    proposer.use_local_argmax_reduction = proposer.use_heterogeneous_vocab = False
    proposer.ascend_counters = {"greedy_truncated_vocab": 0}
    theirs = head.compute_logits(states).argmax(dim=-1)
    ours = proposer._greedy_sample(states)
    assert torch.equal(ours, theirs)
    assert proposer.ascend_counters["greedy_truncated_vocab"] == 1


def test_a_catch_up_runs_each_requests_kept_tokens_in_order_once():
    from ascend_specdec.vllm.eagle_proposer import catch_up_order

    # Kept over several skipped steps: rows 0 and 1 are in this batch, -1 is not.
    rows = torch.tensor([0, 1, 0, -1, 0, 1, 0, 1])
    positions = torch.tensor([5, 9, 6, 3, 7, 10, 6, 11])
    first = torch.tensor([7, 11])  # this step starts row 0 at 7, row 1 at 11
    # Row 0: 5, then 6 kept twice (the later, index 6, counts); 7 is this step's own again.
    # Row 1: 9, 10; 11 is this step's. Row -1 waits.
    assert catch_up_order(rows, positions, first).tolist() == [0, 6, 1, 5]
    assert catch_up_order(rows, positions, torch.tensor([0, 0])).tolist() == []


def test_a_catch_up_leaves_running_requests_outside_the_batch_their_tokens():
    from ascend_specdec.vllm.eagle_proposer import AscendEagleProposer

    # Kept tokens of "a" (running, not in this batch) and "b" (finished); the batch holds
    # only "c", which kept nothing: no pass runs, "a" keeps its tokens, renumbered from 0.
    proposer = object.__new__(AscendEagleProposer)
    proposer.device = torch.device("cpu")
    proposer._runner = SimpleNamespace(requests={"a": None, "c": None})
    proposer._request_numbers = {"b": 0, "a": 1}
    owner = torch.tensor([0, 1, 0, 1])
    proposer._kept = [(owner, torch.tensor([10, 11, 12, 13]), torch.tensor([4, 7, 5, 8]),
                       torch.arange(8.0).view(4, 2))]
    proposer._kept_tokens = 4
    cad = SimpleNamespace(query_start_loc=torch.tensor([0, 1]))
    proposer._catch_up(["c"], torch.tensor([30]), cad)
    assert proposer._request_numbers == {"a": 0}
    assert proposer._kept_tokens == 2
    (owner, ids, positions, hidden), = proposer._kept
    assert owner.tolist() == [0, 0] and ids.tolist() == [11, 13]
    assert positions.tolist() == [7, 8] and hidden.tolist() == [[2.0, 3.0], [6.0, 7.0]]
