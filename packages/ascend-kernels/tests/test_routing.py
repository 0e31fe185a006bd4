"""MoE routing: topk_softmax and grouped_topk, every backend against the reference, and the
reference against a token-by-token reading of vLLM's semantics."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from ascend_kernels.dispatch import BackendUnavailable  # noqa: E402
from ascend_kernels.routing import grouped_topk, topk_softmax  # noqa: E402

from conftest import DTYPES, needs_triton  # noqa: E402


def _rank(scores: list[float], k: int) -> list[int]:
    """Indices of the k largest, largest first, lower index first among equals."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:k]


def _topk_softmax_by_hand(logits: torch.Tensor, topk: int, renormalize: bool):
    weights, ids = [], []
    for row in logits.double():
        probs = torch.softmax(row, dim=0).tolist()
        chosen = _rank(probs, topk)
        w = [probs[i] for i in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append(w)
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids, dtype=torch.int32)


def _grouped_by_hand(logits, topk, renormalize, groups, topk_group, scoring, bias, scale):
    weights, ids = [], []
    experts = logits.shape[1]
    size = experts // groups
    for row in logits.double():
        scores = (torch.softmax(row, 0) if scoring == "softmax" else torch.sigmoid(row)).tolist()
        select = [s + (bias[i].item() if bias is not None else 0.0) for i, s in enumerate(scores)]
        group_scores = []
        for g in range(groups):
            members = sorted(select[g * size:(g + 1) * size], reverse=True)
            group_scores.append(members[0] + members[1] if bias is not None else members[0])
        kept = set(_rank(group_scores, topk_group))
        masked = [v if i // size in kept else float("-inf") for i, v in enumerate(select)]
        chosen = _rank(masked, topk)
        w = [scores[i] for i in chosen]
        if renormalize:
            w = [v / sum(w) for v in w]
        weights.append([v * scale for v in w])
        ids.append(chosen)
    return torch.tensor(weights), torch.tensor(ids, dtype=torch.int32)


# --- reference semantics ------------------------------------------------------------------


@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_reference_matches_a_row_by_row_reading(renormalize):
    torch.manual_seed(0)
    logits = torch.randn(9, 12)
    weights, ids = topk_softmax(logits, 3, renormalize)
    want_w, want_ids = _topk_softmax_by_hand(logits, 3, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_w.double(), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_reference_matches_a_row_by_row_reading(scoring, with_bias, renormalize):
    torch.manual_seed(1)
    logits = torch.randn(6, 32)
    bias = torch.randn(32) * 0.3 if with_bias else None
    weights, ids = grouped_topk(logits, 4, renormalize, 8, 3, scoring, bias, 2.5)
    want_w, want_ids = _grouped_by_hand(logits, 4, renormalize, 8, 3, scoring, bias, 2.5)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights.double(), want_w.double(), atol=1e-5, rtol=1e-5)


def test_equal_scores_put_the_lower_expert_first():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    assert topk_softmax(logits, 2)[1].tolist() == [[1, 2]]
    # Two groups of two with equal best scores: the lower group wins.
    weights, ids = grouped_topk(torch.tensor([[2.0, 0.0, 0.0, 2.0]]), 1, False, 2, 1)
    assert ids.tolist() == [[0]]


def test_bias_steers_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = grouped_topk(logits, 1, False, 1, 1, "sigmoid", bias)
    assert ids.tolist() == [[3]]
    torch.testing.assert_close(weights, torch.sigmoid(torch.tensor([[-1.0]])))


# --- Triton against the reference ---------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,topk", [(8, 2), (60, 6), (1, 1)])
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_triton_equals_reference(dtype, experts, topk, renormalize):
    torch.manual_seed(experts)
    logits = (torch.randn(7, experts) * 2).to(dtype)
    w, i = topk_softmax(logits, topk, renormalize, backend="triton")
    rw, ri = topk_softmax(logits, topk, renormalize, backend="reference")
    assert torch.equal(i, ri) and i.dtype == torch.int32 and w.dtype == torch.float32
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_triton_equals_reference(scoring, with_bias, renormalize):
    torch.manual_seed(3)
    logits = torch.randn(5, 64)
    bias = torch.randn(64) * 0.2 if with_bias else None
    args = (logits, 6, renormalize, 8, 3, scoring, bias, 2.5)
    w, i = grouped_topk(*args, backend="triton")
    rw, ri = grouped_topk(*args, backend="reference")
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_topk_triton_half_inputs_and_odd_groups(dtype):
    torch.manual_seed(4)
    logits = torch.randn(4, 36).to(dtype)  # 6 groups of 6: no power of two anywhere
    bias = torch.randn(36).to(dtype) * 0.1
    args = (logits, 5, True, 6, 2, "sigmoid", bias, 1.0)
    w, i = grouped_topk(*args, backend="triton")
    rw, ri = grouped_topk(*args, backend="reference")
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


@needs_triton
def test_triton_ties_match_the_reference():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, 1.0, 1.0]])
    assert torch.equal(topk_softmax(logits, 3, backend="triton")[1],
                       topk_softmax(logits, 3, backend="reference")[1])
    assert torch.equal(grouped_topk(logits, 3, False, 4, 2, backend="triton")[1],
                       grouped_topk(logits, 3, False, 4, 2, backend="reference")[1])


# --- empty and bad inputs -----------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_no_tokens_give_empty_results(backend):
    w, i = topk_softmax(torch.randn(0, 8), 2, backend=backend)
    assert w.shape == (0, 2) and i.shape == (0, 2) and i.dtype == torch.int32
    w, i = grouped_topk(torch.randn(0, 8), 2, True, 2, 1, backend=backend)
    assert w.shape == (0, 2) and w.dtype == torch.float32


def test_bad_routing_inputs_are_named():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match=r"topk=17 is out of range; it must be in \[1, 16\]"):
        topk_softmax(x, 17)
    with pytest.raises(TypeError, match="topk must be an int"):
        topk_softmax(x, 2.0)
    with pytest.raises(TypeError, match="gating_logits has dtype torch.int64"):
        topk_softmax(torch.ones(2, 4, dtype=torch.long), 1)
    with pytest.raises(ValueError, match=r"must be 2-D \[tokens, experts\], got shape \(16,\)"):
        topk_softmax(torch.randn(16), 1)
    with pytest.raises(ValueError, match="do not split into num_expert_group=5 equal groups"):
        grouped_topk(x, 2, True, 5, 1)
    with pytest.raises(ValueError, match=r"topk_group=5 is out of range; it must be in \[1, 4\]"):
        grouped_topk(x, 2, True, 4, 5)
    with pytest.raises(ValueError, match=r"topk=9 is out of range; it must be in \[1, 8\]"):
        grouped_topk(x, 9, True, 4, 2)
    with pytest.raises(ValueError, match="unknown scoring_func 'relu'"):
        grouped_topk(x, 2, True, 4, 2, "relu")
    with pytest.raises(ValueError, match=r"e_score_correction_bias has shape \(8,\); it must "
                                         r"be \(16,\)"):
        grouped_topk(x, 2, True, 4, 2, "sigmoid", torch.zeros(8))
    with pytest.raises(ValueError, match="leaves 1 expert per group"):
        grouped_topk(x, 2, True, 16, 2, "sigmoid", torch.zeros(16))


# --- torch_npu backend on the reference torch_npu -----------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("renormalize", [False, True])
def test_topk_softmax_npu_equals_reference(reference_torch_npu, dtype, renormalize):
    torch.manual_seed(5)
    logits = torch.randn(6, 40).to(dtype)
    w, i = topk_softmax(logits, 4, renormalize, backend="npu")
    rw, ri = topk_softmax(logits, 4, renormalize, backend="reference")
    assert torch.equal(i, ri) and w.dtype == torch.float32
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("renormalize", [False, True])
def test_grouped_topk_npu_equals_reference(reference_torch_npu, scoring, with_bias,
                                           renormalize):
    torch.manual_seed(6)
    logits = torch.randn(5, 64).to(torch.bfloat16)
    bias = torch.randn(64) * 0.2 if with_bias else None  # float32 bias, as DeepSeek's
    args = (logits, 6, renormalize, 8, 3, scoring, bias, 2.5)
    w, i = grouped_topk(*args, backend="npu")
    rw, ri = grouped_topk(*args, backend="reference")
    assert torch.equal(i, ri)
    torch.testing.assert_close(w, rw, atol=1e-6, rtol=1e-5)


def test_npu_refuses_what_the_fused_ops_cannot_take(reference_torch_npu):
    with pytest.raises(BackendUnavailable, match="more than 2 experts per group, got 2"):
        grouped_topk(torch.randn(2, 16), 2, True, 8, 2, backend="npu")
    with pytest.raises(BackendUnavailable, match="takes k <= 1024, got 1500"):
        topk_softmax(torch.randn(1, 2048), 1500, backend="npu")
