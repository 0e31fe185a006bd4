import pytest
import torch

from ascend_eplb.metrics import (
    balancedness,
    balancedness_upper_bound,
    min_max_replica_load,
    peak_load_lower_bound,
    rank_loads,
)
from ascend_eplb.policies import default, flashlb
from ascend_eplb.policies.default import replicate_experts
from ascend_eplb.synthetic import zipf_loads

from eplb_cases import FLASHLB_WEIGHT, TOPOLOGIES, random_weight


def test_min_max_replica_load_matches_greedy_replication():
    weight = random_weight(6, 20, seed=3)
    for slots in (20, 21, 30, 57):
        _, _, counts = replicate_experts(weight, slots)
        greedy = (weight / counts).amax(-1)
        got = min_max_replica_load(weight, slots)
        assert (got <= greedy).all()
        assert torch.allclose(got, greedy, rtol=1e-9)


def test_flashlb_example_bound_is_the_mean():
    # 1450 tokens over 8 ranks; the optimal largest replica is 120 (< the mean 181.25)
    assert min_max_replica_load(FLASHLB_WEIGHT, 16).item() == pytest.approx(120)
    assert peak_load_lower_bound(FLASHLB_WEIGHT, 16, 8).item() == pytest.approx(181.25)


def test_no_redundancy_bound_by_hand():
    # 4 ranks x 2 slots: the 10 shares its rank with at least the lightest other (1).
    weight = torch.tensor([[10.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    assert peak_load_lower_bound(weight, 8, 4).item() == 11.0
    # global default gets exactly that
    phy2log, _, logcnt = default.rebalance_experts(weight, 8, 1, 1, 4)
    assert rank_loads(weight, phy2log, logcnt, 4).max().item() == 11.0


def test_hierarchical_bound_by_hand():
    # 2 groups of 2 experts on 2 nodes of 1 rank each: a node holds its group whole.
    weight = torch.tensor([[8.0, 8.0, 1.0, 1.0]])
    assert peak_load_lower_bound(weight, 4, 2, num_groups=2, num_nodes=2).item() == 16.0
    assert peak_load_lower_bound(weight, 4, 2).item() == 9.0  # global: 8 + 1
    assert balancedness_upper_bound(weight, 4, 2, 2, 2) == pytest.approx(9 / 16)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_no_policy_beats_the_bound(topology):
    num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus = topology
    weight = random_weight(num_layers, num_experts, seed=21 + sum(topology))
    bound = peak_load_lower_bound(weight, num_replicas, num_gpus, num_groups, num_nodes)
    best = balancedness_upper_bound(weight, num_replicas, num_gpus, num_groups, num_nodes)
    for policy in (default, flashlb):
        phy2log, _, logcnt = policy.rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
        peak = rank_loads(weight, phy2log, logcnt, num_gpus).amax(-1)
        assert (peak >= bound * (1 - 1e-12)).all()
        assert balancedness(weight, phy2log, logcnt, num_gpus) <= best + 1e-12


def test_zipf_bounds():
    weight = zipf_loads(4, 256, 1.2, seed=0)
    assert balancedness_upper_bound(weight, 256, 64) == pytest.approx(0.0614, abs=1e-4)
    assert balancedness_upper_bound(weight, 320, 64) == pytest.approx(1.0)
    assert balancedness_upper_bound(weight, 320, 64, 8, 8) < 0.5  # the hottest group's node


def test_zero_loads_and_zero_layers():
    assert balancedness_upper_bound(torch.zeros(2, 8), 8, 4) == 1.0
    assert peak_load_lower_bound(torch.zeros(2, 8), 16, 4).tolist() == [0.0, 0.0]
    assert peak_load_lower_bound(torch.zeros(0, 8), 16, 4).shape == (0,)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(2, 8), 6, 2), r"num_replicas \(6\) must be >="),
        ((torch.ones(2, 8), 10, 4), r"num_replicas \(10\) must be divisible by num_gpus"),
        ((torch.ones(8), 8, 4), "weight must be 2-D"),
        ((-torch.ones(2, 8), 8, 4), "negative"),
    ],
)
def test_bound_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        peak_load_lower_bound(*args)
    with pytest.raises(ValueError, match="num_replicas"):
        min_max_replica_load(torch.ones(2, 8), 4)
