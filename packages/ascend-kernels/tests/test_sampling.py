"""Top-k / top-p masking and the penalties: the references against a row-by-row reading
of vLLM's semantics, Triton and torch_npu against the references."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from ascend_kernels.dispatch import BackendUnavailable  # noqa: E402
from ascend_kernels.sampling import apply_penalties, apply_top_k_top_p  # noqa: E402

from conftest import DTYPES, assert_close, needs_triton  # noqa: E402

NEG_INF = float("-inf")


def _top_k_top_p_by_hand(logits: torch.Tensor, k, p) -> torch.Tensor:
    out = []
    for b, row in enumerate(logits.float().tolist()):
        kept = list(range(len(row)))
        if k is not None:
            kth = sorted(row, reverse=True)[int(k[b]) - 1]
            kept = [i for i in kept if row[i] >= kth]
        if p is not None:
            # Least likely first; equal logits: lower id first (a stable ascending sort).
            order = sorted(kept, key=lambda i: (row[i], i))
            top = max(row[i] for i in kept)
            z = sum(math.exp(row[i] - top) for i in kept)
            running, gone = 0.0, set()
            for i in order[:-1]:
                running += math.exp(row[i] - top) / z
                if running <= 1 - float(p[b]):
                    gone.add(i)
            kept = [i for i in kept if i not in gone]
        out.append([row[i] if i in kept else NEG_INF for i in range(len(row))])
    return torch.tensor(out).to(logits.dtype)


def _random_k_p(batch: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, vocab + 1, (batch,), generator=g)
    p = torch.rand(batch, generator=g).clamp(min=0.05)
    p[0] = 1.0  # top-p off for one row
    k[-1] = vocab  # top-k off for one row
    return k, p


# --- top-k / top-p reference --------------------------------------------------------------


@pytest.mark.parametrize("which", ["k", "p", "both"])
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_top_p_reference_matches_a_row_by_row_reading(which, ties):
    torch.manual_seed(0)
    logits = torch.randint(0, 4, (6, 30)).float() if ties else torch.randn(6, 30) * 2
    k, p = _random_k_p(6, 30, 1)
    k = k if which in ("k", "both") else None
    p = p if which in ("p", "both") else None
    out = apply_top_k_top_p(logits, k, p)
    assert torch.equal(out, _top_k_top_p_by_hand(logits, k, p))


def test_top_k_keeps_every_tie_of_the_kth_value():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert out.tolist() == [[NEG_INF, 2.0, 2.0, 2.0, NEG_INF]]


def test_top_p_drops_the_lower_ids_of_a_tie_first():
    # Three tied tokens of 0.285 each and two small ones: p = 0.5 needs two of the ties.
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, None, torch.tensor([0.5]))
    assert out.tolist() == [[NEG_INF, NEG_INF, 2.0, 2.0, NEG_INF]]


def test_the_most_likely_token_always_stays():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    out = apply_top_k_top_p(logits, None, torch.tensor([1e-9]))
    assert out.tolist() == [[NEG_INF, NEG_INF, NEG_INF, 0.0]]


def test_no_k_and_no_p_returns_the_logits_themselves():
    logits = torch.randn(2, 5)
    assert apply_top_k_top_p(logits, None, None) is logits


def test_the_input_is_left_alone():
    logits = torch.randn(3, 10)
    before = logits.clone()
    apply_top_k_top_p(logits, torch.tensor([1, 2, 3]), torch.tensor([0.5, 0.5, 0.5]))
    assert torch.equal(logits, before)


# --- top-k / top-p Triton -----------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("which", ["k", "p", "both"])
def test_top_k_top_p_triton_equals_reference(dtype, which):
    torch.manual_seed(2)
    logits = (torch.randn(4, 100) * 3).to(dtype)
    k, p = _random_k_p(4, 100, 3)
    k = k if which in ("k", "both") else None
    p = p if which in ("p", "both") else None
    out = apply_top_k_top_p(logits, k, p, backend="triton")
    assert out.dtype == dtype
    assert torch.equal(out, apply_top_k_top_p(logits, k, p, backend="reference"))


@needs_triton
@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_top_p_triton_ties_equal_reference(seed):
    torch.manual_seed(seed)
    logits = torch.randint(-2, 3, (5, 77)).float()  # many ties, across tie blocks of 32
    k, p = _random_k_p(5, 77, seed)
    for kk, pp in ((k, None), (None, p), (k, p)):
        assert torch.equal(apply_top_k_top_p(logits, kk, pp, backend="triton"),
                           apply_top_k_top_p(logits, kk, pp, backend="reference"))


@needs_triton
def test_top_k_top_p_triton_spans_several_blocks_and_odd_values():
    torch.manual_seed(4)
    logits = torch.randn(2, 1500)
    logits[0, 7] = NEG_INF
    logits[1, 1400:] = -0.0
    logits[1, 100:300] = 0.0
    k = torch.tensor([1100, 700], dtype=torch.int32)
    p = torch.tensor([0.97, 0.8])
    assert torch.equal(apply_top_k_top_p(logits, k, p, backend="triton"),
                       apply_top_k_top_p(logits, k, p, backend="reference"))


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_top_k_top_p_of_an_empty_batch(backend):
    out = apply_top_k_top_p(torch.randn(0, 16), torch.ones(0, dtype=torch.long),
                            torch.ones(0), backend=backend)
    assert out.shape == (0, 16)


def test_bad_top_k_top_p_inputs_are_named():
    logits = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\].*got row 1: 9"):
        apply_top_k_top_p(logits, torch.tensor([3, 9]), None)
    with pytest.raises(ValueError, match=r"k must be in \[1, 8\].*got row 0: 0"):
        apply_top_k_top_p(logits, torch.tensor([0, 2]), None)
    with pytest.raises(ValueError, match=r"p must be in \(0, 1\].*row 1: 1.5"):
        apply_top_k_top_p(logits, None, torch.tensor([0.5, 1.5]))
    with pytest.raises(ValueError, match=r"p has shape \(3,\); it must be \(2,\)"):
        apply_top_k_top_p(logits, None, torch.ones(3))
    with pytest.raises(TypeError, match="k has dtype torch.float32; use int32 or int64"):
        apply_top_k_top_p(logits, torch.ones(2), None)
    with pytest.raises(ValueError, match=r"logits must be 2-D \[batch, vocab\]"):
        apply_top_k_top_p(torch.randn(8), None, torch.ones(1))


# --- top-k / top-p on the reference torch_npu ---------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_k_top_p_npu_equals_reference(reference_torch_npu, dtype):
    torch.manual_seed(5)
    logits = torch.randn(4, 64).to(dtype)
    k, p = _random_k_p(4, 64, 5)
    out = apply_top_k_top_p(logits, k, p, backend="npu")
    assert out.dtype == dtype
    assert torch.equal(out, apply_top_k_top_p(logits, k, p, backend="reference"))


def test_npu_top_k_top_p_needs_both_and_small_k(reference_torch_npu):
    logits = torch.randn(2, 2000)
    with pytest.raises(BackendUnavailable, match="takes both k and p"):
        apply_top_k_top_p(logits, torch.tensor([3, 4]), None, backend="npu")
    with pytest.raises(BackendUnavailable, match="takes k <= 1024, got 2000"):
        apply_top_k_top_p(logits, torch.tensor([3, 2000]), torch.ones(2), backend="npu")


# --- penalties ----------------------------------------------------------------------------


def _penalties_by_hand(logits, prompt, output, presence, frequency, repetition):
    out = logits.float().clone()
    vocab = logits.shape[1]
    for b in range(logits.shape[0]):
        prompt_ids = {t for t in prompt[b].tolist() if 0 <= t < vocab}
        output_ids = [t for t in output[b].tolist() if 0 <= t < vocab]
        for t in range(vocab):
            x = out[b, t].item()
            if t in prompt_ids or t in output_ids:
                r = repetition[b].item()
                x = x / r if x > 0 else x * r
            count = output_ids.count(t)
            x -= frequency[b].item() * count + presence[b].item() * (count > 0)
            out[b, t] = x
    return out.to(logits.dtype)


def _penalty_case(batch: int, vocab: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(batch, vocab, generator=g) * 3).to(dtype)
    prompt = torch.randint(0, vocab, (batch, 6), generator=g)
    prompt[0, 3:] = vocab  # vLLM's padding
    output = torch.randint(0, vocab // 2, (batch, 9), generator=g)
    output[-1, 5:] = -1  # the padding of async scheduling
    presence = torch.rand(batch, generator=g) - 0.3
    frequency = torch.rand(batch, generator=g)
    repetition = torch.rand(batch, generator=g) + 0.5
    return logits, prompt, output, presence, frequency, repetition


def test_penalties_reference_matches_a_row_by_row_reading():
    case = _penalty_case(3, 20)
    torch.testing.assert_close(apply_penalties(*case), _penalties_by_hand(*case), atol=1e-5,
                               rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_penalties_triton_equals_reference(dtype):
    case = _penalty_case(4, 1300, dtype, seed=1)
    out = apply_penalties(*case, backend="triton")
    want = apply_penalties(*case, backend="reference")
    if dtype == torch.bfloat16:
        # Triton's interpreter rounds float32 -> bfloat16 differently from torch (which
        # rounds to nearest even): a penalised value may land one bfloat16 step away.
        assert_close(out, want, dtype)
    else:
        assert torch.equal(out, want)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_penalties_with_no_output_yet_and_empty_batches(backend):
    logits, prompt, _, presence, frequency, repetition = _penalty_case(2, 16)
    no_output = torch.zeros(2, 0, dtype=torch.long)
    out = apply_penalties(logits, prompt, no_output, presence, frequency, repetition,
                          backend=backend)
    torch.testing.assert_close(out, _penalties_by_hand(logits, prompt, no_output, presence,
                                                       frequency, repetition))
    empty = apply_penalties(torch.randn(0, 16), torch.zeros(0, 3, dtype=torch.long),
                            torch.zeros(0, 0, dtype=torch.long), torch.zeros(0),
                            torch.zeros(0), torch.ones(0), backend=backend)
    assert empty.shape == (0, 16)


def test_bad_penalty_inputs_are_named():
    logits, prompt, output, presence, frequency, repetition = _penalty_case(2, 16)
    with pytest.raises(ValueError, match=r"output_token_ids holds 17; token ids must be in "
                                         r"\[0, 16\), padding 16 or -1"):
        apply_penalties(logits, prompt, torch.full((2, 3), 17), presence, frequency,
                        repetition)
    with pytest.raises(ValueError, match=r"repetition_penalties must be > 0 .*row 1: 0.0"):
        apply_penalties(logits, prompt, output, presence, frequency, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"prompt_token_ids has shape \(3, 6\); it must be "
                                         r"\(2, length\)"):
        apply_penalties(logits, torch.zeros(3, 6, dtype=torch.long), output, presence,
                        frequency, repetition)
    with pytest.raises(TypeError, match="prompt_token_ids must be an int32 or int64 tensor"):
        apply_penalties(logits, prompt.float(), output, presence, frequency, repetition)
    with pytest.raises(BackendUnavailable, match="has no 'npu' backend"):
        apply_penalties(logits, prompt, output, presence, frequency, repetition,
                        backend="npu")
