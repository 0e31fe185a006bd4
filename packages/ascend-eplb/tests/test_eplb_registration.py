import pytest
import torch

import ascend_eplb
from ascend_core.registry import EPLB_POLICIES
from ascend_eplb.policies import default, flashlb, swift

from eplb_cases import README_ARGS, README_PHY2LOG, README_WEIGHT


def test_version():
    from ascend_eplb.__about__ import __version__

    assert ascend_eplb.__version__ == __version__


def test_register_is_idempotent():
    ascend_eplb.register()
    ascend_eplb.register()
    assert EPLB_POLICIES.get("default") is default.rebalance_experts
    assert EPLB_POLICIES.get("flashlb") is flashlb.rebalance_experts
    assert EPLB_POLICIES.get("swift") is swift.rebalance_experts
    assert set(ascend_eplb.POLICY_NAMES) <= set(EPLB_POLICIES.names())


def test_options_reach_the_policy_and_unknown_ones_are_refused():
    previous = ascend_eplb.rebalance_experts(README_WEIGHT, **README_ARGS)[0]
    phy2log, _, _ = ascend_eplb.rebalance_experts(
        README_WEIGHT, **README_ARGS, policy="swift", previous=previous, max_moves_per_layer=0
    )
    assert torch.equal(phy2log, previous)
    with pytest.raises(TypeError, match=r"'default' takes no option 'threshold'; its options are: previous"):
        ascend_eplb.rebalance_experts(README_WEIGHT, **README_ARGS, threshold=0.1)
    with pytest.raises(TypeError, match="'swift' takes no option 'max_moves'"):
        ascend_eplb.rebalance_experts(README_WEIGHT, **README_ARGS, policy="swift", max_moves=3)


def test_rebalance_experts_uses_the_default_policy():
    phy2log, _, _ = ascend_eplb.rebalance_experts(README_WEIGHT, **README_ARGS)
    assert torch.equal(phy2log, README_PHY2LOG)


def test_rebalance_experts_dispatches_to_a_registered_policy():
    calls = []

    def fake_policy(weight, num_replicas, num_groups, num_nodes, num_gpus):
        calls.append((num_replicas, num_groups, num_nodes, num_gpus))
        return "placement"

    EPLB_POLICIES.register("test-fake", fake_policy)
    try:
        assert ascend_eplb.rebalance_experts(README_WEIGHT, 16, 4, 2, 8, policy="test-fake") == (
            "placement"
        )
    finally:
        EPLB_POLICIES.unregister("test-fake")
    assert calls == [(16, 4, 2, 8)]


def test_no_vllm_in_the_package():
    import subprocess
    import sys

    code = (
        "import sys, ascend_eplb, ascend_eplb.metrics, ascend_eplb.policies.default,"
        " ascend_eplb.policies.flashlb, ascend_eplb.policies.swift, ascend_eplb.transfer,"
        " ascend_eplb.expert_map, ascend_eplb.cli, ascend_eplb.synthetic, ascend_eplb.placement,"
        " ascend_eplb.recorder, ascend_eplb.exchange, ascend_eplb.runtime,"
        " ascend_eplb.mix_placement;"
        "ascend_eplb.register();"
        "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"
