"""Expert-parallel load balancing (EPLB) for MoE models on Ascend.

``rebalance_experts`` computes a placement of physical experts onto GPUs from
per-expert loads with a named policy from core's ``EPLB_POLICIES`` registry;
``register()`` fills that registry with this package's policies. Imports no vLLM.
"""

from __future__ import annotations

from typing import Any

import torch

from ascend_core.registry import EPLB_POLICIES, RegistryError
from ascend_eplb.__about__ import __version__
from ascend_eplb.validation import UnknownEplbPolicyError

__all__ = ["UnknownEplbPolicyError", "__version__", "rebalance_experts", "register"]


def register() -> None:
    """Register this package's policies in ``ascend_core.registry.EPLB_POLICIES``.

    Idempotent: the registry accepts the same function under the same name again.
    """
    from ascend_eplb.policies.default import rebalance_experts as default_policy

    EPLB_POLICIES.register("default", default_policy)


def rebalance_experts(
    weight: torch.Tensor | Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: str = "default",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(phy2log, log2phy, logcnt)`` from the EPLB policy named ``policy``.

    See ``ascend_eplb.policies.default.rebalance_experts`` for the arguments and the
    shapes; every registered policy shares that signature.
    """
    register()
    try:
        policy_fn = EPLB_POLICIES.get(policy)
    except RegistryError as err:
        raise UnknownEplbPolicyError(str(err)) from None
    return policy_fn(weight, num_replicas, num_groups, num_nodes, num_gpus)
