"""The reference's MoE gating and top-k / top-p ops against plain torch math and their
documented argument rules."""

from __future__ import annotations

import math

import pytest
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]




def _ranked(values: list[float], k: int) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


# --- npu_moe_gating_top_k_softmax ---------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_gating_top_k_softmax_is_softmax_then_top_k(torch_npu, dtype):
    torch.manual_seed(0)
    x = torch.randn(5, 12).to(dtype)
    y, expert_idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(x, None, k=3)
    probs = torch.softmax(x.double(), dim=-1)
    assert y.dtype == dtype and expert_idx.dtype == torch.int32 and row_idx.dtype == torch.int32
    for r in range(5):
        want = _ranked(probs[r].tolist(), 3)
        assert expert_idx[r].tolist() == want
        torch.testing.assert_close(y[r].double(), probs[r, want].to(dtype).double(),
                                   atol=1e-3 if dtype != torch.float32 else 1e-6, rtol=1e-2)
    # row_idx = arange(rows * k).reshape(k, rows).transpose(1, 0)
    assert row_idx.tolist() == [[j * 5 + i for j in range(3)] for i in range(5)]


def test_gating_top_k_softmax_ranks_the_softmax_in_x_dtype_lower_expert_first(torch_npu):
    # The real op's test golden: softmax in float32, cast to x's dtype, then top-k keeping
    # the lower expert among equal scores; it compares expert_idx exactly. With 5120
    # float16 experts and small logits, near scores round to one float16 value.
    torch.manual_seed(3)
    rows, experts, k = 6, 5120, 8
    x = (torch.randn(rows, experts) * 0.01).to(torch.float16)
    y, expert_idx, _ = torch_npu.npu_moe_gating_top_k_softmax(x, None, k=k)
    cast = torch.softmax(x.float(), dim=-1).to(torch.float16)
    ties_changed_the_choice = False
    for r in range(rows):
        scores = cast[r].tolist()
        want = sorted(range(experts), key=lambda e: (-scores[e], e))[:k]
        assert expert_idx[r].tolist() == want
        assert y[r].tolist() == [scores[e] for e in want]
        by_float32 = torch.softmax(x[r].float(), dim=-1).topk(k).indices.tolist()
        ties_changed_the_choice |= by_float32 != want
    assert ties_changed_the_choice  # the case exercises ties the cast creates
    npu_y, npu_idx, _ = torch_npu.npu_moe_gating_top_k_softmax(x.to("npu"), None, k=k)
    assert torch.equal(npu_idx.cpu(), expert_idx) and torch.equal(npu_y.cpu(), y)


@pytest.mark.parametrize("device", ["cpu", "npu"])
def test_gating_top_k_softmax_marks_finished_rows_with_the_expert_count(torch_npu, device):
    """A finished row's expert_idx is `experts` (past every expert); its y and row_idx are
    those of any row, as the real op's test golden computes them."""
    torch.manual_seed(7)
    x = torch.randn(5, 8)
    finished = torch.tensor([False, True, False, True, True])
    y, idx, row_idx = torch_npu.npu_moe_gating_top_k_softmax(x.to(device), finished.to(device),
                                                             k=3)
    plain_y, plain_idx, plain_rows = torch_npu.npu_moe_gating_top_k_softmax(x, k=3)
    assert torch.equal(y.cpu(), plain_y) and torch.equal(row_idx.cpu(), plain_rows)
    assert idx.dtype == torch.int32
    assert torch.equal(idx.cpu()[~finished], plain_idx[~finished])
    assert (idx.cpu()[finished] == 8).all()
    with pytest.raises(RuntimeError, match="finished must be a bool tensor"):
        torch_npu.npu_moe_gating_top_k_softmax(x, torch.zeros(4, dtype=torch.bool), k=2)
    with pytest.raises(RuntimeError, match="finished must be a bool tensor"):
        torch_npu.npu_moe_gating_top_k_softmax(x, torch.zeros(5, dtype=torch.int32), k=2)


def test_gating_top_k_softmax_refuses_what_it_does_not_model(torch_npu):
    x = torch.randn(4, 8)
    with pytest.raises(NotImplementedError, match="models 2-D x only"):
        torch_npu.npu_moe_gating_top_k_softmax(x.view(2, 2, 8), k=2)


def test_gating_top_k_softmax_argument_rules(torch_npu):
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match=r"k=9 is out of range; it must satisfy 0 < k <= 8"):
        torch_npu.npu_moe_gating_top_k_softmax(x, k=9)
    with pytest.raises(RuntimeError, match="k=0 is out of range"):
        torch_npu.npu_moe_gating_top_k_softmax(x, k=0)
    with pytest.raises(TypeError, match="k must be an int"):  # the binding's parser
        torch_npu.npu_moe_gating_top_k_softmax(x, k=2.0)
    with pytest.raises(RuntimeError, match="dtype torch.int64"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.ones(4, 8, dtype=torch.long), k=1)
    with pytest.raises(RuntimeError, match="must be 2-D or 3-D"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.randn(8), k=1)
    with pytest.raises(RuntimeError, match="empty tensors are not supported"):
        torch_npu.npu_moe_gating_top_k_softmax(torch.randn(0, 8), k=1)


# --- npu_moe_gating_top_k -----------------------------------------------------------------


def _gating_top_k_by_hand(x, k, bias, k_group, group_count, mode, norm_type, scale, eps):
    ys, ids = [], []
    size = x.shape[1] // group_count
    for row in x.double():
        norm = (torch.sigmoid(row) if norm_type == 1 else torch.softmax(row, 0)).tolist()
        value = [v + (float(bias[i]) if bias is not None else 0.0) for i, v in enumerate(norm)]
        if group_count > 1:
            scores = []
            for g in range(group_count):
                members = sorted(value[g * size:(g + 1) * size], reverse=True)
                scores.append(members[0] + members[1] if mode == 1 else members[0])
            kept = set(_ranked(scores, k_group))
            value = [v if i // size in kept else -math.inf for i, v in enumerate(value)]
        chosen = _ranked(value, k)
        y = [norm[i] for i in chosen]
        if norm_type == 1:
            y = [v / (sum(y) + eps) for v in y]
        ys.append([v * scale for v in y])
        ids.append(chosen)
    return torch.tensor(ys, dtype=torch.float64), ids


@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gating_top_k_follows_the_documented_formula(torch_npu, norm_type, mode, with_bias):
    torch.manual_seed(1)
    x = torch.randn(6, 64)
    bias = torch.randn(64) * 0.2 if with_bias else None
    y, expert_idx, norm_out = torch_npu.npu_moe_gating_top_k(
        x, 6, bias=bias, k_group=3, group_count=8, group_select_mode=mode, renorm=0,
        norm_type=norm_type, out_flag=True, routed_scaling_factor=2.5, eps=1e-20)
    want_y, want_ids = _gating_top_k_by_hand(x, 6, bias, 3, 8, mode, norm_type, 2.5, 1e-20)
    assert expert_idx.tolist() == want_ids and expert_idx.dtype == torch.int32
    torch.testing.assert_close(y.double(), want_y, atol=1e-6, rtol=1e-5)
    want_norm = torch.sigmoid(x) if norm_type == 1 else torch.softmax(x, -1)
    assert norm_out.dtype == torch.float32
    torch.testing.assert_close(norm_out, want_norm)


def test_gating_top_k_defaults_and_dtypes(torch_npu):
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    y, expert_idx, third = torch_npu.npu_moe_gating_top_k(x, 2)  # one group, softmax
    assert y.dtype == torch.bfloat16 and third.numel() == 0
    probs = torch.softmax(x.float(), -1)
    assert expert_idx.tolist() == [_ranked(r.tolist(), 2) for r in probs]


def test_gating_top_k_argument_rules(torch_npu):
    x = torch.randn(4, 64)
    call = torch_npu.npu_moe_gating_top_k
    with pytest.raises(NotImplementedError, match="documents only renorm=0"):
        call(x, 2, renorm=1)
    with pytest.raises(RuntimeError, match="experts / group_count = 2; it must be greater than 2"):
        call(x, 2, k_group=1, group_count=32)
    with pytest.raises(RuntimeError, match=r"k_group=9 must be in \[1, group_count=8\]"):
        call(x, 2, k_group=9, group_count=8)
    with pytest.raises(RuntimeError, match=r"k=17 must be in \[1, experts / group_count \* "
                                         r"k_group = 16\]"):
        call(x, 17, k_group=2, group_count=8)
    with pytest.raises(RuntimeError, match="group_count=5 must be > 0 and divide"):
        call(x, 2, group_count=5)
    with pytest.raises(RuntimeError, match="bias has dtype torch.bfloat16 but x has torch.float32"):
        call(x, 2, bias=torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match=r"bias has shape \(32,\); it must be \(64,\)"):
        call(x, 2, bias=torch.zeros(32))
    with pytest.raises(RuntimeError, match="norm_type=2; use 0"):
        call(x, 2, norm_type=2)
    with pytest.raises(RuntimeError, match="group_select_mode=3"):
        call(x, 2, group_select_mode=3)
    with pytest.raises(RuntimeError, match="at most 2048 are supported"):
        call(torch.randn(1, 4096), 2)
    with pytest.raises(RuntimeError, match=r"rounded up to 32 \(64\) times group_count"):
        call(torch.randn(1, 2000), 2, group_count=40)
    with pytest.raises(RuntimeError, match="must be 2-D"):
        call(torch.randn(2, 2, 16), 2)


# --- npu_top_k_top_p ----------------------------------------------------------------------


def _top_k_top_p_by_hand(logits, p, k):
    out = []
    for b, row in enumerate(logits.float().tolist()):
        kth = sorted(row, reverse=True)[int(k[b]) - 1]
        kept = [i for i in range(len(row)) if row[i] >= kth]
        order = sorted(kept, key=lambda i: (row[i], i))  # stable ascending
        top = max(row[i] for i in kept)
        z = sum(math.exp(row[i] - top) for i in kept)
        running, gone = 0.0, set()
        for i in order[:-1]:
            running += math.exp(row[i] - top) / z
            if running <= 1 - float(p[b]):
                gone.add(i)
        out.append([row[i] if i in kept and i not in gone else -math.inf
                    for i in range(len(row))])
    return torch.tensor(out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_top_p_follows_the_documented_formula(torch_npu, dtype, ties):
    torch.manual_seed(2)
    logits = (torch.randint(0, 4, (5, 40)).float() if ties else torch.randn(5, 40)).to(dtype)
    p = torch.tensor([0.9, 0.5, 1.0, 0.2, 0.0]).to(dtype)
    k = torch.tensor([40, 7, 3, 20, 10], dtype=torch.int32)
    out = torch_npu.npu_top_k_top_p(logits, p, k)
    assert out.dtype == dtype and out.shape == logits.shape
    assert torch.equal(out.float(), _top_k_top_p_by_hand(logits, p, k))


def test_top_k_top_p_argument_rules(torch_npu):
    logits = torch.randn(2, 2000)
    p = torch.tensor([0.5, 0.9])
    k = torch.tensor([5, 10], dtype=torch.int32)
    call = torch_npu.npu_top_k_top_p
    with pytest.raises(RuntimeError, match="p has dtype torch.bfloat16 but logits has"):
        call(logits, p.bfloat16(), k)
    with pytest.raises(RuntimeError, match="k has dtype torch.int64; it must be int32"):
        call(logits, p, k.long())
    with pytest.raises(RuntimeError, match=r"k holds 1025; values must be in \[1, 1024\]"):
        call(logits, p, torch.tensor([5, 1025], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"k holds 9; .*at most logits.size\(1\) = 8"):
        call(torch.randn(2, 8), p, torch.tensor([9, 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"p holds 1.5\d*; values must be in \[0, 1\]"):
        call(logits, torch.tensor([0.5, 1.5]), k)
    with pytest.raises(RuntimeError, match=r"p has shape \(3,\); it must be \(2,\)"):
        call(logits, torch.ones(3), k)
    with pytest.raises(RuntimeError, match="empty tensors are not supported"):
        call(torch.randn(0, 8), torch.ones(0), torch.ones(0, dtype=torch.int32))
