"""The routing references against vLLM's own routing functions on random inputs.

Runs where vLLM is installed (the host session); the other kernel tests never import it.
vLLM's ``grouped_topk`` is wrapped in ``torch.compile``; the test calls the function under
the wrapper, which is the code the wrapper compiles. vLLM picks experts with
``torch.topk(sorted=False)``, so ids are compared as sets (each with its weight).
"""

import pytest
import torch
import vllm  # noqa: E402,F401  (this file runs where vLLM is installed)
from vllm.model_executor.layers.fused_moe.router import cpu_router  # noqa: E402
from vllm.model_executor.layers.fused_moe.router.grouped_topk_router import (  # noqa: E402
    grouped_topk as vllm_grouped_topk,
)

from ascend_kernels.routing import grouped_topk, topk_softmax  # noqa: E402

VLLM_GROUPED_TOPK = getattr(vllm_grouped_topk, "_torchdynamo_orig_callable", vllm_grouped_topk)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor):
    order = ids.long().sort(dim=1)
    return order.values, weights.float().gather(1, order.indices)


def _assert_same_routing(ours, theirs):
    our_ids, our_w = _by_expert(*ours)
    their_ids, their_w = _by_expert(*theirs)
    assert torch.equal(our_ids, their_ids)
    torch.testing.assert_close(our_w, their_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("shape", [(16, 64, 8, 3, 6), (9, 256, 8, 4, 8), (5, 24, 4, 2, 3)])
def test_grouped_topk_agrees_with_vllm(scoring, with_bias, renormalize, shape):
    tokens, experts, groups, topk_group, topk = shape
    torch.manual_seed(experts + tokens)
    logits = torch.randn(tokens, experts)
    bias = torch.randn(experts) * 0.1 if with_bias else None
    ours = grouped_topk(logits, topk, renormalize, groups, topk_group, scoring, bias, 2.5)
    theirs = VLLM_GROUPED_TOPK(logits, logits, topk, renormalize, groups, topk_group, scoring,
                               2.5, bias)
    assert theirs[0].dtype == ours[0].dtype and theirs[1].dtype == ours[1].dtype
    _assert_same_routing(ours, theirs)
    # vLLM's CPU router (its routing on the host target) gives the same experts.
    theirs_cpu = cpu_router._grouped_topk(logits, topk, renormalize, groups, topk_group,
                                          scoring, 2.5, bias)
    _assert_same_routing(ours, theirs_cpu)


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("experts,topk", [(8, 2), (64, 6), (60, 4)])
def test_topk_softmax_agrees_with_vllms_cpu_router(renormalize, experts, topk):
    torch.manual_seed(experts)
    logits = torch.randn(32, experts) * 2
    ours = topk_softmax(logits, topk, renormalize)
    theirs = cpu_router._softmax_topk(logits, topk, renormalize)
    _assert_same_routing(ours, theirs)
