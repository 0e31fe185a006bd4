"""Cross-checks of the search policies and the synthetic loads against vLLM's default.

Imports vLLM unconditionally, like test_against_vllm.py: it belongs to the sessions
that have vLLM installed.
"""

import pytest
import torch
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

from ascend_eplb.metrics import balancedness
from ascend_eplb.placement import logcnt_from_phy2log
from ascend_eplb.policies import default, flashlb, swift
from ascend_eplb.synthetic import drift_loads, zipf_loads
from ascend_eplb.transfer import plan_transfers

from eplb_cases import random_weight


def vllm_plan(weight, num_replicas, num_groups, num_nodes, num_gpus, previous=None):
    result = DefaultEplbPolicy.rebalance_experts(
        weight, num_replicas, num_groups, num_nodes, num_gpus, previous
    )
    return (result[0] if isinstance(result, tuple) else result).to(torch.int64)


def bal(weight, phy2log, num_gpus):
    return balancedness(weight, phy2log, logcnt_from_phy2log(phy2log, weight.size(1)), num_gpus)


@pytest.mark.parametrize(
    "s, figures", [(0.6, (0.297, 0.993, 0.995)), (1.2, (0.061, 0.906, 0.986))]
)
def test_zipf_generator_reproduces_the_issue_figures(s, figures):
    weight = zipf_loads(58, 256, s, seed=0)
    got = tuple(round(bal(weight, vllm_plan(weight, 256 + r, 1, 1, 64), 64), 3) for r in (0, 64, 128))
    assert got == figures


@pytest.mark.parametrize("s", [0.6, 1.2])
@pytest.mark.parametrize("redundant", [0, 16, 32])
@pytest.mark.parametrize("groups, nodes", [(4, 4), (1, 1)])
def test_search_policies_at_least_as_balanced_as_vllm(s, redundant, groups, nodes):
    weight = zipf_loads(8, 64, s, seed=1)
    args = (64 + redundant, groups, nodes, 16)
    reference = bal(weight, vllm_plan(weight, *args), 16)
    for policy in (flashlb, swift):
        phy2log = policy.rebalance_experts(weight, *args)[0]
        assert bal(weight, phy2log, 16) >= reference - 1e-9, policy.__name__


def test_default_with_previous_matches_vllm_slot_preservation():
    weight = random_weight(4, 32, seed=9).float()
    previous = default.rebalance_experts(weight.flip(-1), 48, 4, 2, 8)[0]
    ours = default.rebalance_experts(weight, 48, 4, 2, 8, previous=previous)[0]
    theirs = vllm_plan(weight, 48, 4, 2, 8, previous=previous)
    assert torch.equal(ours, theirs)


def test_swift_after_drift_against_vllm():
    weight = zipf_loads(16, 128, 1.2, seed=2)
    args = (160, 1, 1, 32)
    ours, theirs = swift.rebalance_experts(weight, *args)[0], vllm_plan(weight, *args)
    our_bytes = their_bytes = 0
    for step in range(2):
        weight = drift_loads(weight, 0.1, seed=step + 1)
        new_ours = swift.rebalance_experts(weight, *args, previous=ours)[0]
        new_theirs = vllm_plan(weight, *args, previous=theirs)
        our_bytes += plan_transfers(ours, new_ours, 32, 1).total_bytes
        their_bytes += plan_transfers(theirs, new_theirs, 32, 1).total_bytes
        assert bal(weight, new_ours, 32) >= 0.98 * bal(weight, new_theirs, 32)
        ours, theirs = new_ours, new_theirs
    assert our_bytes <= their_bytes / 2


@pytest.mark.parametrize("groups, nodes", [(8, 8), (8, 2), (1, 1)])
def test_default_matches_vllm_even_with_exact_ties(groups, nodes):
    # Zipf with s = 1: the expert ranked 2r carries exactly half of the one ranked r.
    weight = zipf_loads(12, 64, 1.0, seed=4)
    for redundant in (0, 16, 32):
        args = (64 + redundant, groups, nodes, 16)
        assert torch.equal(default.rebalance_experts(weight, *args)[0], vllm_plan(weight, *args))
