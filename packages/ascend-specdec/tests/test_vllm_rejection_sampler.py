"""Our rejection sampler (imports vLLM): exact greedy verification, the random path's output
distribution (chi-squared), ragged batches, per-request seeds, sampling constraints, and
agreement with vLLM's own sampler where vLLM's CPU path is right."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from vllm.platforms import current_platform
from vllm.v1.sample import rejection_sampler as vllm_rejection
from vllm.v1.sample.logits_processor import LogitsProcessors, MinTokensLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from ascend_core.registry import REJECTION_SAMPLERS
from ascend_core.worker.speculative import install_registered_rejection_sampler
from ascend_specdec import register
from ascend_specdec.rejection import rejection_sample, rejection_sampler_factory
from ascend_specdec.vllm.rejection_sampler import AscendRejectionSampler

PLACEHOLDER = -1

# Upper 0.1% points of the chi-squared distribution (standard tables, e.g. NIST/SEMATECH
# e-Handbook 1.3.6.7.4), by degrees of freedom. A correct sampler fails one such check in a
# thousand seeds; the seeds below are fixed, so each test's outcome is deterministic.
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458,
                       7: 24.322}


@pytest.fixture(scope="module", autouse=True)
def vllm_cpu_kernels():
    # What vLLM's CPU worker does at start-up: its C++ stand-ins for the Triton kernels that
    # vLLM's own RejectionSampler launches.
    current_platform.register_triton_kernel_overrides()


# --- building the runner's inputs ----------------------------------------------------------


def spec_metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """vLLM's metadata for these drafts, logits laid out as the runner does: each request's
    draft rows, then its bonus row."""
    metadata = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    target, bonus, row = [], [], 0
    for ids in drafts:
        target += range(row, row + len(ids))
        bonus.append(row + len(ids))
        row += len(ids) + 1
    metadata.target_logits_indices = torch.tensor(target, dtype=torch.int32)
    metadata.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32)
    metadata.logits_indices = torch.arange(row, dtype=torch.int32)
    return metadata


def sampling_metadata(temperatures: list[float], *, top_k=None, top_p=None, generators=None,
                      max_num_logprobs=None) -> SamplingMetadata:
    batch = len(temperatures)
    all_greedy = all(t == 0 for t in temperatures)
    return SamplingMetadata(
        temperature=None if all_greedy else torch.tensor(temperatures, dtype=torch.float32),
        all_greedy=all_greedy, all_random=all(t > 0 for t in temperatures),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators=generators or {}, max_num_logprobs=max_num_logprobs, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch), repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())


def ours(**kwargs) -> AscendRejectionSampler:
    return AscendRejectionSampler(Sampler(), **kwargs)


def vllms() -> vllm_rejection.RejectionSampler:
    return vllm_rejection.RejectionSampler(Sampler())


def rows_of(output: torch.Tensor) -> list[list[int]]:
    return [[t for t in row if t != PLACEHOLDER] for row in output.tolist()]


# --- greedy --------------------------------------------------------------------------------


def greedy_chain(drafts, logits) -> list[list[int]]:
    """The definition: emit the target's argmax at each draft position, stop after the first
    position whose draft differs from it; all drafts matched: the bonus row's argmax too."""
    argmax = logits.argmax(dim=-1).tolist()
    rows, row = [], 0
    for ids in drafts:
        emitted = []
        for pos, draft in enumerate(ids):
            emitted.append(argmax[row + pos])
            if draft != argmax[row + pos]:
                break
        else:
            emitted.append(argmax[row + len(ids)])
        rows.append(emitted)
        row += len(ids) + 1
    return rows


def drafts_near_argmax(logits, lengths, generator, wrong=0.25) -> list[list[int]]:
    """Drafts that mostly follow the target's argmax, so chains of every length occur."""
    argmax = logits.argmax(dim=-1)
    vocab = logits.shape[1]
    drafts, row = [], 0
    for length in lengths:
        ids = argmax[row:row + length].clone()
        flip = torch.rand(length, generator=generator) < wrong
        ids[flip] = torch.randint(0, vocab, (int(flip.sum()),), generator=generator)
        drafts.append(ids.tolist())
        row += length + 1
    return drafts


@pytest.mark.parametrize("seed", range(4))
def test_greedy_is_the_target_argmax_chain_and_equals_vllms(seed):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (24,), generator=generator).tolist()
    lengths[0], lengths[-1] = 0, 5  # ragged, with a request without drafts
    vocab = 300
    logits = torch.randn(sum(lengths) + len(lengths), vocab, generator=generator)
    drafts = drafts_near_argmax(logits, lengths, generator)
    metadata, sampling = spec_metadata(drafts), sampling_metadata([0.0] * len(lengths))
    expected = greedy_chain(drafts, logits)
    output = ours()(metadata, None, logits.clone(), sampling).sampled_token_ids
    assert output.dtype == torch.int32 and output.shape == (len(lengths), max(lengths) + 1)
    assert rows_of(output) == expected
    accepted = [len(row) - 1 for row in expected]
    assert 0 in accepted and max(lengths) in accepted  # both ends of the chain were exercised
    reference = vllms()(metadata, None, logits.clone(), sampling).sampled_token_ids
    assert torch.equal(output, reference)
    assert vllm_rejection.RejectionSampler.parse_output(output, vocab)[0] == expected


def test_greedy_rows_of_a_mixed_batch_stay_exact():
    generator = torch.Generator().manual_seed(7)
    lengths = [3, 0, 4, 2, 4, 1]
    logits = torch.randn(sum(lengths) + len(lengths), 50, generator=generator)
    drafts = drafts_near_argmax(logits, lengths, generator)
    temperatures = [0.0, 1.0, 0.0, 0.7, 0.0, 1.3]
    output = ours()(spec_metadata(drafts), None, logits.clone(),
                    sampling_metadata(temperatures)).sampled_token_ids
    expected = greedy_chain(drafts, logits)
    for row, temperature in enumerate(temperatures):
        if temperature == 0:
            assert rows_of(output)[row] == expected[row]


def test_greedy_logprobs_equal_vllms():
    generator = torch.Generator().manual_seed(3)
    lengths = [2, 0, 3]
    logits = torch.randn(sum(lengths) + len(lengths), 40, generator=generator)
    drafts = drafts_near_argmax(logits, lengths, generator)
    metadata = spec_metadata(drafts)
    sampling = sampling_metadata([0.0] * 3, max_num_logprobs=2)
    mine = ours()(metadata, None, logits.clone(), sampling)
    theirs = vllms()(metadata, None, logits.clone(), sampling)
    assert torch.equal(mine.sampled_token_ids, theirs.sampled_token_ids)
    for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        assert torch.equal(getattr(mine.logprobs_tensors, field),
                           getattr(theirs.logprobs_tensors, field)), field


@pytest.mark.parametrize("temperatures", [[0.0] * 4, [0.0, 0.8, 1.0, 0.0]])
def test_a_step_without_drafts_is_sampled_as_a_plain_decode_step(temperatures, monkeypatch):
    """No request has drafts: the output, logprobs included, is vLLM's sampler's on the same
    rows and draws, and the verification is not run."""
    from ascend_specdec.vllm import rejection_sampler as module

    monkeypatch.setattr(module, "rejection_sample", None)  # calling it would fail
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(5))
    outputs = []
    for sampler in (ours(), Sampler()):
        sampling = sampling_metadata(temperatures, max_num_logprobs=2, generators={
            1: torch.Generator().manual_seed(1), 2: torch.Generator().manual_seed(2)})
        if isinstance(sampler, AscendRejectionSampler):
            outputs.append(sampler(spec_metadata([[]] * 4), None, logits.clone(), sampling))
        else:
            outputs.append(sampler(logits=logits.clone(), sampling_metadata=sampling))
    mine, plain = outputs
    assert mine.sampled_token_ids.shape == (4, 1)
    assert torch.equal(mine.sampled_token_ids, plain.sampled_token_ids)
    for field in ("logprob_token_ids", "logprobs", "selected_token_ranks"):
        assert torch.equal(getattr(mine.logprobs_tensors, field),
                           getattr(plain.logprobs_tensors, field)), field


# --- random: the output distribution -------------------------------------------------------


def chi_squared(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``samples`` against ``probs`` over the tokens with positive
    probability, and its degrees of freedom; a sample outside the support fails at once."""
    support = probs > 0
    counts = torch.bincount(samples, minlength=probs.shape[0]).double()
    assert counts[~support].sum() == 0, f"tokens outside the support: {counts[~support]}"
    expected = probs[support].double() * samples.shape[0]
    assert expected.min() >= 5, "too few draws per token for the chi-squared approximation"
    statistic = float(((counts[support] - expected) ** 2 / expected).sum())
    return statistic, int(support.sum()) - 1


def assert_distributed_as(samples, probs, what):
    statistic, dof = chi_squared(samples, probs)
    critical = CHI2_CRITICAL_0_001[dof]
    assert statistic < critical, (f"{what}: chi-squared {statistic:.2f} >= {critical} "
                                  f"({dof} degrees of freedom, {samples.shape[0]} draws)")


def sample_many(target_logits, draft_q, requests, temperature=1.0, top_k=None, top_p=None,
                seed=0, from_logits=None):
    """``requests`` identical requests with two draft positions each: row 0 and row 1 of
    ``target_logits`` are the target's logits at the two positions (row 2 the bonus row),
    the drafts are drawn from ``draft_q`` (``[2, V]``), or are the fixed tokens 0 and 1 with
    ``draft_q=None`` (an n-gram drafter)."""
    torch.manual_seed(seed)
    vocab = target_logits.shape[1]
    if draft_q is None:
        drafts = torch.tensor([[0, 1]]).expand(requests, 2)
        draft_probs = None
    else:
        drafts = torch.stack([torch.multinomial(draft_q[i], requests, replacement=True)
                              for i in range(2)], dim=1)
        draft_probs = draft_q.repeat(requests, 1)
    logits = target_logits.repeat(requests, 1)
    batch_top_k = None if top_k is None else [top_k] * requests
    batch_top_p = None if top_p is None else [top_p] * requests
    sampling = sampling_metadata([temperature] * requests, top_k=batch_top_k,
                                 top_p=batch_top_p)
    output = ours(from_logits=from_logits)(spec_metadata(drafts.tolist()), draft_probs, logits,
                                           sampling)
    assert vocab > 0
    return drafts, output.sampled_token_ids


def target_distribution(logits_row, temperature=1.0, top_k=None):
    scaled = logits_row / temperature
    if top_k is not None:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled.softmax(dim=-1)


TARGET_LOGITS = torch.tensor([[1.2, 0.3, -0.4, 0.9, 0.0, -1.0],
                              [-0.5, 1.0, 0.2, 0.4, -0.2, 0.8],
                              [0.1, 0.1, 0.1, 0.1, 0.1, 0.1]])
DRAFT_Q = torch.tensor([[0.05, 0.40, 0.05, 0.10, 0.30, 0.10],
                        [0.30, 0.10, 0.30, 0.10, 0.10, 0.10]])


# Random rows are verified from the logits on the CPU by default (from_logits), or through
# the per-position ops on the softmax (what devices run): both must be exact.
PATHS = pytest.mark.parametrize("from_logits", [True, False], ids=["from_logits", "ops"])


@PATHS
@pytest.mark.parametrize("draft_q", [DRAFT_Q, None], ids=["draft_probs", "no_draft_probs"])
def test_random_path_reproduces_the_target_distribution(draft_q, from_logits):
    drafts, output = sample_many(TARGET_LOGITS, draft_q, requests=20000,
                                 from_logits=from_logits)
    first = output[:, 0].long()
    assert_distributed_as(first, target_distribution(TARGET_LOGITS[0]), "first token")
    # The drafts were rejected often enough for both the accept and the recovery branch to
    # matter (q is far from p), and accepted often enough to reach the second position.
    accepted_first = output[:, 0] == drafts[:, 0]
    assert 0.2 < accepted_first.float().mean() < 0.9
    # Given the first draft was accepted, the second emitted token follows the second row.
    second = output[accepted_first, 1].long()
    assert_distributed_as(second, target_distribution(TARGET_LOGITS[1]), "second token")


@PATHS
def test_the_distribution_holds_with_counts_that_change_per_request(from_logits):
    """What the draft-length controller makes: 0, 1 or 2 drafts per request in one batch
    (drawn from the draft distribution). Every request's first token follows the target's
    first row, whatever its count; the second follows the second row wherever a first draft
    was accepted."""
    torch.manual_seed(3)
    requests = 18000
    counts = torch.randint(0, 3, (requests,)).tolist()
    drafts, draft_rows, logits_rows = [], [], []
    for n in counts:
        ids = [int(torch.multinomial(DRAFT_Q[i], 1)) for i in range(n)]
        drafts.append(ids)
        draft_rows += [DRAFT_Q[i] for i in range(n)]
        logits_rows += [TARGET_LOGITS[i] for i in range(n + 1)]  # drafts, then the bonus
    output = rows_of(ours(from_logits=from_logits)(
        spec_metadata(drafts), torch.stack(draft_rows), torch.stack(logits_rows),
        sampling_metadata([1.0] * requests)).sampled_token_ids)
    first = torch.tensor([row[0] for row in output])
    assert_distributed_as(first, target_distribution(TARGET_LOGITS[0]), "first token")
    second = torch.tensor([row[1] for row, ids in zip(output, drafts, strict=True)
                           if len(ids) == 2 and row[0] == ids[0]])
    assert len(second) > 1000
    assert_distributed_as(second, target_distribution(TARGET_LOGITS[1]), "second token")


def test_the_chi_squared_check_can_fail():
    # The same check against the draft's own distribution (what a sampler that accepted
    # every draft would produce) must reject: the test has the power to see a wrong sampler.
    drafts, output = sample_many(TARGET_LOGITS, DRAFT_Q, requests=20000)
    statistic, dof = chi_squared(drafts[:, 0], target_distribution(TARGET_LOGITS[0]))
    assert statistic > 10 * CHI2_CRITICAL_0_001[dof]


@PATHS
def test_temperature_and_top_k_shape_the_distribution(from_logits):
    temperature, top_k = 0.6, 3
    drafts, output = sample_many(TARGET_LOGITS, DRAFT_Q, requests=20000,
                                 temperature=temperature, top_k=top_k, from_logits=from_logits)
    expected = target_distribution(TARGET_LOGITS[0], temperature, top_k)
    assert int((expected > 0).sum()) == top_k
    # chi_squared fails outright on a token outside the top-k, at either position.
    assert_distributed_as(output[:, 0].long(), expected, "first token under top-k")
    accepted_first = output[:, 0] == drafts[:, 0]
    second_support = target_distribution(TARGET_LOGITS[1], temperature, top_k) > 0
    second = output[accepted_first, 1].long()
    assert second_support[second].all()


@PATHS
def test_temperature_alone_shapes_the_distribution(from_logits):
    # Without top-k / top-p the CPU default verifies the runner's rows where they lie and
    # divides by the temperature as it reads them.
    drafts, output = sample_many(TARGET_LOGITS, DRAFT_Q, requests=20000, temperature=0.6,
                                 from_logits=from_logits)
    assert_distributed_as(output[:, 0].long(), target_distribution(TARGET_LOGITS[0], 0.6),
                          "first token at temperature 0.6")
    accepted_first = output[:, 0] == drafts[:, 0]
    assert_distributed_as(output[accepted_first, 1].long(),
                          target_distribution(TARGET_LOGITS[1], 0.6),
                          "second token at temperature 0.6")


@pytest.mark.parametrize("with_draft_probs,greedy", [(True, False), (False, False),
                                                     (False, True)])
def test_rows_verified_in_place_equal_the_copied_rows(monkeypatch, with_draft_probs, greedy):
    """The no-copy way (draft rows read where the runner left them, temperature applied on
    the way) emits what the copy-then-scale way emits for the same draws."""
    generator = torch.Generator().manual_seed(11)
    lengths = [4, 2, 0, 3, 4]
    vocab = 500
    logits = torch.randn(sum(lengths) + len(lengths), vocab, generator=generator) * 3
    drafts = drafts_near_argmax(logits, lengths, generator)
    draft_probs = None
    if with_draft_probs:
        draft_probs = (torch.randn(sum(lengths), vocab, generator=generator) * 3).softmax(-1)
    # Powers of two: dividing and multiplying by the inverse round alike.
    sampling = sampling_metadata([0.0] * 5 if greedy else [0.5, 1.0, 2.0, 0.25, 0.5])
    taken = []
    sampler = ours()
    real_check = sampler._verifies_untouched_rows

    def spy(*args):
        taken.append(real_check(*args))
        return taken[-1]

    monkeypatch.setattr(sampler, "_verifies_untouched_rows", spy)
    untouched = logits.clone()
    torch.manual_seed(5)
    in_place = sampler(spec_metadata(drafts), draft_probs, logits, sampling).sampled_token_ids
    assert taken == [True] and torch.equal(logits, untouched)
    monkeypatch.setattr(sampler, "_verifies_untouched_rows", lambda *args: False)
    torch.manual_seed(5)
    copied = sampler(spec_metadata(drafts), draft_probs, logits, sampling).sampled_token_ids
    assert torch.equal(in_place, copied)
    accepted = [len(row) - 1 for row in rows_of(in_place)]
    assert 0 < sum(accepted) < sum(lengths)
    if greedy:
        assert rows_of(in_place) == greedy_chain(drafts, logits)


def test_rows_are_copied_when_anything_but_the_temperature_changes_them():
    sampler = ours()
    logits = torch.zeros(3, 8)
    plain = sampling_metadata([0.7, 0.9])
    assert sampler._verifies_untouched_rows(logits, plain, False)
    assert not sampler._verifies_untouched_rows(logits, plain, True)  # logprobs
    assert not ours(from_logits=False)._verifies_untouched_rows(logits, plain, False)
    assert not ours(backend="reference")._verifies_untouched_rows(logits, plain, False)
    changed = [sampling_metadata([0.7, 0.0]), sampling_metadata([0.7, 0.9], top_k=[3, 3]),
               sampling_metadata([0.7, 0.9], top_p=[0.5, 0.5]),
               replace(plain, no_penalties=False),
               replace(plain, allowed_token_ids_mask=torch.zeros(2, 8, dtype=torch.bool)),
               replace(plain, bad_words_token_ids={0: [[3]]})]
    min_tokens = object.__new__(MinTokensLogitsProcessor)
    min_tokens.min_toks = {}
    assert sampler._verifies_untouched_rows(
        logits, replace(plain, logitsprocs=LogitsProcessors([min_tokens])), False)
    min_tokens.min_toks = {0: (4, [], {7})}  # request 0 may not stop before 4 tokens
    changed.append(replace(plain, logitsprocs=LogitsProcessors([min_tokens])))
    for metadata in changed:
        assert not sampler._verifies_untouched_rows(logits, metadata, False)


@PATHS
def test_top_p_drops_the_tail(from_logits):
    # With top-p 0.5 the target keeps its two most likely tokens (0 and 3) at position 0.
    drafts, output = sample_many(TARGET_LOGITS, DRAFT_Q, requests=4000, top_p=0.5,
                                 from_logits=from_logits)
    assert set(output[:, 0].tolist()) == {0, 3}


def test_random_path_equals_vllms_verification_on_the_same_draws():
    # vLLM 0.32's CPU RejectionSampler cannot serve as the reference for the whole random
    # path: its C++ stand-in for expand_kernel writes into an int64 copy of the float
    # temperature buffer and leaves the real one uninitialised. Its rejection_sample (the
    # verification proper, given the constrained logits) is sound: same seed, same tokens.
    generator = torch.Generator().manual_seed(11)
    lengths = [4, 0, 2, 4, 3, 1, 4, 4]
    vocab = 64
    target_logits = torch.randn(sum(lengths), vocab, generator=generator) * 2
    draft_probs = torch.randn(sum(lengths), vocab, generator=generator).softmax(dim=-1)
    drafts = [torch.multinomial(draft_probs[i], 1, generator=generator).item()
              for i in range(sum(lengths))]
    bonus = torch.randint(0, vocab, (len(lengths), 1), generator=generator)
    metadata = spec_metadata([[0] * n for n in lengths])
    draft_ids = torch.tensor(drafts, dtype=torch.int32)
    temperatures = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0]
    sampling = sampling_metadata(temperatures)
    for probs in (draft_probs, None):
        torch.manual_seed(5)
        theirs = vllm_rejection.rejection_sample(
            draft_ids, lengths, max(lengths), metadata.cu_num_draft_tokens, probs,
            target_logits.clone(), bonus, sampling)
        torch.manual_seed(5)
        mine = rejection_sample(
            draft_ids, lengths, metadata.cu_num_draft_tokens, max(lengths), probs,
            target_logits.clone(), bonus, temperature=sampling.temperature, all_greedy=False,
            all_random=False, from_logits=False)
        assert torch.equal(mine, theirs)


# --- ragged batches and seeds --------------------------------------------------------------


@PATHS
def test_requests_without_drafts_get_only_their_bonus_token(from_logits):
    generator = torch.Generator().manual_seed(2)
    lengths = [0, 3, 0, 0, 2]
    logits = torch.randn(sum(lengths) + len(lengths), 30, generator=generator)
    drafts = drafts_near_argmax(logits, lengths, generator)
    for temperatures in ([0.0] * 5, [1.0] * 5, [0.0, 1.0, 1.0, 0.0, 1.0]):
        output = ours(from_logits=from_logits)(spec_metadata(drafts), None, logits.clone(),
                                               sampling_metadata(temperatures)).sampled_token_ids
        for row, length in enumerate(lengths):
            if length == 0:
                emitted = rows_of(output)[row]
                assert len(emitted) == 1
                if temperatures[row] == 0:
                    bonus_row = int(spec_metadata(drafts).bonus_logits_indices[row])
                    assert emitted == [int(logits[bonus_row].argmax())]


def seeded_run(position: int, others: int, seed: int, from_logits: bool,
               logits_row_seed: int = 0):
    """A seeded request at ``position`` among ``others`` unseeded ones with other drafts."""
    vocab, length = 40, 3
    request_logits = torch.randn(length + 1, vocab,
                                 generator=torch.Generator().manual_seed(logits_row_seed))
    request_drafts = request_logits[:length].argmax(dim=-1).tolist()
    request_drafts[1] = (request_drafts[1] + 1) % vocab  # rejected at position 1 if greedy
    filler = torch.Generator().manual_seed(1000 + others)
    drafts, blocks = [], []
    for index in range(others + 1):
        if index == position:
            drafts.append(request_drafts)
            blocks.append(request_logits)
        else:
            n = int(torch.randint(0, 5, (1,), generator=filler))
            drafts.append(torch.randint(0, vocab, (n,), generator=filler).tolist())
            blocks.append(torch.randn(n + 1, vocab, generator=filler))
    generators = {position: torch.Generator().manual_seed(seed)}
    sampling = sampling_metadata([1.0] * (others + 1), generators=generators)
    output = ours(from_logits=from_logits)(spec_metadata(drafts), None, torch.cat(blocks),
                                           sampling)
    return rows_of(output.sampled_token_ids)[position]


@PATHS
def test_seeded_requests_do_not_depend_on_the_batch(from_logits):
    alone = seeded_run(position=0, others=0, seed=42, from_logits=from_logits)
    torch.manual_seed(123)  # the unseeded requests draw from the default generator
    assert seeded_run(position=2, others=6, seed=42, from_logits=from_logits) == alone
    torch.manual_seed(321)
    assert seeded_run(position=5, others=9, seed=42, from_logits=from_logits) == alone
    # The seed matters: over a few other seeds the request's tokens change.
    assert any(seeded_run(position=0, others=0, seed=s, from_logits=from_logits) != alone
               for s in range(43, 48))


# --- penalties, registration, configuration ------------------------------------------------


def test_penalties_equal_vllms():
    generator = torch.Generator().manual_seed(4)
    vocab, rows = 25, 5
    logits = torch.randn(rows, vocab, generator=generator)
    prompts = torch.randint(0, vocab + 1, (2, 6), generator=generator)  # vocab pads
    repeat = torch.tensor([0, 0, 1, 1, 1])
    outputs = [[1, 2, 2], [1, 2, 2, 7], [3], [3, 9], [3, 9, 9, 9]]
    sampling = replace(sampling_metadata([1.0, 1.0]), no_penalties=False,
                       prompt_token_ids=prompts,
                       presence_penalties=torch.tensor([0.5, -0.3]),
                       frequency_penalties=torch.tensor([0.2, 0.4]),
                       repetition_penalties=torch.tensor([1.3, 0.8]))
    mine = AscendRejectionSampler.apply_penalties(logits.clone(), sampling, None, repeat,
                                                  outputs)
    theirs = vllm_rejection.RejectionSampler.apply_penalties(logits.clone(), sampling, None,
                                                             repeat, outputs)
    assert not torch.equal(mine, logits)
    torch.testing.assert_close(mine, theirs)


def test_registered_and_installed_in_a_runner():
    register()
    assert REJECTION_SAMPLERS.get("ascend") is rejection_sampler_factory
    runner = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=None),
                             sampler=Sampler(), device=torch.device("cpu"),
                             rejection_sampler=vllms())
    assert install_registered_rejection_sampler(runner) == "ascend"
    assert isinstance(runner.rejection_sampler, AscendRejectionSampler)


def test_factory_takes_the_configured_backend():
    from ascend_core.config import init_ascend_config, reset_ascend_config

    spec = SimpleNamespace(rejection_sample_method="standard")
    try:
        init_ascend_config({"rejection_sampler_config": {"backend": "reference"}}, target="host")
        assert rejection_sampler_factory(Sampler(), spec, "cpu").backend == "reference"
        init_ascend_config({}, target="host")
        assert rejection_sampler_factory(Sampler(), spec, "cpu").backend is None
    finally:
        reset_ascend_config()


def test_synthetic_acceptance_stays_with_vllm():
    synthetic = SimpleNamespace(rejection_sample_method="synthetic")
    assert rejection_sampler_factory(Sampler(), synthetic, "cpu") is None
    with pytest.raises(ValueError, match="rejection_sample_method='synthetic'"):
        AscendRejectionSampler(Sampler(), synthetic)


def test_random_batch_needs_temperatures():
    with pytest.raises(ValueError, match="temperature is None but not every request"):
        rejection_sample(torch.zeros(1, dtype=torch.int32), [1], torch.tensor([1]), 1, None,
                         torch.zeros(1, 4), torch.zeros(1, 1, dtype=torch.int64),
                         temperature=None, all_greedy=False, all_random=True)


def test_rows_in_place_only_where_they_are_served():
    args = (torch.zeros(2, dtype=torch.int32), [1, 1], torch.tensor([1, 2]), 1, None,
            torch.zeros(4, 8), torch.zeros(2, 1, dtype=torch.int64))
    rows = torch.tensor([0, 2])
    with pytest.raises(ValueError, match="all greedy or all random; copy the draft rows"):
        rejection_sample(*args, temperature=torch.tensor([0.0, 0.7]), all_greedy=False,
                         all_random=False, target_rows=rows)
    with pytest.raises(ValueError, match=r"verified from the logits \(from_logits\) only"):
        rejection_sample(*args, temperature=torch.tensor([0.5, 0.7]), all_greedy=False,
                         all_random=True, target_rows=rows, from_logits=False)


# --- Medusa trees ----------------------------------------------------------------------------

TREE_PATHS = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def tree_sampler():
    from ascend_specdec.medusa.tree import parse_tree

    sampler = ours()
    sampler.tree = parse_tree(TREE_PATHS, num_heads=3, num_nodes=len(TREE_PATHS))
    return sampler


def test_tree_steps_emit_each_requests_accepted_path_and_next_token():
    from ascend_specdec.medusa.tree import accepted_path_nodes, verify_greedy

    generator = torch.Generator().manual_seed(5)
    counts = [6, 0, 3, 6]
    vocab = 30
    logits = torch.randn(sum(counts) + len(counts), vocab, generator=generator)
    sampler = tree_sampler()
    tree = sampler.tree
    # Drafts that agree with the target along one path per request.
    drafts, start = [], 0
    for m in counts:
        argmax = logits[start:start + m + 1].argmax(-1).tolist()
        own = torch.randint(0, vocab, (m,), generator=generator).tolist()
        if m:
            own[1 if m > 1 else 0] = argmax[0]  # the root's second child ([1]) agrees
            if m > 4:
                own[4] = argmax[2]  # and [1, 0] after it
        drafts.append(own)
        start += m + 1
    output = sampler(spec_metadata(drafts), None, logits.clone(),
                     sampling_metadata([0.0] * len(counts))).sampled_token_ids
    assert output.shape == (len(counts), max(counts) + 1)
    expected, start = [], 0
    for m, own in zip(counts, drafts, strict=True):
        tokens, last = verify_greedy(tree, own, logits[start:start + m + 1].argmax(-1).tolist())
        expected.append(tokens)
        start += m + 1
    assert rows_of(output) == expected
    assert [len(row) for row in expected] == [3, 1, 2, 3]
    assert sampler.tree_accepted == [[1, 4], [], [1], [1, 4]]
    assert accepted_path_nodes(tree, 5) == [1, 4]


def test_tree_logprobs_are_read_at_each_tokens_row():
    generator = torch.Generator().manual_seed(9)
    counts = [6, 2]
    logits = torch.randn(sum(counts) + len(counts), 20, generator=generator)
    argmax = logits.argmax(-1).tolist()
    # Request 0 accepts node [1] (row 2) then [1, 0] (row 5); request 1 accepts [0] (row 1).
    drafts = [[99 % 20, argmax[0], 0, 0, argmax[2], 0], [argmax[7], 3]]
    drafts[0][0] = (argmax[0] + 1) % 20
    sampler = tree_sampler()
    out = sampler(spec_metadata(drafts), None, logits.clone(),
                  sampling_metadata([0.0, 0.0], max_num_logprobs=2))
    assert sampler.tree_accepted == [[1, 4], [0]]
    rows = [[0, 2, 5], [7, 8]]
    logprobs = torch.log_softmax(logits, dim=-1)
    tensors = out.logprobs_tensors
    width = out.sampled_token_ids.shape[1]
    for r, request_rows in enumerate(rows):
        for i, row in enumerate(request_rows):
            flat = r * width + i
            token = int(out.sampled_token_ids[r, i])
            assert token == argmax[row]
            assert tensors.logprob_token_ids[flat, 0] == token
            torch.testing.assert_close(tensors.logprobs[flat, 0], logprobs[row, token])
            top = logprobs[row].topk(2)
            assert tensors.logprob_token_ids[flat, 1:].tolist() == top.indices.tolist()


def test_tree_steps_sample_the_target_distribution():
    """Through the sampler: the first token of a tree step follows the target's root row
    (temperature and top-k applied), its drafts the root's two likeliest tokens."""
    vocab = 6
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(2)) * 2
    temperature, top_k = 0.8, 4
    probs = torch.softmax(logits[0] / temperature, -1)
    probs[probs < probs.topk(top_k).values[-1]] = 0
    probs /= probs.sum()
    first_two = probs.topk(2).indices.tolist()
    drafts = [[first_two[0], first_two[1], 0, 1, 2, 3]]
    sampler = tree_sampler()
    generator = torch.Generator().manual_seed(0)
    sampling = sampling_metadata([temperature], top_k=[top_k], generators={0: generator})
    metadata = spec_metadata(drafts)
    samples = torch.tensor([int(sampler(metadata, None, logits.clone(), sampling)
                                .sampled_token_ids[0, 0]) for _ in range(4000)])
    statistic, dof = chi_squared(samples, probs)
    assert statistic < CHI2_CRITICAL_0_001[dof], statistic


def test_tree_rows_get_penalties_bad_words_allowed_ids_and_min_tokens_from_their_own_path():
    """Each row of a tree step is processed with its own history: the request's output,
    then the drafts from the root to that row's node, never a sibling branch's."""
    from dataclasses import replace

    from vllm.v1.sample.logits_processor import MinTokensLogitsProcessor

    vocab, stop = 20, 19
    # Nodes of TREE_PATHS: [0] [1] [0,0] [0,1] [1,0] [0,0,0] draft tokens 7 .. 12.
    drafts = [7, 8, 9, 10, 11, 12]
    minimum = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
    done = [5]
    minimum.min_toks = {0: (3, done, {stop}, False)}  # two more tokens before a stop
    allowed_mask = torch.zeros(1, vocab, dtype=torch.bool)
    allowed_mask[0, 17] = True  # True: not allowed
    sampling = replace(sampling_metadata([0.0]), no_penalties=False,
                       prompt_token_ids=torch.tensor([[vocab]]),  # padding only
                       repetition_penalties=torch.tensor([2.0]), output_token_ids=[done],
                       allowed_token_ids_mask=allowed_mask,
                       bad_words_token_ids={0: [[7, 9], [13]]},
                       logitsprocs=LogitsProcessors([minimum]))
    sampler = tree_sampler()
    rows = sampler._process_tree_rows(torch.full((7, vocab), 2.0), sampling, [6], drafts)
    penalized = [set((row == 1.0).nonzero().flatten().tolist()) for row in rows]
    # Rows: the root, then nodes 0 .. 5 with paths [7] [8] [7,9] [7,10] [8,11] [7,9,12].
    assert penalized == [{5}, {5, 7}, {5, 8}, {5, 7, 9}, {5, 7, 10}, {5, 8, 11},
                         {5, 7, 9, 12}]
    banned = [set(row.isinf().nonzero().flatten().tolist()) for row in rows]
    # 13 and the disallowed 17 everywhere; 9 only after 7; the stop token below depth 2.
    assert banned == [{13, 17, stop}, {9, 13, 17, stop}, {13, 17, stop}, {13, 17},
                      {13, 17}, {13, 17}, {13, 17}]
    # Through the sampler, greedy: the penalty moves the root's choice off token 5.
    logits = torch.zeros(7, vocab)
    logits[:, 5], logits[:, 6] = 3.0, 2.0
    out = sampler(spec_metadata([drafts]), None, logits.clone(), sampling).sampled_token_ids
    assert int(out[0, 0]) == 6


def test_tree_servers_refuse_the_sampling_options_a_tree_step_ignores():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from ascend_specdec.medusa.tree import parse_tree
    from ascend_specdec.vllm import medusa_tree

    grammar = {"structured_outputs": StructuredOutputsParams(choice=["a", "b"])}
    medusa_tree._served[0] = parse_tree([[0]], num_heads=1, num_nodes=1)
    try:
        for served_grammar in (True, False):
            medusa_tree._grammar[0] = served_grammar
            medusa_tree.check_request(SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
                                                     seed=3, logprobs=2))
            medusa_tree.check_request(SamplingParams(presence_penalty=0.5,
                                                     repetition_penalty=1.2, min_tokens=2,
                                                     allowed_token_ids=[1, 2], bad_words=["x"]))
            refused = [({"thinking_token_budget": 4}, "thinking_token_budget"),
                       ({"logprob_token_ids": [1]}, "logprob_token_ids")]
            if served_grammar:  # the scheduler masks each tree row
                medusa_tree.check_request(SamplingParams(**grammar))
            else:
                refused.append((grammar, "structured_outputs"))
            for options, name in refused:
                with pytest.raises(ValueError, match=f"the request sets {name}: send it"):
                    medusa_tree.check_request(SamplingParams(**options))
        medusa_tree._served[0] = None  # no tree served: nothing refused
        medusa_tree.check_request(SamplingParams(thinking_token_budget=4))
    finally:
        medusa_tree._served[0], medusa_tree._grammar[0] = None, False


@pytest.mark.parametrize("reasoning, scheduler_cls, grammar", [
    (None, None, True),
    ("deepseek_r1", None, False),  # vLLM finds the end of reasoning along one chain
    (None, "my.Scheduler", False),  # another scheduler: no tree rows' masks
])
def test_tree_servers_mask_grammars_per_row_where_the_scheduler_is_ours(
        monkeypatch, reasoning, scheduler_cls, grammar):
    from types import SimpleNamespace

    from ascend_specdec.medusa.tree import parse_tree
    from ascend_specdec.vllm import medusa_tree
    from ascend_specdec.vllm.draft_length import SCHEDULER

    monkeypatch.setattr(medusa_tree, "configured_tree",
                        lambda config: parse_tree([[0]], num_heads=1, num_nodes=1))
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(scheduler_cls=scheduler_cls),
        structured_outputs_config=SimpleNamespace(reasoning_parser=reasoning))
    try:
        medusa_tree.check_config(config)
        assert medusa_tree._grammar[0] is grammar
        assert config.scheduler_config.scheduler_cls == (
            SCHEDULER if grammar else scheduler_cls)
    finally:
        medusa_tree._served[0], medusa_tree._grammar[0] = None, False
