import itertools

import pytest
import torch

import ascend_eplb
from ascend_eplb.metrics import balancedness, peak_load_lower_bound, rank_loads
from ascend_eplb.policies import default, flashlb
from ascend_eplb.synthetic import zipf_loads

from eplb_cases import (
    FLASHLB_ARGS,
    FLASHLB_WEIGHT,
    TOPOLOGIES,
    check_placement,
    random_weight,
)


def peak(weight, phy2log, logcnt, num_gpus):
    return rank_loads(weight, phy2log, logcnt, num_gpus).amax(-1)


def best_peak_by_brute_force(weight, num_gpus, slots_per_gpu):
    """The optimum of the FlashLB example: every replica count vector, every pairing."""
    loads = weight[0].tolist()
    num_slots = num_gpus * slots_per_gpu
    best = float("inf")
    extra = num_slots - len(loads)
    for split in itertools.product(range(extra + 1), repeat=len(loads)):
        if sum(split) != extra:
            continue
        pieces = sorted(
            (load / (1 + s) for load, s in zip(loads, split) for _ in range(1 + s)), reverse=True
        )
        # Two slots per GPU: pairing largest with smallest is optimal for a fixed multiset.
        best = min(best, max(pieces[i] + pieces[-1 - i] for i in range(num_gpus)))
    return best


def test_flashlb_example_golden():
    _, _, counts = default.rebalance_experts(FLASHLB_WEIGHT, **FLASHLB_ARGS)
    phy2log, log2phy, logcnt = flashlb.rebalance_experts(FLASHLB_WEIGHT, **FLASHLB_ARGS)
    default_phy2log = default.rebalance_experts(FLASHLB_WEIGHT, **FLASHLB_ARGS)[0]
    assert peak(FLASHLB_WEIGHT, default_phy2log, counts, 8).item() == 232
    assert peak(FLASHLB_WEIGHT, phy2log, logcnt, 8).item() <= 205
    check_placement(FLASHLB_WEIGHT, phy2log, log2phy, logcnt, 16, 8)


def test_flashlb_example_close_to_the_optimum():
    phy2log, _, logcnt = flashlb.rebalance_experts(FLASHLB_WEIGHT, **FLASHLB_ARGS)
    # counts 4, 3, 3, 2, 1, 1, 1, 1: 186.7 + 10 on three ranks
    optimum = best_peak_by_brute_force(FLASHLB_WEIGHT, 8, 2)
    assert optimum == pytest.approx(590 / 3)
    assert peak(FLASHLB_WEIGHT, phy2log, logcnt, 8).item() == pytest.approx(200)
    assert peak_load_lower_bound(FLASHLB_WEIGHT, 16, 8).item() <= optimum


def test_flashlb_through_the_registry():
    got = ascend_eplb.rebalance_experts(FLASHLB_WEIGHT, **FLASHLB_ARGS, policy="flashlb")
    want = flashlb.rebalance_experts(FLASHLB_WEIGHT, **FLASHLB_ARGS)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_invariants_and_at_least_default_balance(topology):
    num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus = topology
    for seed in range(3):
        weight = random_weight(num_layers, num_experts, seed=seed + sum(topology))
        phy2log, log2phy, logcnt = flashlb.rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
        check_placement(weight, phy2log, log2phy, logcnt, num_replicas, num_gpus)
        d_phy2log, _, d_logcnt = default.rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
        ours = balancedness(weight, phy2log, logcnt, num_gpus)
        theirs = balancedness(weight, d_phy2log, d_logcnt, num_gpus)
        assert ours >= theirs - 1e-6, (topology, seed)
        bound = peak_load_lower_bound(weight, num_replicas, num_gpus, num_groups, num_nodes)
        assert (peak(weight, phy2log, logcnt, num_gpus) >= bound * (1 - 1e-9)).all()


@pytest.mark.parametrize("topology", [t for t in TOPOLOGIES if t[3] % t[4] == 0 and t[4] > 1])
def test_hierarchical_keeps_groups_and_replicas_inside_one_node(topology):
    num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus = topology
    weight = random_weight(num_layers, num_experts, seed=11)
    phy2log, _, _ = flashlb.rebalance_experts(weight, num_replicas, num_groups, num_nodes, num_gpus)
    group_size = num_experts // num_groups
    slot_node = torch.arange(num_replicas) // (num_replicas // num_nodes)
    for layer in range(num_layers):
        node_of_group = {}
        for slot, expert in enumerate(phy2log[layer].tolist()):
            group = expert // group_size
            assert node_of_group.setdefault(group, int(slot_node[slot])) == slot_node[slot]


def test_zipf_benchmark_case_global_s12_64_redundant():
    weight = zipf_loads(58, 256, 1.2, seed=0)
    phy2log, _, logcnt = flashlb.rebalance_experts(weight, 320, 1, 1, 64)
    d_phy2log, _, d_logcnt = default.rebalance_experts(weight, 320, 1, 1, 64)
    assert balancedness(weight, d_phy2log, d_logcnt, 64) == pytest.approx(0.9056, abs=1e-4)
    assert balancedness(weight, phy2log, logcnt, 64) >= 0.97


def test_previous_only_reorders_slots_inside_gpus():
    weight = random_weight(3, 16, seed=5)
    plain, _, logcnt = flashlb.rebalance_experts(weight, 24, 1, 1, 4)
    previous = default.rebalance_experts(weight.flip(-1), 24, 1, 1, 4)[0]
    aligned, log2phy, aligned_cnt = flashlb.rebalance_experts(weight, 24, 1, 1, 4, previous=previous)
    check_placement(weight, aligned, log2phy, aligned_cnt, 24, 4)
    assert torch.equal(logcnt, aligned_cnt)
    for layer in range(3):
        for gpu in range(4):
            got = aligned[layer, gpu * 6 : (gpu + 1) * 6]
            assert sorted(got.tolist()) == sorted(plain[layer, gpu * 6 : (gpu + 1) * 6].tolist())
            old = previous[layer, gpu * 6 : (gpu + 1) * 6]
            # an expert both old and new on this GPU stays in its old slot
            for slot in range(6):
                if int(old[slot]) in got.tolist() and old.tolist().count(int(old[slot])) == 1:
                    assert got[slot] == old[slot]


def test_zero_loads_zero_layers_and_no_redundancy():
    phy2log, log2phy, logcnt = flashlb.rebalance_experts(torch.zeros(2, 8), 16, 1, 1, 4)
    check_placement(torch.zeros(2, 8), phy2log, log2phy, logcnt, 16, 4)
    phy2log, log2phy, logcnt = flashlb.rebalance_experts(torch.zeros(0, 8), 16, 2, 1, 4)
    assert phy2log.shape == (0, 16) and logcnt.shape == (0, 8)
    weight = random_weight(2, 12, seed=1)
    phy2log, log2phy, logcnt = flashlb.rebalance_experts(weight, 12, 1, 1, 3)
    assert (logcnt == 1).all()
    check_placement(weight, phy2log, log2phy, logcnt, 12, 3)


def test_one_gpu_and_one_slot_per_gpu():
    weight = random_weight(2, 6, seed=2)
    phy2log, log2phy, logcnt = flashlb.rebalance_experts(weight, 9, 1, 1, 1)
    check_placement(weight, phy2log, log2phy, logcnt, 9, 1)
    phy2log, log2phy, logcnt = flashlb.rebalance_experts(weight, 6, 1, 1, 6)
    check_placement(weight, phy2log, log2phy, logcnt, 6, 6)


@pytest.mark.parametrize(
    "args, match",
    [
        ((torch.ones(12), 16, 4, 2, 8), "weight must be 2-D"),
        ((torch.ones(2, 12), 18, 4, 2, 8), r"num_replicas \(18\) must be divisible"),
        ((torch.ones(2, 12), 24, 4, 4, 6), r"num_gpus \(6\) must be divisible by num_nodes"),
        ((torch.ones(2, 12), 8, 1, 1, 4), r"num_replicas \(8\) must be >="),
        ((torch.ones(2, 12), 16, 8, 2, 8), r"divisible by num_groups \(8\)"),
        ((-torch.ones(2, 12), 16, 4, 2, 8), "negative"),
        ((torch.full((2, 12), float("nan")), 16, 4, 2, 8), "NaN"),
    ],
)
def test_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        flashlb.rebalance_experts(*args)


def test_bad_previous():
    weight = torch.ones(2, 8)
    with pytest.raises(ValueError, match=r"previous has 12 slots per layer, expected 16"):
        flashlb.rebalance_experts(weight, 16, 1, 1, 4, previous=torch.zeros(2, 12, dtype=torch.long))
    with pytest.raises(ValueError, match="no replica"):
        flashlb.rebalance_experts(weight, 16, 1, 1, 4, previous=torch.zeros(2, 16, dtype=torch.long))
