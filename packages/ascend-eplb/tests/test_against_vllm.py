"""Cross-check of the default policy against vLLM's own implementation.

Imports vLLM unconditionally: this file belongs to the sessions that have vLLM
installed (the package's own test session ignores test_against_vllm*.py), and
there a missing or moved vLLM module must fail, not skip.
"""

import pytest
import torch
from vllm.distributed.eplb.policy.default import DefaultEplbPolicy

import ascend_eplb

from eplb_cases import README_ARGS, README_PHY2LOG, README_WEIGHT, TOPOLOGIES


def vllm_phy2log(weight, num_replicas, num_groups, num_nodes, num_gpus):
    result = DefaultEplbPolicy.rebalance_experts(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    # Older vLLM returned (phy2log, log2phy, logcnt); 0.32 returns phy2log alone.
    return result[0] if isinstance(result, tuple) else result


def test_readme_example_matches_vllm():
    ours, _, _ = ascend_eplb.rebalance_experts(README_WEIGHT, **README_ARGS)
    theirs = vllm_phy2log(README_WEIGHT, *README_ARGS.values())
    assert torch.equal(theirs, README_PHY2LOG)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_random_loads_match_vllm(topology):
    num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus = topology
    gen = torch.Generator().manual_seed(1234 + sum(topology))
    for _ in range(10):
        # float32 loads: vLLM computes in float32, so both see the very same numbers.
        weight = (torch.rand(num_layers, num_experts, generator=gen) ** 3 * 1000).float()
        ours, _, logcnt = ascend_eplb.rebalance_experts(
            weight, num_replicas, num_groups, num_nodes, num_gpus
        )
        theirs = vllm_phy2log(weight, num_replicas, num_groups, num_nodes, num_gpus)
        assert torch.equal(ours, theirs.to(torch.int64)), (topology, weight)
        counted = torch.zeros_like(logcnt).scatter_add_(-1, theirs, torch.ones_like(theirs))
        assert torch.equal(logcnt, counted)


def test_integer_token_counts_match_vllm():
    gen = torch.Generator().manual_seed(5)
    # Distinct counts, so that no tie-breaking order is involved.
    weight = torch.stack([torch.randperm(64, generator=gen) * 37 + 11 for _ in range(6)])
    ours, _, _ = ascend_eplb.rebalance_experts(weight, 96, 8, 2, 16)
    assert torch.equal(ours, vllm_phy2log(weight, 96, 8, 2, 16))
