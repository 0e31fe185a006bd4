"""Argument checks shared by every EPLB policy.

Policies are called directly from core's registry as well as through
``ascend_eplb.rebalance_experts``, so each policy validates its own arguments
with these helpers; errors name the argument, its value and what would be right.
Wrong values raise ValueError;
Python objects of the wrong type (a float or str count, a weight that is no
array) raise TypeError.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ascend_core.registry import RegistryError


class UnknownEplbPolicyError(RegistryError, ValueError):
    """An EPLB policy name that is not registered.

    Both a ``RegistryError`` (what core's registries raise) and a ``ValueError``
    (what every other bad argument to ``rebalance_experts`` raises).
    """


def as_load_matrix(weight: Any) -> torch.Tensor:
    """``weight`` as a float64 CPU tensor ``[layers, experts]``.

    TypeError if torch cannot make a tensor of it, ValueError for a wrong shape,
    dtype or value.

    float64 because loads are often token counts, which float32 stops representing
    exactly above 2**24.
    """
    if not isinstance(weight, torch.Tensor):
        try:
            weight = torch.as_tensor(weight)
        except (TypeError, ValueError, RuntimeError) as err:
            raise TypeError(
                "weight must be a tensor of expert loads shaped [layers, experts], "
                f"got an object of type {type(weight).__name__} that torch cannot convert: {err}"
            ) from None
    if weight.dim() != 2:
        raise ValueError(
            "weight must be 2-D, shaped [layers, experts], "
            f"got {weight.dim()}-D with shape {tuple(weight.shape)}"
            + (
                "; add a layer dimension with weight.unsqueeze(0)"
                if weight.dim() == 1
                else ""
            )
        )
    if weight.dtype == torch.bool or weight.is_complex():
        raise ValueError(
            f"weight must hold real numbers (an integer or floating dtype), got {weight.dtype}"
        )
    weight = weight.detach().to(device="cpu", dtype=torch.float64)
    _check_finite_non_negative(weight)
    return weight


def _check_finite_non_negative(weight: torch.Tensor) -> None:
    for bad, what in (
        (torch.isnan(weight), "NaN"),
        (torch.isinf(weight), "infinite"),
        (weight < 0, "negative"),
    ):
        if bad.any():
            layer, expert = (int(i) for i in bad.nonzero()[0])
            count = int(bad.sum())
            raise ValueError(
                f"weight must hold finite, non-negative loads; found {count} {what} "
                f"value(s), the first at [layer {layer}, expert {expert}] = "
                f"{weight[layer, expert].item()}"
            )


def positive_int(name: str, value: Any) -> int:
    """``value`` as an int >= 1; TypeError for a non-integer, ValueError for one < 1."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a positive integer, got the bool {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be a positive integer, got {value!r} of type {type(value).__name__}"
        ) from None
    if number < 1:
        raise ValueError(f"{name} must be a positive integer (>= 1), got {number}")
    return number


def check_topology(
    num_experts: int, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> None:
    """The shape constraints every placement of experts onto GPUs must meet."""
    if num_experts < 1:
        raise ValueError("weight must have at least one expert (column), got 0")
    if num_replicas < num_experts:
        raise ValueError(
            f"num_replicas ({num_replicas}) must be >= the number of logical experts "
            f"({num_experts}) so that every expert gets at least one replica; "
            f"use num_replicas = {num_experts} + the number of redundant experts"
        )
    if num_replicas % num_gpus:
        lower = num_replicas - num_replicas % num_gpus
        raise ValueError(
            f"num_replicas ({num_replicas}) must be divisible by num_gpus ({num_gpus}) "
            "so that every GPU holds the same number of experts; nearest valid values: "
            + (f"{lower} or " if lower >= num_experts else "")
            + f"{lower + num_gpus}"
        )
    if num_gpus % num_nodes:
        raise ValueError(
            f"num_gpus ({num_gpus}) must be divisible by num_nodes ({num_nodes}): "
            "every node holds the same number of GPUs"
        )
