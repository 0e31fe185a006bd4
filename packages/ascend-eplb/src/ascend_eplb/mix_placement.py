"""Mix placement: shared experts placed and balanced like routed experts.

A shared expert (DeepSeek-V3, Qwen2-MoE) sees every token, so as a placeable item it
is an always-hot expert: its load is the number of tokens of the layer, i.e. the
routed load divided by ``top_k`` (each token makes ``top_k`` routed choices). With
the shared experts appended to the load matrix as experts ``num_routed ...
num_routed + num_shared - 1``, any policy places them: being the hottest items they
get the most replicas, spread over ranks, instead of a full copy on every rank.
A planning tool: serving still keeps the shared experts on every rank, as vLLM does
(there is no ``eplb_config`` key for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import ascend_eplb
from ascend_eplb.validation import as_load_matrix, positive_int

__all__ = ["MixPlacement", "plan_mix_placement", "with_shared_experts"]


def with_shared_experts(weight: Any, num_shared_experts: int, top_k: int) -> torch.Tensor:
    """``weight`` [layers, routed] extended to [layers, routed + shared] float64.

    Each shared expert's load is the layer's token count, ``weight.sum(-1) / top_k``.
    """
    weight = as_load_matrix(weight)
    if isinstance(num_shared_experts, bool) or not isinstance(num_shared_experts, int) or (
        num_shared_experts < 0
    ):
        raise ValueError(f"num_shared_experts must be an integer >= 0, got {num_shared_experts!r}")
    top_k = positive_int("top_k", top_k)
    if top_k > weight.size(1):
        raise ValueError(
            f"top_k ({top_k}) cannot exceed the number of routed experts ({weight.size(1)})"
        )
    tokens = weight.sum(-1, keepdim=True) / top_k
    return torch.cat([weight, tokens.expand(-1, num_shared_experts)], dim=-1)


@dataclass(frozen=True)
class MixPlacement:
    phy2log: torch.Tensor  # [layers, num_replicas]; ids >= num_routed are shared experts
    log2phy: torch.Tensor  # [layers, num_routed + num_shared, max_replicas], -1 padded
    logcnt: torch.Tensor  # [layers, num_routed + num_shared]
    num_routed: int
    num_shared: int

    def is_shared(self) -> torch.Tensor:
        """[layers, num_replicas] bool: slots that hold a shared expert."""
        return self.phy2log >= self.num_routed

    @property
    def shared_replicas(self) -> torch.Tensor:
        """[layers, num_shared] int64: replicas of each shared expert."""
        return self.logcnt[:, self.num_routed :]


def plan_mix_placement(
    weight: Any,
    num_shared_experts: int,
    top_k: int,
    num_replicas: int,
    num_gpus: int,
    *,
    num_nodes: int = 1,
    policy: str = "default",
    **options: Any,
) -> MixPlacement:
    """Place routed and shared experts together on ``num_replicas`` slots.

    ``num_replicas`` counts every slot, shared ones included, so it must be at least
    ``routed + shared``. Expert groups do not survive the extra experts, so the
    placement is global (one group) whatever ``num_nodes``. ``options`` go to the
    policy (e.g. ``previous=`` a mixed placement in service).
    """
    extended = with_shared_experts(weight, num_shared_experts, top_k)
    num_routed = extended.size(1) - num_shared_experts
    # One group: hierarchical placement needs groups divisible by nodes and experts by
    # groups, which the appended shared experts break.
    phy2log, log2phy, logcnt = ascend_eplb.rebalance_experts(
        extended, num_replicas, 1, num_nodes, num_gpus, policy=policy, **options
    )
    return MixPlacement(phy2log, log2phy, logcnt, num_routed, num_shared_experts)
