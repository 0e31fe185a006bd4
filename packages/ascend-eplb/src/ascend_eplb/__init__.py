"""Expert-parallel load balancing (EPLB) for MoE models on Ascend.

``rebalance_experts`` computes a placement of physical experts onto GPUs from
per-expert loads with a named policy from core's ``EPLB_POLICIES`` registry;
``register()`` fills that registry with this package's policies (``default``,
``swift``, ``flashlb``) and, inside a process that runs vLLM, core's custom-op
registry with the EPLB MoE layer (``ascend_eplb.vllm``). Imports no vLLM itself.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch

from ascend_core.registry import EPLB_POLICIES, RegistryError
from ascend_eplb.__about__ import __version__
from ascend_eplb.validation import UnknownEplbPolicyError

__all__ = ["POLICY_NAMES", "UnknownEplbPolicyError", "__version__", "rebalance_experts", "register"]

POLICY_NAMES = ("default", "flashlb", "swift")


def register() -> None:
    """Register this package's policies in ``ascend_core.registry.EPLB_POLICIES``.

    Idempotent: the registry accepts the same function under the same name again.
    In a process where vLLM is already imported (vLLM calls the plugin's entry points),
    it also registers the EPLB MoE layer in ``ascend_core.registry.CUSTOM_OPS``;
    elsewhere it imports no vLLM.
    """
    from ascend_eplb.policies import default, flashlb, swift

    EPLB_POLICIES.register("default", default.rebalance_experts)
    EPLB_POLICIES.register("flashlb", flashlb.rebalance_experts)
    EPLB_POLICIES.register("swift", swift.rebalance_experts)
    if "vllm" in sys.modules:
        from ascend_eplb.vllm import register_layers

        register_layers()


def rebalance_experts(
    weight: torch.Tensor | Any,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    policy: str = "default",
    **options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(phy2log, log2phy, logcnt)`` from the EPLB policy named ``policy``.

    See ``ascend_eplb.policies.default.rebalance_experts`` for the arguments and the
    shapes; every registered policy shares that signature. ``options`` are keyword
    arguments of the chosen policy, e.g. ``previous=phy2log`` (all three policies),
    ``max_moves_per_layer=`` and ``threshold=`` (``swift``); an option the policy does
    not take raises ``TypeError`` naming the ones it does.
    """
    register()
    try:
        policy_fn = EPLB_POLICIES.get(policy)
    except RegistryError as err:
        raise UnknownEplbPolicyError(str(err)) from None
    if options:
        _check_options(policy, policy_fn, options)
    return policy_fn(weight, num_replicas, num_groups, num_nodes, num_gpus, **options)


def _check_options(policy: str, policy_fn: Any, options: dict[str, Any]) -> None:
    try:
        parameters = inspect.signature(policy_fn).parameters
    except (TypeError, ValueError):  # a builtin or C callable: let the call decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    accepted = [
        name
        for name, p in parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise TypeError(
            f"EPLB policy {policy!r} takes no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(accepted) or 'none'}"
        )
