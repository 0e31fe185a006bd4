"""Expert weights moved between processes over gloo, as plan_transfers says."""

from __future__ import annotations

import pytest
import torch

from ascend_eplb.exchange import (
    apply_transfer_plan,
    commit_staged_weights,
    stage_expert_weights,
)
from ascend_eplb.policies import default, flashlb
from ascend_eplb.synthetic import drift_loads, zipf_loads
from ascend_eplb.transfer import plan_initial_transfers, plan_transfers

from eplb_dist import expert_rows, run_ranks

NUM_PARAMS = 2


def layer_weights(phy2log, rank, num_ranks):
    return [
        [expert_rows(phy2log, layer, rank, num_ranks, p) for p in range(NUM_PARAMS)]
        for layer in range(phy2log.size(0))
    ]


def _exchange_rank(rank, world_size, old, new):
    plan = plan_transfers(old, new, world_size, expert_bytes=4 * (12 + 5))
    weights = layer_weights(old, rank, world_size)
    staged = apply_transfer_plan(plan, weights, rank)
    for layer in range(old.size(0)):
        for p in range(NUM_PARAMS):
            assert torch.equal(weights[layer][p],
                               expert_rows(plan.phy2log, layer, rank, world_size, p)), (layer, p)
    moves = plan.moves
    assert staged.rows_received == int(((moves[:, 2] == rank) & (moves[:, 1] != rank)).sum())
    assert staged.rows_sent == int(((moves[:, 1] == rank) & (moves[:, 2] != rank)).sum())
    assert staged.num_rows == int((moves[:, 2] == rank).sum())


def test_two_ranks_exchange_a_replan():
    weight = zipf_loads(3, 8, 1.2, seed=3)
    old = default.rebalance_experts(weight, 12, 1, 1, 2)[0]
    new = flashlb.rebalance_experts(drift_loads(weight, 0.5, seed=4), 12, 1, 1, 2)[0]
    plan = plan_transfers(old, new, 2, 1)
    assert plan.bytes_between_ranks > 0  # the test must cross ranks
    run_ranks(_exchange_rank, 2, old, new)


def test_three_ranks_exchange_with_replicas_moving_everywhere():
    # Every layer's rank contents rotate, and replica counts change.
    old = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2], [5, 4, 3, 2, 1, 0, 5, 5, 5]])
    new = torch.tensor([[3, 4, 5, 0, 0, 0, 1, 2, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
    run_ranks(_exchange_rank, 3, old, new)


def _initial_rank(rank, world_size, source, target):
    plan = plan_initial_transfers(source, target, world_size, expert_bytes=68)
    assert plan.src_slots_per_gpu == source.size(1) // world_size
    sources = layer_weights(source, rank, world_size)
    k = target.size(1) // world_size
    buffers = [[torch.empty((k,) + tuple(t.shape[1:])) for t in params] for params in sources]
    staged = stage_expert_weights(plan, sources, rank)
    commit_staged_weights(staged, buffers)
    for layer in range(target.size(0)):
        for p in range(NUM_PARAMS):
            assert torch.equal(buffers[layer][p], expert_rows(target, layer, rank, world_size, p))


def test_initial_placement_with_redundant_experts_from_the_loaded_layout():
    # vLLM loads experts 0-3 on rank 0 and 4-7 on rank 1; the first placement has 10
    # slots (2 redundant experts), 5 per rank, from an expert map.
    source = torch.arange(8).expand(2, -1).clone()
    target = torch.tensor([[7, 0, 1, 2, 3, 4, 5, 6, 7, 0], [4, 5, 6, 7, 0, 0, 1, 2, 3, 4]])
    run_ranks(_initial_rank, 2, source, target)


def test_initial_plan_prefers_local_copies():
    source = torch.arange(8).expand(1, -1).clone()
    target = torch.tensor([[0, 1, 2, 3, 0, 4, 5, 6, 7, 4]])
    plan = plan_initial_transfers(source, target, 2, expert_bytes=10)
    assert plan.num_moves == 10  # every fresh slot is filled once
    assert plan.bytes_between_ranks == 0  # each rank already loaded what it serves
    assert plan.moves[:, 3].tolist() == [0, 1, 2, 3, 0, 4, 5, 6, 7, 4]


def test_single_rank_needs_no_process_group():
    old = torch.tensor([[0, 1, 2, 3, 0, 1]])
    new = torch.tensor([[3, 3, 2, 1, 0, 2]])
    plan = plan_transfers(old, new, 1, 1)
    weights = layer_weights(old, 0, 1)
    staged = apply_transfer_plan(plan, weights, 0)
    assert staged.rows_sent == staged.rows_received == 0
    assert staged.rows_copied_locally == plan.num_moves > 0
    for p in range(NUM_PARAMS):
        assert torch.equal(weights[0][p], expert_rows(plan.phy2log, 0, 0, 1, p))


def test_sources_that_do_not_fit_the_plan_are_refused_before_any_message():
    old = torch.tensor([[0, 1, 2, 3]])
    plan = plan_transfers(old, torch.tensor([[1, 0, 3, 2]]), 2, 1)
    weights = layer_weights(old, 0, 2)
    with pytest.raises(ValueError, match="the plan has 1 MoE layers but weights were given for 2"):
        stage_expert_weights(plan, weights * 2, 0)
    with pytest.raises(ValueError, match="expected 2 rows, one per local slot"):
        stage_expert_weights(plan, [[weights[0][0][:1], weights[0][1]]], 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\), got 2"):
        stage_expert_weights(plan, weights, 2)
    initial = plan_initial_transfers(torch.tensor([[0, 1, 2, 3]]),
                                     torch.tensor([[0, 1, 0, 2, 3, 1]]), 2, 1)
    with pytest.raises(ValueError, match="changes the slots per rank from 2 to 3"):
        apply_transfer_plan(initial, weights, 0)
