"""Random rejection sampling straight from the target's logits, for the CPU.

The same verification as :func:`ascend_kernels.rejection.rejection_random_sample` with
:func:`~ascend_kernels.rejection.sample_recovered_tokens` (accept draft ``x`` when
``u <= p(x) / q(x)``, at the first rejection emit a sample of ``normalize(max(p - q, 0))``,
bonus token when all are accepted), arranged so that a CPU passes over the ``[N, V]`` target
once instead of several times:

- acceptance needs ``p`` at the draft tokens only, gathered from one fused softmax pass;
- a request emits a recovered token at one position at most (its first rejection), so the
  residual ``max(p - q, 0)`` is built for those ``<= B`` rows only, not all ``N``;
- the recovered token is drawn by inverse CDF from one uniform per request (block sums,
  then a running sum inside one block, and binary searches), instead of ``[B, V]``
  exponential noise, which costs more to draw on a CPU than the target costs to read.

Both ways draw exact samples of the same distributions; the tokens differ for the same
seed, because the draws are different. Randomness is still supplied by the caller:
``uniform_probs [N]`` as for the other ops, ``recovery_uniform [B]`` from
:func:`generate_recovery_uniforms`.

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| rejection_sample_from_logits | yes | none (rejection.py's kernels serve devices) | none |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ascend_kernels.dispatch import REFERENCE, resolve_backend
from ascend_kernels.rejection import (
    _check_bonus_and_greedy,
    _check_layout,
    _check_out,
    _check_probs,
    _leading_true,
    _positions,
    _require_noise,
    _require_shape,
    _write_rows,
)


def generate_recovery_uniforms(num_draft_tokens: Sequence[int],
                               generators: Mapping[int, torch.Generator] | None = None,
                               device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B]`` float64 uniforms, one per request, for the recovered-token draw. A request
    with its own generator draws from it only when it has drafts (otherwise its entry comes
    from the default generator and is unused), so a seeded request consumes its generator
    only in steps where it has drafts, as with the other draws."""
    uniforms = torch.rand(len(num_draft_tokens), dtype=torch.float64, device=device)
    for request, generator in (generators or {}).items():
        if num_draft_tokens[request] > 0:
            uniforms[request:request + 1].uniform_(generator=generator)
    return uniforms


# Tokens per block of the two-level inverse CDF: a running sum over a whole 150k vocabulary
# row is sequential and slow on a CPU; block sums are not, and only one block per row then
# needs a running sum.
_CDF_BLOCK = 256


def _inverse_cdf(weights: torch.Tensor,
                 uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``weights [R, V]`` (>= 0): the first token whose cumulative weight
    exceeds ``u * total``, a draw from ``weights / total``, and the row's total (a row
    without weight gets an arbitrary token). A token without weight is never picked, as
    its cumulative sum equals its predecessor's."""
    rows, vocab = weights.shape
    blocks = -(-vocab // _CDF_BLOCK)
    if vocab % _CDF_BLOCK == 0 and weights.is_contiguous():  # 32000, 152064, ...: no copy
        padded = weights.view(rows, blocks, _CDF_BLOCK)
    else:
        padded = weights.new_zeros(rows, blocks * _CDF_BLOCK)
        padded[:, :vocab] = weights
        padded = padded.view(rows, blocks, _CDF_BLOCK)
    block_cdf = padded.sum(dim=2, dtype=torch.float64).cumsum(dim=1)
    threshold = (uniforms.double() * block_cdf[:, -1]).unsqueeze(1)
    block = torch.searchsorted(block_cdf, threshold, right=True).clamp_(max=blocks - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    inside = padded[torch.arange(rows, device=weights.device), block.squeeze(1)]
    inner_cdf = before + inside.cumsum(dim=1, dtype=torch.float64)
    offset = torch.searchsorted(inner_cdf, threshold, right=True).squeeze(1)
    # Summation order can leave the threshold at or past the block's last running sum
    # (u within rounding of 1): take the block's last token with weight.
    overflow = offset >= _CDF_BLOCK
    if bool(overflow.any()):
        offset[overflow] = (_CDF_BLOCK - 1
                            - (inside[overflow].flip(1) > 0).int().argmax(dim=1))
    return block.squeeze(1) * _CDF_BLOCK + offset, block_cdf[:, -1]


def _sample_residual(probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     rows: torch.Tensor, drafts: torch.Tensor,
                     uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row in ``rows``, from ``normalize(max(p - q, 0))``."""
    residual = probs.index_select(0, rows)
    if draft_probs is None:
        residual.scatter_(1, drafts.unsqueeze(1), 0.0)  # q is one-hot at the draft token
    else:
        residual.sub_(draft_probs.index_select(0, rows).float()).clamp_(min=0.0)
    picked, total = _inverse_cdf(residual, uniforms)
    empty = total <= 0
    # No residual mass at all (p equals q, or p is one-hot at the draft): the draft is then
    # always accepted, so this is never emitted; the target's argmax keeps it well defined.
    if bool(empty.any()):
        picked = torch.where(empty, probs.index_select(0, rows).argmax(dim=-1), picked)
    return picked


def rejection_sample_from_logits_reference(out: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                           draft_token_ids: torch.Tensor,
                                           draft_probs: torch.Tensor | None,
                                           target_logits: torch.Tensor,
                                           bonus_token_ids: torch.Tensor,
                                           uniform_probs: torch.Tensor,
                                           recovery_uniform: torch.Tensor,
                                           is_greedy: torch.Tensor | None) -> torch.Tensor:
    width = out.shape[1]
    tokens = draft_token_ids.shape[0]
    counts, real, flat = _positions(cu_num_draft_tokens, tokens, width - 1)
    random_rows = None if is_greedy is None else ~is_greedy
    if tokens == 0:
        return _write_rows(out, random_rows, torch.zeros_like(flat), counts, counts,
                           bonus_token_ids)
    drafts = draft_token_ids.long()
    vocab_ids = drafts.clamp(min=0)  # -1 marks a padded draft, rejected below
    # One fused pass; on a CPU cheaper than a logsumexp, which takes four.
    probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    target_p = probs.gather(1, vocab_ids.unsqueeze(1)).squeeze(1)
    if draft_probs is None:
        accept = target_p >= uniform_probs  # q = 1 for argmax drafts
    else:
        draft_p = draft_probs.gather(1, vocab_ids.unsqueeze(1)).squeeze(1).float()
        ratio = target_p / torch.where(draft_p > 0, draft_p, 1.0)
        accept = (draft_p > 0) & (ratio >= uniform_probs)
    accept &= drafts >= 0
    accepted = _leading_true(real & accept[flat])
    emitted = torch.where(real, drafts[flat], 0)
    rejected = accepted < counts
    if random_rows is not None:
        rejected &= random_rows
    requests = rejected.nonzero().squeeze(1)
    if requests.numel():
        rows = flat[requests, accepted[requests]]
        recovered = _sample_residual(probs, draft_probs, rows, vocab_ids[rows],
                                     recovery_uniform[requests].double())
        emitted[requests, accepted[requests]] = recovered
    return _write_rows(out, random_rows, emitted, counts, accepted, bonus_token_ids)


def rejection_sample_from_logits(cu_num_draft_tokens: torch.Tensor,
                                 draft_token_ids: torch.Tensor,
                                 draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                                 bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                                 recovery_uniform: torch.Tensor, max_spec_len: int,
                                 is_greedy: torch.Tensor | None = None, *,
                                 out: torch.Tensor | None = None,
                                 backend: str | None = None) -> torch.Tensor:
    """Random verification from the target's logits (see the module docstring).

    ``target_logits [N, V]`` (after temperature / top-k / top-p; ``p`` is their softmax),
    ``draft_probs [N, V]`` or None (``q = 1``, argmax drafts), ``uniform_probs [N]``,
    ``recovery_uniform [B]``. Rows with ``is_greedy`` True are left alone; ``out`` as in
    :func:`ascend_kernels.rejection.rejection_greedy_sample`.
    """
    op = "rejection_sample_from_logits"
    batch, tokens = _check_layout(op, cu_num_draft_tokens, draft_token_ids, max_spec_len)
    vocab = _check_probs(op, "target_logits", target_logits, tokens, None)
    if draft_probs is not None:
        _check_probs(op, "draft_probs", draft_probs, tokens, vocab)
    _require_noise(op, "uniform_probs", uniform_probs, "float64 (as vLLM) or float32")
    _require_shape(op, "uniform_probs", uniform_probs, (tokens,), "one per draft token")
    _require_noise(op, "recovery_uniform", recovery_uniform, "float64 or float32")
    _require_shape(op, "recovery_uniform", recovery_uniform, (batch,), "one per request")
    bonus = _check_bonus_and_greedy(op, bonus_token_ids, is_greedy, batch)
    out = _check_out(op, out, batch, max_spec_len, draft_token_ids.device)
    resolve_backend(op, target_logits, (REFERENCE,), backend)
    if batch == 0:
        return out
    return rejection_sample_from_logits_reference(out, cu_num_draft_tokens, draft_token_ids,
                                                  draft_probs, target_logits, bonus,
                                                  uniform_probs, recovery_uniform, is_greedy)
