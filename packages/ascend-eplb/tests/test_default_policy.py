import pytest
import torch

from ascend_eplb.metrics import balancedness
from ascend_eplb.policies.default import balanced_packing, rebalance_experts, replicate_experts

from eplb_cases import (
    README_ARGS,
    README_PHY2LOG,
    README_WEIGHT,
    TOPOLOGIES,
    check_placement,
    random_weight,
)


def test_readme_example_phy2log():
    phy2log, log2phy, logcnt = rebalance_experts(README_WEIGHT, **README_ARGS)
    assert torch.equal(phy2log, README_PHY2LOG)
    check_placement(README_WEIGHT, phy2log, log2phy, logcnt, 16, 8)


def test_readme_example_logcnt_and_balance():
    phy2log, _, logcnt = rebalance_experts(README_WEIGHT, **README_ARGS)
    expected = torch.tensor(
        [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    )
    assert torch.equal(logcnt, expected)
    # No redundancy, experts in id order: the placement must be better balanced.
    identity = torch.arange(12).repeat(2, 1)
    before = balancedness(README_WEIGHT, identity, torch.ones_like(logcnt), 4)
    after = balancedness(README_WEIGHT, phy2log, logcnt, 8)
    assert after > before


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_invariants_on_random_loads(topology):
    num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus = topology
    weight = random_weight(num_layers, num_experts, seed=sum(topology))
    phy2log, log2phy, logcnt = rebalance_experts(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    check_placement(weight, phy2log, log2phy, logcnt, num_replicas, num_gpus)


@pytest.mark.parametrize("topology", [t for t in TOPOLOGIES if t[3] % t[4] == 0])
def test_hierarchical_keeps_groups_and_replicas_inside_one_node(topology):
    num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus = topology
    weight = random_weight(num_layers, num_experts, seed=7)
    phy2log, _, _ = rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    group_size = num_experts // num_groups
    slot_node = torch.arange(num_replicas) // (num_replicas // num_nodes)
    for layer in range(num_layers):
        node_of_group = {}
        for slot, expert in enumerate(phy2log[layer].tolist()):
            group = expert // group_size
            assert node_of_group.setdefault(group, int(slot_node[slot])) == slot_node[slot]
        assert len(node_of_group) == num_groups


def test_global_when_groups_do_not_split_over_nodes():
    weight = random_weight(3, 12, seed=3)
    got = rebalance_experts(weight, 18, 3, 2, 6)  # 3 groups % 2 nodes != 0
    want = rebalance_experts(weight, 18, 1, 1, 6)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_dtypes_and_containers_give_the_same_placement():
    want = rebalance_experts(README_WEIGHT, **README_ARGS)
    for weight in (
        README_WEIGHT.float(),
        README_WEIGHT.to(torch.int32),
        README_WEIGHT.tolist(),
        README_WEIGHT.numpy(),
    ):
        for a, b in zip(rebalance_experts(weight, **README_ARGS), want):
            assert torch.equal(a, b)


def test_no_redundancy_and_all_zero_loads():
    phy2log, log2phy, logcnt = rebalance_experts(torch.zeros(2, 8), 8, 1, 1, 4)
    assert (logcnt == 1).all() and log2phy.shape == (2, 8, 1)
    assert sorted(phy2log[0].tolist()) == list(range(8))


def test_zero_layers():
    phy2log, log2phy, logcnt = rebalance_experts(torch.zeros(0, 8), 16, 2, 1, 4)
    assert phy2log.shape == (0, 16) and logcnt.shape == (0, 8) and log2phy.shape[:2] == (0, 8)


def test_replication_minimises_the_largest_load_per_replica():
    weight = torch.tensor([[10.0, 1.0, 4.0]])
    phy2log, phy_rank, logcnt = replicate_experts(weight, 6)
    # greedy: 10 -> (5), 5 vs 4 -> 10 again (3.33), then 4 -> (2): counts 3, 1, 2.
    assert logcnt.tolist() == [[3, 1, 2]]
    assert phy2log.tolist() == [[0, 1, 2, 0, 0, 2]]
    assert phy_rank.tolist() == [[0, 0, 0, 1, 2, 1]]


def test_balanced_packing_by_hand():
    weight = torch.tensor([[8.0, 7.0, 6.0, 5.0, 4.0, 1.0]])
    pack, rank = balanced_packing(weight, 2)
    # 8 -> p0; 7 -> p1; 6 -> p1 (7 < 8); 5 -> p0 (8 < 13); 4: both at 13, the tie goes to
    # the lower index p0, which is then full; 1 -> p1.
    assert pack.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert rank.tolist() == [[0, 0, 1, 1, 2, 2]]
    sizes = torch.zeros(2, dtype=torch.int64).scatter_add_(0, pack[0], torch.ones(6, dtype=torch.int64))
    assert sizes.tolist() == [3, 3]
