"""rejection_sample_from_logits: the same acceptance as the per-position ops, recovered tokens
drawn from max(p - q, 0) (candidates from p, or the residual's inverse CDF), ragged layout,
greedy rows left alone, input checks."""

import pytest
import torch

from ascend_kernels.rejection import (
    PLACEHOLDER_TOKEN_ID,
    rejection_random_sample,
)
from ascend_kernels.rejection_logits import (
    _CANDIDATES,
    RECOVERY_DRAWS,
    _inverse_cdf,
    generate_recovery_uniforms,
    rejection_sample_from_logits,
    row_argmax,
)


def case(seed, lengths, vocab=40, with_draft_probs=True):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    cu = torch.tensor(lengths, dtype=torch.int64).cumsum(0).to(torch.int32)
    logits = torch.randn(tokens, vocab, generator=g) * 2
    draft_probs = (torch.randn(tokens, vocab, generator=g).softmax(-1) if with_draft_probs
                   else None)
    drafts = torch.randint(0, vocab, (tokens,), generator=g, dtype=torch.int32)
    bonus = torch.randint(0, vocab, (len(lengths),), generator=g)
    uniform = torch.rand(tokens, generator=g, dtype=torch.float64)
    recovery = torch.rand(len(lengths), RECOVERY_DRAWS, generator=g, dtype=torch.float64)
    return cu, drafts, draft_probs, logits, bonus, uniform, recovery


def accepted_counts(out, bonus_or_recovered=True):
    return [sum(1 for t in row if t != PLACEHOLDER_TOKEN_ID) - 1 for row in out.tolist()]


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_acceptance_equals_the_per_position_op(with_draft_probs):
    lengths = [3, 0, 4, 1, 4, 2, 0, 4]
    cu, drafts, draft_probs, logits, bonus, uniform, recovery = case(1, lengths,
                                                                     with_draft_probs=True)
    if not with_draft_probs:  # argmax-like drafts, so that some are accepted with q = 1
        draft_probs = None
        drafts = (logits * 3).argmax(-1).to(torch.int32)
        logits = logits * 3
    ours = rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform,
                                        recovery, 4)
    recovered_any = torch.zeros(len(drafts), dtype=torch.int32)  # only accepted parts compared
    ops = rejection_random_sample(cu, drafts, draft_probs, logits.softmax(-1), bonus,
                                  recovered_any, uniform, 4)
    assert accepted_counts(ours) == accepted_counts(ops)
    start = 0
    for row, length in enumerate(lengths):
        accepted = accepted_counts(ours)[row]
        assert ours[row, :accepted].tolist() == drafts[start:start + accepted].tolist()
        if accepted == length:
            assert ours[row, length] == bonus[row]
        start += length
    assert 0 < sum(accepted_counts(ours)) < sum(lengths)  # both outcomes occurred


def draw(weights: torch.Tensor, u: float) -> int:
    """The inverse-CDF draw from ``weights`` at ``u``, by one running sum in float64."""
    cdf = weights.double().cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                  right=True))


@pytest.mark.parametrize("refuse_every_candidate", [False, True])
def test_recovered_token_is_the_first_kept_candidate_or_the_residuals_draw(
        refuse_every_candidate):
    lengths = [2, 3, 1, 4, 3, 2]
    cu, drafts, draft_probs, logits, bonus, uniform, recovery = case(2, lengths)
    uniform.fill_(1.0 - 1e-12)  # every first draft with p < q rejects
    if refuse_every_candidate:  # u * p(y) < p(y) - q(y) never holds: the residual's draw
        recovery[:, _CANDIDATES:2 * _CANDIDATES] = 1.0 - 1e-12
    out = rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform,
                                       recovery, 4)
    starts = [0] + cu.tolist()[:-1]
    checked = 0
    for row, start in enumerate(starts):
        accepted = accepted_counts(out)[row]
        if accepted == lengths[row]:
            continue
        flat = start + accepted
        p = logits[flat].softmax(-1).double()
        q = draft_probs[flat].double()
        expected = None
        for j in range(_CANDIDATES):
            y = draw(p, float(recovery[row, j]))
            if float(recovery[row, _CANDIDATES + j]) * p[y] < p[y] - q[y]:
                expected = y
                break
        if expected is None:
            expected = draw((p - q).clamp(min=0), float(recovery[row, -1]))
        token = int(out[row, accepted])
        assert token == expected
        assert p[token] > q[token]
        checked += 1
    assert checked >= 4


CHI2_CRITICAL_0_001 = {2: 13.816, 3: 16.266, 4: 18.467}  # upper 0.1% points, standard tables


@pytest.mark.parametrize("candidates", [_CANDIDATES, 1])
@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_recovered_tokens_follow_the_residual_distribution(monkeypatch, candidates,
                                                           with_draft_probs):
    """Chi-squared over many single-draft requests, every draft rejected: the recovered
    tokens are distributed as normalize(max(p - q, 0)), with the usual number of candidates
    and with one (where most draws come from the residual's inverse CDF instead)."""
    import ascend_kernels.rejection_logits as module

    monkeypatch.setattr(module, "_CANDIDATES", candidates)
    requests, vocab = 20000, 6
    g = torch.Generator().manual_seed(11 + candidates)
    p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.10, 0.00])
    q = torch.tensor([0.50, 0.05, 0.10, 0.05, 0.05, 0.25])
    logits = p.log().expand(requests, vocab).contiguous()
    drafts = torch.zeros(requests, dtype=torch.int32)  # p(0) / q(0) = 0.6 < u: rejected
    draft_probs = q.expand(requests, vocab).contiguous() if with_draft_probs else None
    residual = (p - q).clamp(min=0) if with_draft_probs else p * (torch.arange(vocab) != 0)
    residual = residual / residual.sum()
    out = rejection_sample_from_logits(
        torch.arange(1, requests + 1, dtype=torch.int32), drafts, draft_probs, logits,
        torch.zeros(requests, dtype=torch.int64),
        torch.full((requests,), 1.0 - 1e-12, dtype=torch.float64),
        torch.rand(requests, RECOVERY_DRAWS, generator=g, dtype=torch.float64), 1)
    counts = torch.bincount(out[:, 0].long(), minlength=vocab).double()
    support = residual > 0
    assert counts[~support].sum() == 0
    expected = residual[support].double() * requests
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    assert statistic < CHI2_CRITICAL_0_001[int(support.sum()) - 1]


def test_without_draft_probs_the_draft_token_is_never_recovered():
    lengths = [1] * 200
    cu, drafts, _, logits, bonus, uniform, recovery = case(3, lengths, vocab=5)
    logits[:, :] = torch.tensor([2.0, 1.9, -5.0, -5.0, -5.0])
    drafts.fill_(0)
    out = rejection_sample_from_logits(cu, drafts, None, logits, bonus, uniform, recovery, 1)
    rejected = out[:, 0] != 0
    assert rejected.any() and (~rejected).any()
    assert set(out[rejected, 0].tolist()) <= {1, 2, 3, 4}


def test_greedy_rows_are_left_alone_and_empty_batches_work():
    lengths = [2, 2, 0]
    cu, drafts, draft_probs, logits, bonus, uniform, recovery = case(4, lengths)
    out = torch.full((3, 3), 7, dtype=torch.int32)
    is_greedy = torch.tensor([True, False, True])
    rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform, recovery, 2,
                                 is_greedy, out=out)
    assert out[0].tolist() == [7, 7, 7] and out[2].tolist() == [7, 7, 7]
    assert out[1].tolist() != [7, 7, 7]
    empty = rejection_sample_from_logits(torch.zeros(0, dtype=torch.int32),
                                         torch.zeros(0, dtype=torch.int32), None,
                                         torch.zeros(0, 8), torch.zeros(0, dtype=torch.int64),
                                         torch.zeros(0, dtype=torch.float64),
                                         torch.zeros(0, RECOVERY_DRAWS, dtype=torch.float64), 0)
    assert empty.shape == (0, 1)
    no_drafts = rejection_sample_from_logits(torch.zeros(2, dtype=torch.int32),
                                             torch.zeros(0, dtype=torch.int32), None,
                                             torch.zeros(0, 8), torch.tensor([5, 6]),
                                             torch.zeros(0, dtype=torch.float64),
                                             torch.zeros(2, RECOVERY_DRAWS,
                                                         dtype=torch.float64), 0)
    assert no_drafts.tolist() == [[5], [6]]


def test_recovery_uniforms_skip_requests_without_drafts():
    seeded = torch.Generator().manual_seed(9)
    draws = generate_recovery_uniforms([0, 3, 2], {0: seeded, 1: torch.Generator()
                                                   .manual_seed(9)})
    assert draws.shape == (3, RECOVERY_DRAWS) and draws.dtype == torch.float64
    # Request 1's row comes from its own generator, in order.
    assert torch.equal(draws[1], torch.rand(RECOVERY_DRAWS, dtype=torch.float64,
                                            generator=torch.Generator().manual_seed(9)))
    # No drafts: its generator is untouched (request 0's row is unused).
    assert torch.rand(1, generator=seeded) == torch.rand(
        1, generator=torch.Generator().manual_seed(9))


def test_bad_inputs_say_what_is_wrong():
    cu, drafts, draft_probs, logits, bonus, uniform, recovery = case(5, [2, 1])
    with pytest.raises(ValueError, match="recovery_uniform has shape"):
        rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform,
                                     recovery[:1], 2)
    with pytest.raises(ValueError, match="target_logits has shape"):
        rejection_sample_from_logits(cu, drafts, draft_probs, logits[:2], bonus, uniform,
                                     recovery, 2)
    with pytest.raises(ValueError, match="max_spec_len=1"):
        rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform,
                                     recovery, 1)


@pytest.mark.parametrize("vocab", [1, 255, 256, 1000, 4099])
def test_two_level_inverse_cdf_equals_one_running_sum(vocab):
    g = torch.Generator().manual_seed(vocab)
    # Small integer weights keep every sum exact, so both ways must pick the same token;
    # whole stretches without weight (more than a block) test the skipping.
    weights = torch.randint(0, 4, (64, vocab), generator=g).float()
    weights[:, vocab // 4: vocab // 2] = 0
    weights[:, -1] += 1  # every row has some weight
    uniforms = torch.rand(64, 3, generator=g, dtype=torch.float64)  # three draws a row
    uniforms[:3, 0] = torch.tensor([0.0, 1.0 - 2.0 ** -53, 0.5])
    picked, total = _inverse_cdf(weights, uniforms)
    cdf = weights.double().cumsum(dim=1)
    expected = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).clamp(max=vocab - 1)
    assert torch.equal(picked, expected)
    assert torch.equal(total, cdf[:, -1])
    assert (weights.gather(1, picked) > 0).all()


@pytest.mark.parametrize("with_draft_probs", [True, False])
def test_rows_read_in_place_and_scaled_on_the_way_equal_copied_scaled_rows(with_draft_probs):
    """``target_rows`` and ``temperature``: the runner's whole logits (bonus rows between the
    draft rows), divided by each request's temperature as they are read, verify exactly as
    the copied rows divided beforehand (powers of two, so both roundings agree)."""
    lengths = [3, 0, 4, 1, 4, 2]
    cu, drafts, draft_probs, logits, bonus, uniform, recovery = case(
        6, lengths, vocab=300, with_draft_probs=with_draft_probs)
    if not with_draft_probs:
        drafts = logits.argmax(-1).to(torch.int32)
    temperature = torch.tensor([0.5, 2.0, 0.25, 1.0, 0.5, 4.0])
    # The runner's layout: each request's draft rows, then its bonus row (garbage here).
    whole, rows, at = [], [], 0
    for request, length in enumerate(lengths):
        start = int(cu[request]) - length
        whole += [logits[start:start + length], torch.full((1, 300), 1e4)]
        rows += range(at, at + length)
        at += length + 1
    whole = torch.cat(whole)
    request_of_row = torch.repeat_interleave(torch.arange(len(lengths)),
                                             torch.tensor(lengths))
    scaled = logits / temperature[request_of_row].unsqueeze(1)
    expected = rejection_sample_from_logits(cu, drafts, draft_probs, scaled, bonus, uniform,
                                            recovery, 4)
    ours = rejection_sample_from_logits(cu, drafts, draft_probs, whole, bonus, uniform,
                                        recovery, 4, target_rows=torch.tensor(rows),
                                        temperature=temperature)
    assert torch.equal(ours, expected)
    assert 0 < sum(accepted_counts(ours)) < sum(lengths)
    assert torch.equal(whole[rows], logits)  # read, not changed


def test_bad_row_indices_and_temperatures_say_what_is_wrong():
    cu, drafts, draft_probs, logits, bonus, uniform, recovery = case(7, [2, 1])
    with pytest.raises(ValueError, match=r"target_rows has shape \(2,\)"):
        rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform,
                                     recovery, 2, target_rows=torch.tensor([0, 1]))
    with pytest.raises(ValueError, match=r"temperature has values <= 0 \(\[0.0\]\)"):
        rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform,
                                     recovery, 2, temperature=torch.tensor([1.0, 0.0]))
    # A greedy request's 0 is fine: its rows are not read.
    rejection_sample_from_logits(cu, drafts, draft_probs, logits, bonus, uniform, recovery, 2,
                                 torch.tensor([False, True]),
                                 temperature=torch.tensor([1.0, 0.0]))


def test_rows_after_a_rejection_are_never_read():
    """Position by position: a request's rows after its first rejection are not read (NaN
    there changes nothing)."""
    lengths = [4, 4]
    cu, drafts, _, logits, bonus, uniform, recovery = case(8, lengths, vocab=50)
    logits[0, 7] = 30.0   # request 0, position 0: p(7) ~ 1, accepted
    logits[4, 9] = -30.0  # request 1, position 0: p(9) ~ 0, rejected
    drafts[0], drafts[4] = 7, 9
    poisoned = logits.clone()
    poisoned[5:8] = float("nan")
    out = rejection_sample_from_logits(cu, drafts, None, poisoned, bonus, uniform, recovery, 4)
    assert out[0, 0] == 7 and out[1, 0] != 9
    assert out[1, 1:].tolist() == [PLACEHOLDER_TOKEN_ID] * 4
    assert torch.equal(out, rejection_sample_from_logits(cu, drafts, None, logits, bonus,
                                                         uniform, recovery, 4))


@pytest.mark.parametrize("vocab", [7, 256, 1000, 4096, 32000 + 3])
def test_row_argmax_is_torchs_argmax(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randint(-3, 4, (16, vocab), generator=g).float()  # many equal maxima
    x[1] = 5.0  # all equal: index 0
    x[2, -1] = 9.0  # the tail (or last block) wins
    x[3, vocab // 2] = float("nan")  # NaN counts as the largest
    x[3, -1] = float("nan")
    x[4, -1] = float("nan")
    x[5] = float("-inf")
    x[6, 0] = x[6, -1] = 7.0  # a tie between the first block and the tail: the first
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    strided = torch.randn(8, 2 * vocab, generator=g)[:, ::2]
    assert torch.equal(row_argmax(strided), strided.argmax(dim=-1))


@pytest.mark.parametrize("with_draft_probs", [True, False])
@pytest.mark.parametrize("accept_share", [0.1, 0.9])
def test_rows_verified_a_few_at_a_time_give_the_same_tokens(monkeypatch, with_draft_probs,
                                                            accept_share):
    """Rows verified a few at a time, whether most of a chunk's rows reject or few, draw the
    same tokens as all rows in one chunk."""
    import ascend_kernels.rejection_logits as module

    lengths = [4, 3, 4, 4, 1, 4, 2, 4, 4, 3, 4, 4]
    cu, drafts, draft_probs, logits, bonus, uniform, recovery = case(
        9, lengths, vocab=300, with_draft_probs=with_draft_probs)
    if not with_draft_probs:  # argmax drafts, so that q = 1 can be accepted
        drafts = logits.argmax(-1).to(torch.int32)
    # Each uniform decides its draft's fate: near 0 accepts, near 1 rejects.
    g = torch.Generator().manual_seed(10)
    accept = torch.rand(len(drafts), generator=g) < accept_share
    uniform = torch.where(accept, 1e-9, 1.0 - 1e-9).double()
    args = (cu, drafts, draft_probs, logits, bonus, uniform, recovery, 4)
    whole = rejection_sample_from_logits(*args)
    monkeypatch.setattr(module, "_CHUNK_ELEMENTS", 3 * 300)  # three rows at a time
    chunked = rejection_sample_from_logits(*args)
    assert torch.equal(chunked, whole)
    counts = accepted_counts(whole)
    assert 0 < sum(counts) < sum(lengths)
    assert any(count < length for count, length in zip(counts, lengths))
