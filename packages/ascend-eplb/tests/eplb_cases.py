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
