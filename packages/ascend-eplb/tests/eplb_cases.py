"""Inputs shared by the tests (a plain module, not a conftest, so test_against_vllm.py
can import it the same way)."""

import torch

# DeepSeek EPLB README example: 2 layers, 12 experts in 4 groups, 2 nodes, 8 GPUs.
README_WEIGHT = torch.tensor(
    [
        [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
        [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
    ]
)
README_ARGS = {"num_replicas": 16, "num_groups": 4, "num_nodes": 2, "num_gpus": 8}
README_PHY2LOG = torch.tensor(
    [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
)

# The FlashLB paper's example: 8 experts on 8 ranks with 2 slots each (global placement).
# DeepSeek's greedy gives a peak rank load of 232; FlashLB reports 205.
FLASHLB_WEIGHT = torch.tensor([[600.0, 560, 120, 120, 20, 10, 10, 10]])
FLASHLB_ARGS = {"num_replicas": 16, "num_groups": 1, "num_nodes": 1, "num_gpus": 8}

# (num_layers, num_experts, num_replicas, num_groups, num_nodes, num_gpus); hierarchical
# when num_groups % num_nodes == 0, global otherwise.
TOPOLOGIES = [
    (3, 16, 16, 4, 2, 4),  # hierarchical, no redundancy
    (4, 16, 24, 4, 2, 8),  # hierarchical
    (2, 32, 48, 8, 4, 8),  # hierarchical, 2 GPUs per node
    (3, 12, 18, 3, 2, 6),  # global: 3 groups do not split over 2 nodes
    (2, 10, 15, 1, 1, 5),  # global, one node
    (2, 8, 32, 2, 2, 4),  # many replicas per expert
    (5, 64, 80, 8, 2, 16),  # larger
]


def random_weight(num_layers: int, num_experts: int, seed: int) -> torch.Tensor:
    """Skewed random loads (distinct almost surely, so no ties)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(num_layers, num_experts, generator=gen, dtype=torch.float64) ** 3 * 1000


def check_placement(weight, phy2log, log2phy, logcnt, num_replicas, num_gpus):
    num_layers, num_experts = weight.shape
    assert phy2log.shape == (num_layers, num_replicas)
    assert logcnt.shape == (num_layers, num_experts)
    assert log2phy.shape[:2] == (num_layers, num_experts)
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert log2phy.shape[2] == int(logcnt.max())

    assert (logcnt >= 1).all(), "every logical expert needs a replica"
    assert (logcnt.sum(dim=-1) == num_replicas).all()
    counted = torch.zeros_like(logcnt).scatter_add_(-1, phy2log, torch.ones_like(phy2log))
    assert torch.equal(counted, logcnt)

    # log2phy lists exactly the slots of each expert, then -1 padding.
    for layer in range(num_layers):
        for expert in range(num_experts):
            slots = log2phy[layer, expert]
            n = int(logcnt[layer, expert])
            assert (slots[n:] == -1).all()
            assert sorted(slots[:n].tolist()) == (phy2log[layer] == expert).nonzero().flatten().tolist()

    # Every GPU gets num_replicas / num_gpus slots and the slots hold every expert.
    assert num_replicas % num_gpus == 0
    per_gpu = phy2log.view(num_layers, num_gpus, num_replicas // num_gpus)
    for layer in range(num_layers):
        assert set(per_gpu[layer].flatten().tolist()) == set(range(num_experts))
