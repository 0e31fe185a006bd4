import torch

from ascend_eplb.synthetic import drift_loads, zipf_loads


def test_zipf_shape_totals_and_permutations():
    loads = zipf_loads(5, 32, 1.0, seed=3, tokens_per_layer=1000)
    assert loads.shape == (5, 32) and loads.dtype == torch.float64
    assert torch.allclose(loads.sum(-1), torch.full((5,), 1000.0, dtype=torch.float64))
    ranked = torch.sort(loads, dim=-1, descending=True).values
    expected = 1 / torch.arange(1, 33, dtype=torch.float64)
    assert torch.allclose(ranked, (expected / expected.sum() * 1000).expand(5, -1))
    assert not torch.equal(loads[0], loads[1])  # each layer has its own permutation
    assert torch.equal(loads, zipf_loads(5, 32, 1.0, seed=3, tokens_per_layer=1000))
    assert not torch.equal(loads, zipf_loads(5, 32, 1.0, seed=4, tokens_per_layer=1000))
    assert zipf_loads(0, 8, 1.0).shape == (0, 8)


def test_drift_keeps_totals_and_stays_within_the_fraction():
    loads = zipf_loads(4, 64, 1.2, seed=0)
    drifted = drift_loads(loads, 0.1, seed=1)
    assert torch.allclose(drifted.sum(-1), loads.sum(-1))
    ratio = drifted / loads
    assert ratio.min() > 0.85 and ratio.max() < 1.15 and not torch.allclose(ratio, torch.ones_like(ratio))
    assert torch.equal(drift_loads(torch.zeros(2, 3), 0.1).sum(-1), torch.zeros(2))
