"""Splitting a layer's balancing problem into independent rows, one per node.

Hierarchical placement (``num_groups % num_nodes == 0``) first packs expert groups onto
nodes, as DeepSeek's algorithm does, so that group-limited routing stays inside a node;
each (layer, node) is then balanced on its own over that node's slots and GPUs. The
global placement is one row per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ascend_eplb.policies.default import balanced_packing
from ascend_eplb.validation import as_load_matrix, check_topology, positive_int


@dataclass(frozen=True)
class Rows:
    """Rows of a [layers, experts] problem: row ``layer * num_nodes + node``."""

    num_layers: int
    num_nodes: int
    num_gpus: int  # GPUs per row
    num_slots: int  # slots per row
    experts: torch.Tensor  # [rows, experts per row] int64: logical id of each local expert

    def weight(self, weight: torch.Tensor) -> torch.Tensor:
        """Loads of each row's experts: [rows, experts per row]."""
        per_row = weight.repeat_interleave(self.num_nodes, dim=0)
        return per_row.gather(-1, self.experts)

    def phy2log(self, local: torch.Tensor) -> torch.Tensor:
        """[rows, num_slots] local expert ids -> phy2log [layers, num_replicas] (a node's
        GPUs, and so its slots, are contiguous)."""
        logical = self.experts.gather(-1, local)
        return logical.view(self.num_layers, self.num_nodes * self.num_slots)


def validated(
    weight, num_replicas, num_groups, num_nodes, num_gpus
) -> tuple[torch.Tensor, int, int, int, int, bool]:
    """Checked arguments plus whether the placement is hierarchical."""
    weight = as_load_matrix(weight)
    num_replicas = positive_int("num_replicas", num_replicas)
    num_groups = positive_int("num_groups", num_groups)
    num_nodes = positive_int("num_nodes", num_nodes)
    num_gpus = positive_int("num_gpus", num_gpus)
    num_experts = weight.size(1)
    check_topology(num_experts, num_replicas, num_groups, num_nodes, num_gpus)
    hierarchical = num_groups % num_nodes == 0
    if hierarchical and num_experts % num_groups:
        raise ValueError(
            f"the number of experts ({num_experts}, weight's second dimension) must be "
            f"divisible by num_groups ({num_groups}) for hierarchical balancing "
            f"(used because num_groups is a multiple of num_nodes={num_nodes}); "
            "pass the model's real expert-group count, or num_groups=1 for global balancing"
        )
    return weight, num_replicas, num_groups, num_nodes, num_gpus, hierarchical


def node_rows(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> Rows:
    """Rows after packing groups onto nodes (hierarchical) or one row per layer (global)."""
    num_layers, num_experts = weight.shape
    if num_groups % num_nodes or num_nodes == 1:
        experts = torch.arange(num_experts, dtype=torch.int64).expand(num_layers, -1)
        return Rows(num_layers, 1, num_gpus, num_replicas, experts.contiguous())
    group_size = num_experts // num_groups
    groups_per_node = num_groups // num_nodes
    group_load = weight.view(num_layers, num_groups, group_size).sum(-1)
    group_node, group_rank = balanced_packing(group_load, num_nodes)
    first = (group_node * groups_per_node + group_rank) * group_size
    position = (first.unsqueeze(-1) + torch.arange(group_size)).flatten(-2)  # log -> slot
    experts = torch.empty_like(position).scatter_(
        -1, position, torch.arange(num_experts).expand(num_layers, -1).contiguous()
    )
    return Rows(
        num_layers,
        num_nodes,
        num_gpus // num_nodes,
        num_replicas // num_nodes,
        experts.view(num_layers * num_nodes, num_experts // num_nodes),
    )
