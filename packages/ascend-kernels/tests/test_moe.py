"""ascend-kernels' moe_experts: the torch_npu backend (on the reference torch_npu) against
the reference backend, the sorting helper, and bad input."""

import pytest
import torch

import ascend_kernels
from ascend_kernels import BackendUnavailable
from ascend_kernels.moe import sort_by_expert


def make(tokens=6, experts=4, hidden=32, inter=16, k=2, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, hidden, 2 * inter, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, inter, hidden, generator=g) / inter ** 0.5).to(dtype)
    weights = torch.rand(tokens, k, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return x, w13, w2, weights, ids.to(torch.int32)


def test_sort_by_expert_groups_pairs_and_counts_empty_experts():
    ids = torch.tensor([[2, 0], [2, -1], [0, 2]])
    weights = torch.tensor([[0.5, 0.25], [1.0, 9.0], [0.125, 0.75]])
    tokens, gates, counts = sort_by_expert(ids, weights, 4)
    assert tokens.tolist() == [0, 2, 0, 1, 2]
    assert gates.tolist() == [0.25, 0.125, 0.5, 1.0, 0.75]
    assert counts.tolist() == [2, 0, 3, 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_experts_npu_equals_reference(reference_torch_npu, dtype):
    x, w13, w2, weights, ids = make(dtype=dtype)
    ids[:, 0] = 1  # expert 1 gets every token, and some expert may get none
    npu = ascend_kernels.moe_experts(x, w13, w2, weights, ids, backend="npu")
    ref = ascend_kernels.moe_experts(x, w13, w2, weights, ids, backend="reference")
    assert npu.dtype == dtype and npu.shape == x.shape
    torch.testing.assert_close(npu.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_moe_experts_npu_refuses_float32(reference_torch_npu):
    x, w13, w2, weights, ids = make(dtype=torch.float32)
    with pytest.raises(BackendUnavailable, match="float16/bfloat16 activations"):
        ascend_kernels.moe_experts(x, w13, w2, weights, ids, backend="npu")


def test_moe_experts_bad_input():
    x, w13, w2, weights, ids = make()
    with pytest.raises(ValueError, match=r"w2 must be \[experts=4, intermediate=16"):
        ascend_kernels.moe_experts(x, w13, w2.transpose(1, 2), weights, ids)
    with pytest.raises(TypeError, match="topk_ids must be an integer tensor"):
        ascend_kernels.moe_experts(x, w13, w2, weights, ids.float())
    with pytest.raises(ValueError, match="topk_ids and topk_weights must both be"):
        ascend_kernels.moe_experts(x, w13, w2, weights[:, :1], ids)
