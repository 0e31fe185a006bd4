import pytest
import torch

from ascend_eplb.placement import (
    align_to_previous,
    check_phy2log,
    log2phy_from_phy2log,
    logcnt_from_phy2log,
)
from ascend_eplb.policies import default, flashlb
from ascend_eplb.synthetic import drift_loads, zipf_loads
from ascend_eplb.transfer import ExpertMove, plan_transfers

OLD = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
# layer 0: rank 0 keeps 1, gains 4; rank 1 keeps 2 and 3 ... (3 slots per rank, 2 ranks)
NEW = torch.tensor([[4, 1, 0, 3, 2, 5], [0, 1, 2, 3, 4, 5]])


def apply(plan, old):
    """Copy every move's source slot (read from the old placement) into its destination."""
    result = old.clone()
    for move in plan.to_list():
        assert old[move.layer, move.src_slot] == move.expert
        result[move.layer, move.dst_slot] = old[move.layer, move.src_slot]
    return result


def test_plan_by_hand():
    plan = plan_transfers(OLD, NEW, num_gpus=2, expert_bytes=100)
    # layer 0, rank 0 {4, 1, 0} vs old [0, 1, 2]: 0 and 1 stay, 4 comes into slot 2;
    #          rank 1 {3, 2, 5} vs old [3, 4, 5]: 3 and 5 stay, 2 comes into slot 4.
    # layer 1: rank 0 {0, 1, 2} vs old [5, 4, 3]: all three come; rank 1 likewise.
    assert plan.phy2log[0].tolist() == [0, 1, 4, 3, 2, 5]
    assert plan.to_list()[:2] == [
        ExpertMove(layer=0, src_rank=1, dst_rank=0, src_slot=4, dst_slot=2, expert=4),
        ExpertMove(layer=0, src_rank=0, dst_rank=1, src_slot=2, dst_slot=4, expert=2),
    ]
    assert plan.num_moves == 8
    assert plan.moves_per_layer().tolist() == [2, 6]
    assert plan.total_bytes == 800 == plan.bytes_between_ranks
    assert torch.equal(apply(plan, OLD), plan.phy2log)


def test_nothing_moves_when_nothing_changes():
    plan = plan_transfers(OLD, OLD, 2, 10)
    assert plan.num_moves == 0 and plan.total_bytes == 0 and plan.moves.shape == (0, 6)
    # a pure reorder inside ranks needs no copy either
    shuffled = OLD.view(2, 2, 3).flip(-1).reshape(2, 6)
    assert plan_transfers(OLD, shuffled, 2, 10).num_moves == 0


def test_fewest_moves_on_real_replans():
    weight = zipf_loads(6, 64, 1.0, seed=1)
    old = default.rebalance_experts(weight, 96, 1, 1, 16)[0]
    new = flashlb.rebalance_experts(drift_loads(weight, 0.2, seed=2), 96, 1, 1, 16)[0]
    plan = plan_transfers(old, new, 16, 7, num_nodes=4)
    # fewest possible: per rank, slots minus the multiset intersection of old and new
    expected = 0
    for layer in range(6):
        for rank in range(16):
            a = old[layer, rank * 6 : rank * 6 + 6].tolist()
            b = new[layer, rank * 6 : rank * 6 + 6].tolist()
            expected += 6 - sum(min(a.count(e), b.count(e)) for e in set(b))
    assert plan.num_moves == expected
    assert torch.equal(apply(plan, old), plan.phy2log)
    # same rank contents as the requested placement
    assert torch.equal(
        plan.phy2log.view(6, 16, 6).sort(-1).values, new.view(6, 16, 6).sort(-1).values
    )


def test_sources_prefer_the_same_rank_then_the_same_node():
    # 4 ranks of 3 slots on 2 nodes (ranks 0-1, 2-3). Expert 0 on ranks 0 and 2,
    # expert 2 on ranks 0 and 3.
    old = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 6, 7, 1, 2, 3]])
    new = torch.tensor([[0, 0, 1, 0, 4, 5, 6, 7, 2, 1, 2, 3]])
    plan = plan_transfers(old, new, 4, 1, num_nodes=2)
    by_dst = {m.dst_slot: m for m in plan.to_list()}
    assert sorted(by_dst) == [2, 3, 6]
    assert by_dst[2].src_rank == 0  # rank 0 copies its own expert 0 locally
    assert by_dst[3].src_rank == 0  # rank 1 is in node 0: from rank 0, not rank 2
    assert by_dst[6].src_rank == 3  # rank 2 gets expert 2 from rank 3, its node
    assert plan.bytes_between_ranks == 2 and plan.total_bytes == 3


def test_copies_of_one_expert_are_spread_over_its_replicas():
    # Expert 0 has replicas on ranks 0 and 1; ranks 2 and 3 both need it.
    old = torch.tensor([[0, 1, 0, 2, 3, 4, 5, 6]])
    new = torch.tensor([[6, 1, 5, 2, 0, 3, 0, 4]])
    moves = plan_transfers(old, new, 4, 1).to_list()
    sources = sorted(m.src_rank for m in moves if m.expert == 0)
    assert sources == [0, 1]


def test_align_to_previous_keeps_experts_in_their_slots():
    previous = torch.tensor([[1, 0, 0, 2, 3, 1]])
    new = torch.tensor([[0, 1, 2, 0, 3, 1]])
    aligned = align_to_previous(new, previous, 2)
    assert aligned.tolist() == [[1, 0, 2, 0, 3, 1]]
    assert align_to_previous(torch.zeros(0, 6, dtype=torch.long), torch.zeros(0, 6, dtype=torch.long), 2).shape == (0, 6)


def test_log2phy_lists_slots_in_order():
    phy2log = torch.tensor([[2, 0, 2, 1, 2, 0]])
    log2phy, logcnt = log2phy_from_phy2log(phy2log, 4)
    assert logcnt.tolist() == [[2, 1, 3, 0]]
    assert log2phy.tolist() == [[[1, 5, -1], [3, -1, -1], [0, 2, 4], [-1, -1, -1]]]
    assert torch.equal(logcnt_from_phy2log(phy2log, 4), logcnt)


@pytest.mark.parametrize(
    "old, new, kwargs, match",
    [
        (OLD, NEW[:, :4], {}, r"new_phy2log has 4 slots per layer, expected 6"),
        (OLD, NEW[:1], {}, r"new_phy2log has 1 layers, expected 2"),
        (OLD, NEW, {"num_gpus": 4}, r"not divisible by num_gpus \(4\)"),
        (OLD, NEW, {"expert_bytes": -1}, "expert_bytes must be an integer >= 0"),
        (OLD, NEW, {"num_nodes": 3}, r"num_gpus \(2\) must be divisible by num_nodes \(3\)"),
        (OLD, NEW + 1, {"num_experts": 6}, r"ids in \[0, 6\)"),
        (OLD, torch.zeros(2, 6, dtype=torch.long), {"num_experts": 6}, "no replica"),
        (OLD[0], NEW[0], {}, "must be 2-D"),
    ],
)
def test_bad_input(old, new, kwargs, match):
    args = {"num_gpus": 2, "expert_bytes": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_transfers(old, new, **args)


def test_check_phy2log_types():
    with pytest.raises(TypeError, match="phy2log must be an integer tensor"):
        check_phy2log("nope", 4, 2)
    with pytest.raises(ValueError, match="integer expert ids"):
        check_phy2log(torch.ones(1, 4, dtype=torch.bool), 4, 2)
    assert check_phy2log(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 4, 2).dtype == torch.int64
