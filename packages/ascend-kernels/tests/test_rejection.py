"""Rejection sampling: Triton equals the reference token for token, the reference equals a
plain python loop over requests, and the random path reproduces the target distribution
(a chi-squared test)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

from ascend_kernels.rejection import (  # noqa: E402
    PLACEHOLDER_TOKEN_ID,
    generate_recovery_noise,
    generate_uniform_probs,
    rejection_greedy_sample,
    rejection_random_sample,
    sample_recovered_tokens,
)

from conftest import needs_triton  # noqa: E402

BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
COUNTS = [3, 0, 1, 4, 2, 4, 0, 3]  # ragged, with requests that have no drafts
MAX_SPEC_LEN = 4


def _case(counts, vocab, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(counts)
    cu = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    target_probs = torch.softmax(torch.randn(tokens, vocab, generator=g) * 2, dim=-1)
    draft_probs = torch.softmax(torch.randn(tokens, vocab, generator=g) * 2, dim=-1)
    drafts = torch.multinomial(draft_probs, 1, generator=g).flatten().to(torch.int32)
    # Many drafts equal the target's argmax, so greedy verification gets past position 0.
    agree = torch.rand(tokens, generator=g) < 0.7
    drafts = torch.where(agree, target_probs.argmax(-1).to(torch.int32), drafts)
    bonus = torch.randint(0, vocab, (len(counts), 1), generator=g)
    uniform = torch.rand(tokens, dtype=torch.float64, generator=g)
    return dict(cu=cu, drafts=drafts, target=target_probs.to(dtype),
                draft=draft_probs.to(dtype), bonus=bonus, uniform=uniform, g=g)


def _spans(counts):
    start = 0
    for n in counts:
        yield start, n
        start += n


def _greedy_by_loop(counts, drafts, argmax, bonus, is_greedy):
    out = [[PLACEHOLDER_TOKEN_ID] * (MAX_SPEC_LEN + 1) for _ in counts]
    for b, (start, n) in enumerate(_spans(counts)):
        if is_greedy is not None and not is_greedy[b]:
            continue
        for j in range(n):
            out[b][j] = int(argmax[start + j])
            if int(drafts[start + j]) != out[b][j]:
                break
        else:
            out[b][n] = int(bonus[b])
    return out


def _random_by_loop(counts, drafts, draft_probs, target_probs, bonus, recovered, uniform,
                    is_greedy):
    out = [[PLACEHOLDER_TOKEN_ID] * (MAX_SPEC_LEN + 1) for _ in counts]
    for b, (start, n) in enumerate(_spans(counts)):
        if is_greedy is not None and is_greedy[b]:
            continue
        for j in range(n):
            t = start + j
            x = int(drafts[t])
            p = target_probs[t, x].float() if x >= 0 else torch.tensor(0.0)
            q = draft_probs[t, x].float() if draft_probs is not None and x >= 0 else 1.0
            if x >= 0 and q > 0 and (p / q).double() >= uniform[t]:
                out[b][j] = x
            else:
                out[b][j] = int(recovered[t])
                break
        else:
            out[b][n] = int(bonus[b])
    return out


def _recovered_by_loop(counts, drafts, draft_probs, target_probs, inv_q):
    out = []
    for b, (start, n) in enumerate(_spans(counts)):
        for t in range(start, start + n):
            if draft_probs is None:
                prob = target_probs[t].float().clone()
                if drafts[t] >= 0:
                    prob[int(drafts[t])] = 0.0
            else:
                prob = (target_probs[t].float() - draft_probs[t].float()).clamp(min=0)
            out.append(int(torch.argmax(prob * inv_q[b])))
    return out


# --- greedy -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_equals_a_python_loop(backend, mixed):
    case = _case(COUNTS, 12, 0)
    argmax = case["target"].argmax(-1)
    is_greedy = torch.tensor([True, False] * 4) if mixed else None
    out = rejection_greedy_sample(case["cu"], case["drafts"], argmax, case["bonus"],
                                  MAX_SPEC_LEN, is_greedy, backend=backend)
    assert out.dtype == torch.int32 and out.shape == (len(COUNTS), MAX_SPEC_LEN + 1)
    assert out.tolist() == _greedy_by_loop(COUNTS, case["drafts"], argmax, case["bonus"],
                                           is_greedy)
    # A draft that always agrees is accepted whole, then the bonus token.
    full = rejection_greedy_sample(case["cu"], argmax.to(torch.int32), argmax, case["bonus"],
                                   MAX_SPEC_LEN, backend=backend)
    for b, (start, n) in enumerate(_spans(COUNTS)):
        assert full[b, :n].tolist() == argmax[start:start + n].tolist()
        assert full[b, n] == case["bonus"][b, 0]


# --- random -------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_equals_a_python_loop(backend, with_draft_probs, dtype):
    case = _case(COUNTS, 10, 1, dtype)
    draft = case["draft"] if with_draft_probs else None
    drafts = case["drafts"].clone()
    drafts[5] = -1  # a padded draft is always rejected
    recovered = torch.randint(0, 10, (sum(COUNTS),), dtype=torch.int32)
    is_greedy = torch.tensor([False, False, True, False, False, True, False, False])
    out = rejection_random_sample(case["cu"], drafts, draft, case["target"], case["bonus"],
                                  recovered, case["uniform"], MAX_SPEC_LEN, is_greedy,
                                  backend=backend)
    assert out.tolist() == _random_by_loop(COUNTS, drafts, draft, case["target"], case["bonus"],
                                           recovered, case["uniform"], is_greedy)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("noise_dtype", [torch.float32, torch.float64])
def test_recovered_tokens_equal_a_python_loop(backend, with_draft_probs, noise_dtype):
    case = _case(COUNTS, 10, 2)
    draft = case["draft"] if with_draft_probs else None
    inv_q = generate_recovery_noise(COUNTS, 10, dtype=noise_dtype)
    got = sample_recovered_tokens(case["cu"], case["drafts"], draft, case["target"], inv_q,
                                  backend=backend)
    assert got.dtype == torch.int32
    assert got.tolist() == _recovered_by_loop(COUNTS, case["drafts"], draft, case["target"],
                                              inv_q)


@needs_triton
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_triton_equals_reference_token_for_token(with_draft_probs):
    """The whole random step, Triton against the reference, on the same random inputs;
    the vocabulary spans two blocks of the recovered-token kernel."""
    counts = [2, 4, 0, 3]
    vocab = 5000
    case = _case(counts, vocab, 3)
    draft = case["draft"] if with_draft_probs else None
    inv_q = generate_recovery_noise(counts, vocab)
    outs = {}
    for backend in ("reference", "triton"):
        recovered = sample_recovered_tokens(case["cu"], case["drafts"], draft, case["target"],
                                            inv_q, backend=backend)
        outs[backend] = (recovered, rejection_random_sample(
            case["cu"], case["drafts"], draft, case["target"], case["bonus"], recovered,
            case["uniform"], MAX_SPEC_LEN, backend=backend))
    assert torch.equal(outs["triton"][0], outs["reference"][0])
    assert torch.equal(outs["triton"][1], outs["reference"][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_and_random_rows_share_one_buffer(backend):
    case = _case(COUNTS, 12, 4)
    argmax = case["target"].argmax(-1)
    is_greedy = torch.tensor([True, False, False, True, True, False, True, False])
    recovered = sample_recovered_tokens(case["cu"], case["drafts"], case["draft"],
                                        case["target"], generate_recovery_noise(COUNTS, 12),
                                        backend=backend)
    out = torch.full((len(COUNTS), MAX_SPEC_LEN + 1), 77, dtype=torch.int32)
    rejection_greedy_sample(case["cu"], case["drafts"], argmax, case["bonus"], MAX_SPEC_LEN,
                            is_greedy, out=out, backend=backend)
    rejection_random_sample(case["cu"], case["drafts"], case["draft"], case["target"],
                            case["bonus"], recovered, case["uniform"], MAX_SPEC_LEN, is_greedy,
                            out=out, backend=backend)
    greedy = _greedy_by_loop(COUNTS, case["drafts"], argmax, case["bonus"], is_greedy)
    random = _random_by_loop(COUNTS, case["drafts"], case["draft"], case["target"],
                             case["bonus"], recovered, case["uniform"], is_greedy)
    for b in range(len(COUNTS)):
        assert out[b].tolist() == (greedy[b] if is_greedy[b] else random[b])


# --- the random path reproduces the target distribution -----------------------------------


def chi2_critical_value(df: int, alpha: float) -> float:
    """x with P(chi2_df > x) = alpha, by bisection on torch's regularized upper incomplete
    gamma function: P(chi2_df > x) = Q(df / 2, x / 2)."""
    a = torch.tensor(df / 2, dtype=torch.float64)
    low, high = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (low + high) / 2
        if torch.special.gammaincc(a, torch.tensor(mid / 2, dtype=torch.float64)) > alpha:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def chi2_statistic(observed: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * observed.sum()
    return float(((observed.double() - expected) ** 2 / expected).sum())


def test_chi2_critical_values_match_the_published_table():
    # Standard table values (e.g. NIST/SEMATECH e-Handbook, upper critical values).
    for df, alpha, table in ((7, 0.001, 24.322), (7, 0.01, 18.475), (3, 0.05, 7.815),
                             (1, 0.05, 3.841)):
        assert abs(chi2_critical_value(df, alpha) - table) < 0.01


TARGET = torch.tensor([0.30, 0.05, 0.15, 0.10, 0.02, 0.18, 0.12, 0.08])
DRAFT = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.15, 0.05, 0.05, 0.10])
TRIALS = 20000


@pytest.mark.parametrize("argmax_drafts", [False, True])
def test_random_path_output_follows_the_target_distribution(argmax_drafts):
    """20000 one-draft requests: the first emitted token must be distributed as the target
    p, whatever the draft q (q sampled, or an argmax draft with q = 1 on one token)."""
    torch.manual_seed(1234)
    vocab = TARGET.numel()
    counts = [1] * TRIALS
    cu = torch.arange(1, TRIALS + 1, dtype=torch.int32)
    target = TARGET.expand(TRIALS, vocab).contiguous()
    if argmax_drafts:
        draft_probs = None
        drafts = torch.full((TRIALS,), int(DRAFT.argmax()), dtype=torch.int32)
    else:
        draft_probs = DRAFT.expand(TRIALS, vocab).contiguous()
        drafts = torch.multinomial(DRAFT, TRIALS, replacement=True).to(torch.int32)
    recovered = sample_recovered_tokens(cu, drafts, draft_probs, target,
                                        generate_recovery_noise(counts, vocab))
    out = rejection_random_sample(cu, drafts, draft_probs, target,
                                  torch.zeros(TRIALS, dtype=torch.long), recovered,
                                  generate_uniform_probs(counts), 1)
    observed = torch.bincount(out[:, 0].long(), minlength=vocab)
    critical = chi2_critical_value(vocab - 1, 0.001)
    assert chi2_statistic(observed, TARGET) < critical
    # The test has power: the drafts themselves (distributed as q) fail it by far.
    if not argmax_drafts:
        assert chi2_statistic(torch.bincount(drafts.long(), minlength=vocab), TARGET) \
            > 10 * critical


def test_recovered_tokens_follow_the_residual_distribution():
    torch.manual_seed(99)
    vocab = TARGET.numel()
    counts = [1] * TRIALS
    cu = torch.arange(1, TRIALS + 1, dtype=torch.int32)
    drafts = torch.zeros(TRIALS, dtype=torch.int32)
    recovered = sample_recovered_tokens(cu, drafts, DRAFT.expand(TRIALS, vocab),
                                        TARGET.expand(TRIALS, vocab),
                                        generate_recovery_noise(counts, vocab))
    residual = (TARGET - DRAFT).clamp(min=0)
    residual = residual / residual.sum()
    observed = torch.bincount(recovered.long(), minlength=vocab)
    support = residual > 0
    assert observed[~support].sum() == 0
    assert chi2_statistic(observed[support], residual[support]) \
        < chi2_critical_value(int(support.sum()) - 1, 0.001)


# --- randomness helpers -------------------------------------------------------------------


def test_a_seeded_request_draws_the_same_whatever_the_batch():
    def draws(counts, request):
        gen = torch.Generator().manual_seed(7)
        uniform = generate_uniform_probs(counts, {request: gen})
        noise = generate_recovery_noise(counts, 6, {request: gen})
        start = sum(counts[:request])
        return uniform[start:start + counts[request]], noise[request]

    u1, n1 = draws([2, 3], 1)
    u2, n2 = draws([4, 1, 3, 2], 2)
    assert torch.equal(u1, u2) and torch.equal(n1, n2)
    assert u1.dtype == torch.float64 and n1.dtype == torch.float32
    assert bool((n1 > 0).all())


def test_a_seeded_request_without_drafts_consumes_nothing():
    gen = torch.Generator().manual_seed(3)
    generate_recovery_noise([0, 2], 5, {0: gen})
    assert torch.equal(torch.Generator().manual_seed(3).get_state(), gen.get_state())


# --- empty and bad inputs -----------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches_and_requests_without_drafts(backend):
    none = torch.zeros(0, dtype=torch.int32)
    out = rejection_greedy_sample(none, none, none, none, 3, backend=backend)
    assert out.shape == (0, 4)
    # Requests without drafts emit their bonus token and nothing else.
    cu = torch.zeros(3, dtype=torch.int32)
    bonus = torch.tensor([5, 6, 7])
    out = rejection_greedy_sample(cu, none, none, bonus, 2, backend=backend)
    assert out.tolist() == [[5, -1, -1], [6, -1, -1], [7, -1, -1]]
    out = rejection_random_sample(cu, none, torch.zeros(0, 9), torch.zeros(0, 9), bonus, none,
                                  torch.zeros(0, dtype=torch.float64), 0, backend=backend)
    assert out.tolist() == [[5], [6], [7]]
    got = sample_recovered_tokens(cu, none, None, torch.zeros(0, 9), torch.ones(3, 9),
                                  backend=backend)
    assert got.shape == (0,) and got.dtype == torch.int32


def test_bad_rejection_inputs_are_named():
    case = _case([2, 3], 6, 5)
    cu, drafts, target, bonus = case["cu"], case["drafts"], case["target"], case["bonus"]
    argmax = target.argmax(-1)
    with pytest.raises(ValueError, match="cu_num_draft_tokens ends at 5 but there are 4 draft"):
        rejection_greedy_sample(cu, drafts[:4], argmax[:4], bonus, 3)
    with pytest.raises(ValueError, match="a request has 3 draft tokens but max_spec_len=2"):
        rejection_greedy_sample(cu, drafts, argmax, bonus, 2)
    with pytest.raises(ValueError, match="must be non-decreasing"):
        rejection_greedy_sample(torch.tensor([3, 2, 5]), drafts, argmax, bonus, 3)
    with pytest.raises(ValueError, match=r"bonus_token_ids has shape \(3,\); it must be \(2,\)"):
        rejection_greedy_sample(cu, drafts, argmax, torch.zeros(3, dtype=torch.long), 3)
    with pytest.raises(TypeError, match="is_greedy must be a bool tensor"):
        rejection_greedy_sample(cu, drafts, argmax, bonus, 3, torch.ones(2))
    with pytest.raises(ValueError, match=r"target_argmax has shape \(4,\); it must be \(5,\)"):
        rejection_greedy_sample(cu, drafts, argmax[:4], bonus, 3)
    with pytest.raises(TypeError, match="draft_token_ids has dtype torch.float32"):
        rejection_greedy_sample(cu, drafts.float(), argmax, bonus, 3)
    recovered = torch.zeros(5, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"draft_probs has shape \(5, 7\); it must be \(5, 6\)"):
        rejection_random_sample(cu, drafts, torch.zeros(5, 7), target, bonus, recovered,
                                case["uniform"], 3)
    with pytest.raises(TypeError, match="uniform_probs has dtype torch.bfloat16; use float64"):
        rejection_random_sample(cu, drafts, None, target, bonus, recovered,
                                case["uniform"].bfloat16(), 3)
    with pytest.raises(ValueError, match=r"out has shape \(2, 3\); it must be \(2, 4\)"):
        rejection_random_sample(cu, drafts, None, target, bonus, recovered, case["uniform"], 3,
                                out=torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"inv_q has shape \(3, 6\); it must be \(2, 6\)"):
        sample_recovered_tokens(cu, drafts, None, target, torch.ones(3, 6))
