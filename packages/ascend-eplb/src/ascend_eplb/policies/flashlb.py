"""The "flashlb" policy: a search over replica counts and placements for the lowest
peak GPU load (after the FlashLB idea of treating EPLB as a search problem rather than
one greedy pass).

For each row (a layer, or a layer's node when hierarchical; see ``_layout``):

1. several replica-count candidates: the optimal largest load per replica ``c*`` is
   found by bisection; each candidate caps replicas at ``f * c*`` (f = 1, 1.15, 1.3,
   1.5) and hands the leftover slots either to the largest replicas (DeepSeek's greedy)
   or to the heaviest experts that still have one replica;
2. each candidate is packed in rounds (every GPU gets one replica per round, heaviest
   replicas to the lightest GPUs); the candidate with the lowest peak is kept;
3. a local search swaps replicas between GPUs (heavy/light pairs, then the heaviest
   GPU against every slot) while that lowers the peak, until the peak is within 0.05%
   of the mean GPU load or of what these replicas can reach.

On the published FlashLB example (hotness [600, 560, 120, 120, 20, 10, 10, 10] on 8
ranks with 2 slots each) it reaches a peak of 200, where DeepSeek's greedy gets 232.
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_eplb._threads import one_thread
from ascend_eplb.placement import align_to_previous, check_phy2log, log2phy_from_phy2log
from ascend_eplb.policies._layout import node_rows, validated
from ascend_eplb.policies._search import search_placement

__all__ = ["rebalance_experts"]


@one_thread
def rebalance_experts(
    weight: torch.Tensor | Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    previous: torch.Tensor | Any | None = None,
    max_iterations: int = 12,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Place ``num_replicas`` physical experts on ``num_gpus`` GPUs, minimising the peak.

    Arguments and results as ``ascend_eplb.policies.default.rebalance_experts``.
    ``previous`` (an earlier ``phy2log``, same shape), when given, only reorders slots
    inside each GPU so that experts already there keep their slots (fewer weight
    copies; loads are unchanged). ``max_iterations`` bounds the local search.
    """
    weight, num_replicas, num_groups, num_nodes, num_gpus, _ = validated(
        weight, num_replicas, num_groups, num_nodes, num_gpus
    )
    num_layers, num_experts = weight.shape
    if previous is not None:
        previous = check_phy2log(
            previous,
            num_experts,
            num_gpus,
            name="previous",
            num_layers=num_layers,
            num_replicas=num_replicas,
        )
    rows = node_rows(weight, num_replicas, num_groups, num_nodes, num_gpus)
    local = search_placement(
        rows.weight(weight), rows.num_slots, rows.num_gpus, max_iterations=max_iterations
    )
    phy2log = rows.phy2log(local)
    if previous is not None:
        phy2log = align_to_previous(phy2log, previous, num_gpus)
    log2phy, logcnt = log2phy_from_phy2log(phy2log, num_experts)
    return phy2log, log2phy, logcnt
