import pytest
import torch

from ascend_eplb.metrics import balancedness, rank_loads

# Layer 0: loads 6, 2, 4 with expert 0 doubled -> replicas carry 3, 2, 3, 4;
#   GPU0 = slots (0, 1) = 3 + 2 = 5, GPU1 = slots (0, 2) = 3 + 4 = 7: mean 6, max 7.
# Layer 1: loads 1, 1, 10 with expert 2 doubled -> 1, 1, 5, 5;
#   GPU0 = 2, GPU1 = 10: mean 6, max 10.
WEIGHT = torch.tensor([[6.0, 2.0, 4.0], [1.0, 1.0, 10.0]])
PHY2LOG = torch.tensor([[0, 1, 0, 2], [0, 1, 2, 2]])
LOGCNT = torch.tensor([[2, 1, 1], [1, 1, 2]])


def test_rank_loads_by_hand():
    loads = rank_loads(WEIGHT, PHY2LOG, LOGCNT, 2)
    assert loads.shape == (2, 2)
    assert loads.tolist() == [[5.0, 7.0], [2.0, 10.0]]


def test_balancedness_pools_layers_instead_of_averaging_them():
    got = balancedness(WEIGHT, PHY2LOG, LOGCNT, 2)
    assert got == pytest.approx((6 + 6) / (7 + 10))
    assert got != pytest.approx((6 / 7 + 6 / 10) / 2)


def test_balancedness_extremes():
    assert balancedness(torch.ones(1, 4), torch.arange(4)[None], torch.ones(1, 4), 4) == 1.0
    assert balancedness(torch.zeros(1, 4), torch.arange(4)[None], torch.ones(1, 4), 2) == 1.0
    # all load on one of four GPUs: mean / max = 1/4
    weight = torch.tensor([[8.0, 0.0, 0.0, 0.0]])
    assert balancedness(weight, torch.arange(4)[None], torch.ones(1, 4), 4) == 0.25


@pytest.mark.parametrize(
    "phy2log, logcnt, num_gpus, match",
    [
        (PHY2LOG, LOGCNT[:, :2], 2, "logcnt must be shaped like weight"),
        (PHY2LOG[0], LOGCNT, 2, "phy2log must be shaped"),
        (PHY2LOG, LOGCNT, 3, r"num_replicas \(4\) must be divisible by num_gpus \(3\)"),
        (PHY2LOG + 5, LOGCNT, 2, r"logical expert ids in \[0, 3\)"),
        (PHY2LOG, LOGCNT * 0, 2, "logcnt must be >= 1"),
        (PHY2LOG, LOGCNT, 0, r"num_gpus must be a positive integer \(>= 1\), got 0"),
            ],
)
def test_rank_loads_rejects_inconsistent_inputs(phy2log, logcnt, num_gpus, match):
    with pytest.raises(ValueError, match=match):
        rank_loads(WEIGHT, phy2log, logcnt, num_gpus)
