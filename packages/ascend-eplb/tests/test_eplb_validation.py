import math

import pytest
import torch

import ascend_eplb
from ascend_core.registry import RegistryError
from ascend_eplb import UnknownEplbPolicyError, rebalance_experts

from eplb_cases import README_WEIGHT

GOOD = {"num_replicas": 16, "num_groups": 4, "num_nodes": 2, "num_gpus": 8}


def call(weight=README_WEIGHT, **overrides):
    return rebalance_experts(weight, **{**GOOD, **overrides})


@pytest.mark.parametrize(
    "weight, match",
    [
        (torch.ones(12), r"weight must be 2-D.*got 1-D with shape \(12,\).*unsqueeze\(0\)"),
        (torch.ones(2, 3, 4), r"weight must be 2-D.*got 3-D"),
        (torch.tensor(5.0), r"weight must be 2-D.*got 0-D"),
        (torch.ones(2, 12, dtype=torch.bool), "real numbers.*torch.bool"),
    ],
)
def test_weight_shape_and_type(weight, match):
    with pytest.raises(ValueError, match=match):
        call(weight)


@pytest.mark.parametrize(
    "value, what", [(-3.0, "negative"), (math.nan, "NaN"), (math.inf, "infinite")]
)
def test_weight_values(value, what):
    weight = README_WEIGHT.double()
    weight[1, 4] = value
    with pytest.raises(ValueError, match=rf"1 {what} value\(s\), the first at \[layer 1, expert 4\]"):
        call(weight)


def test_num_replicas_not_divisible_by_num_gpus():
    with pytest.raises(
        ValueError,
        match=r"num_replicas \(18\) must be divisible by num_gpus \(8\).*16 or 24",
    ):
        call(num_replicas=18)


def test_num_gpus_not_divisible_by_num_nodes():
    with pytest.raises(ValueError, match=r"num_gpus \(6\) must be divisible by num_nodes \(4\)"):
        call(num_gpus=6, num_replicas=24, num_nodes=4)


def test_fewer_replicas_than_experts():
    with pytest.raises(
        ValueError, match=r"num_replicas \(8\) must be >= the number of logical experts \(12\)"
    ):
        call(num_replicas=8)


def test_experts_not_divisible_by_groups_when_hierarchical():
    with pytest.raises(
        ValueError, match=r"experts \(12.*divisible by num_groups \(8\).*hierarchical"
    ):
        call(num_groups=8)
    # Not hierarchical (5 groups over 2 nodes): the group count is ignored.
    call(num_groups=5)


def test_weight_that_is_no_array():
    with pytest.raises(TypeError, match="weight must be a tensor.*type str"):
        call("loads")


COUNTS = ["num_replicas", "num_groups", "num_nodes", "num_gpus"]


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("value", [0, -2])
def test_counts_must_be_positive(name, value):
    match = rf"{name} must be a positive integer \(>= 1\), got {value}"
    with pytest.raises(ValueError, match=match):
        call(**{name: value})


@pytest.mark.parametrize("name", COUNTS)
@pytest.mark.parametrize("value", [2.5, True, "8"])
def test_counts_must_be_integers(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a positive integer, got"):
        call(**{name: value})


def test_numpy_integer_counts_are_fine():
    import numpy as np

    call(num_replicas=np.int64(16), num_gpus=np.int32(8))


def test_zero_experts():
    with pytest.raises(ValueError, match="at least one expert"):
        call(torch.zeros(2, 0))


def test_unknown_policy_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown EPLB policy 'defualt'; known: .*default") as err:
        call(policy="defualt")
    assert "Did you mean 'default'?" in str(err.value)
    assert isinstance(err.value, RegistryError)
    assert isinstance(err.value, UnknownEplbPolicyError)
    assert ascend_eplb.UnknownEplbPolicyError is UnknownEplbPolicyError
