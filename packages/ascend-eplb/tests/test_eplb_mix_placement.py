import pytest
import torch

from ascend_eplb.metrics import balancedness
from ascend_eplb.mix_placement import plan_mix_placement, with_shared_experts
from ascend_eplb.placement import check_phy2log
from ascend_eplb.synthetic import zipf_loads


def test_shared_experts_are_always_hot():
    # 10 tokens, top-2: routed loads sum to 20; each shared expert sees all 10 tokens.
    weight = torch.tensor([[8.0, 6.0, 4.0, 2.0]])
    extended = with_shared_experts(weight, num_shared_experts=2, top_k=2)
    assert extended.tolist() == [[8.0, 6.0, 4.0, 2.0, 10.0, 10.0]]
    assert torch.equal(with_shared_experts(weight, 0, 2), weight.double())


def test_uniform_routed_load_spreads_the_shared_expert_over_every_rank():
    # 8 routed experts, top-2, one shared expert, 4 ranks of 3 slots: the shared
    # expert carries 4x a routed expert's load and gets one replica per rank.
    weight = torch.full((2, 8), 25.0)
    mix = plan_mix_placement(weight, num_shared_experts=1, top_k=2, num_replicas=12,
                             num_gpus=4)
    check_phy2log(mix.phy2log, 9, 4)
    assert mix.num_routed == 8 and mix.num_shared == 1
    assert mix.shared_replicas.tolist() == [[4], [4]]
    per_rank = mix.is_shared().view(2, 4, 3).sum(-1)
    assert per_rank.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    extended = with_shared_experts(weight, 1, 2)
    assert balancedness(extended, mix.phy2log, mix.logcnt, 4) == pytest.approx(1.0)


@pytest.mark.parametrize("policy", ["default", "flashlb"])
def test_mixed_placement_balances_shared_and_routed_load(policy):
    weight = zipf_loads(4, 16, 1.0, seed=0)
    mix = plan_mix_placement(weight, num_shared_experts=2, top_k=4, num_replicas=32,
                             num_gpus=8, policy=policy)
    extended = with_shared_experts(weight, 2, 4)
    check_phy2log(mix.phy2log, 18, 8)
    # Shared experts (the hottest items) get several replicas each, on several ranks.
    assert (mix.shared_replicas >= 2).all()
    for layer in range(4):
        for shared in (16, 17):
            ranks = (mix.phy2log[layer] == shared).nonzero().view(-1) // 4
            assert ranks.unique().numel() >= 2
    assert balancedness(extended, mix.phy2log, mix.logcnt, 8) > 0.9


def test_bad_input():
    with pytest.raises(ValueError, match="num_shared_experts must be an integer >= 0, got -1"):
        with_shared_experts(torch.ones(1, 4), -1, 2)
    with pytest.raises(ValueError, match=r"top_k \(5\) cannot exceed the number of routed"):
        with_shared_experts(torch.ones(1, 4), 1, 5)
    with pytest.raises(ValueError, match="num_replicas \\(5\\) must be >= the number"):
        plan_mix_placement(torch.ones(1, 4), 2, 2, num_replicas=5, num_gpus=1)
