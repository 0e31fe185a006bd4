"""Random rejection sampling straight from the target's logits, for the CPU.

The same verification as :func:`ascend_kernels.rejection.rejection_random_sample` with
:func:`~ascend_kernels.rejection.sample_recovered_tokens` (accept draft ``x`` when
``u <= p(x) / q(x)``, at the first rejection emit a sample of ``normalize(max(p - q, 0))``,
bonus token when all are accepted), arranged so that a CPU reads as little of the ``[N, V]``
target as the outcome allows:

- position by position: a row is read only if every earlier draft of its request was
  accepted (the rows after a request's first rejection never matter);
- each read row is softmaxed in place, in a small buffer that stays in cache, with the
  temperature applied on the way when the caller has not applied it;
- at a rejection the recovered token, a draw from ``r = max(p - q, 0)`` normalised, is drawn
  without reading ``q``'s row: up to ``_CANDIDATES`` candidates ``y ~ p`` (inverse CDF of the
  row still in cache: block sums, then a running sum inside one block, and binary searches),
  each kept with probability ``r(y) / p(y)``; the first kept one is an exact draw from the
  residual (each try keeps ``y`` with probability ``r(y)``). Only where every candidate is
  refused (likely only when ``p`` and ``q`` nearly agree, which makes a rejection itself
  rare) is the residual built from ``q``'s row and drawn by inverse CDF; the mixture is
  still exactly the residual, as every try's outcome is. This replaces ``[B, V]``
  exponential noise, which costs more to draw on a CPU than the target costs to read.

This module and the per-position ops draw exact samples of the same distributions; the
tokens differ for the same seed, because the draws are different. Randomness is still
supplied by the caller: ``uniform_probs [N]`` as for the other ops,
``recovery_uniform [B, RECOVERY_DRAWS]`` from :func:`generate_recovery_uniforms`.

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| rejection_sample_from_logits | yes | none (rejection.py's kernels serve devices) | none |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ascend_kernels.dispatch import REFERENCE, require_float, resolve_backend
from ascend_kernels.rejection import (
    _check_bonus_and_greedy,
    _check_layout,
    _check_out,
    _check_probs,
    _positions,
    _require_int,
    _require_noise,
    _require_shape,
    _write_rows,
)

# Candidates drawn from p for a recovered token before the residual is built from q's row.
# A try is refused with probability 1 - TV(p, q), so all 16 are refused in about a fifth of
# the rejections of a draft as close to the target as TV 0.1 (whose drafts are rarely
# rejected), in 3% at TV 0.2 and almost never below that agreement.
_CANDIDATES = 16
# Uniforms per request for its recovered token: one per candidate, one per candidate's keep
# test, one for the residual's inverse CDF.
RECOVERY_DRAWS = 2 * _CANDIDATES + 1


def generate_recovery_uniforms(num_draft_tokens: Sequence[int],
                               generators: Mapping[int, torch.Generator] | None = None,
                               device: torch.device | str = "cpu") -> torch.Tensor:
    """``[B, RECOVERY_DRAWS]`` float64 uniforms, one row per request, for the recovered-token
    draw. A request with its own generator draws from it only when it has drafts (otherwise
    its row comes from the default generator and is unused), so a seeded request consumes
    its generator only in steps where it has drafts, as with the other draws."""
    uniforms = torch.rand(len(num_draft_tokens), RECOVERY_DRAWS, dtype=torch.float64,
                          device=device)
    for request, generator in (generators or {}).items():
        if num_draft_tokens[request] > 0:
            uniforms[request].uniform_(generator=generator)
    return uniforms


# Tokens per block of the two-level inverse CDF: a running sum over a whole 150k vocabulary
# row is sequential and slow on a CPU; block sums are not, and only one block per row then
# needs a running sum.
_CDF_BLOCK = 256
# Target logits turned into probabilities at a time: about 8 MB (13 rows of a 150k
# vocabulary, 64 of a 32k one) stay in cache from the softmax to the recovered-token draw,
# and the per-chunk work is spread over enough rows to cost little (of 2, 4, 8 and 16 MB, 8 MB
# was the quickest on a 2-core EPYC at batch 64, k = 4).
_CHUNK_ELEMENTS = 1 << 21


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for a 2-D float tensor, the same index (first of equal maxima,
    NaN counting as the largest), in about a third of the time on a CPU: the maxima of
    ``_CDF_BLOCK``-token blocks are one vectorised pass near memory speed, torch's argmax
    is not; then the argmax among the blocks and inside the winning one. Other devices get
    torch's argmax."""
    rows, vocab = x.shape
    full = vocab // _CDF_BLOCK * _CDF_BLOCK
    if x.device.type != "cpu" or full == 0 or x.stride(1) != 1:
        return x.argmax(dim=-1)
    blocks = x[:, :full].unflatten(1, (-1, _CDF_BLOCK))
    block = blocks.amax(dim=2).argmax(dim=1)
    inside = blocks[torch.arange(rows, device=x.device), block]
    picked = block * _CDF_BLOCK + inside.argmax(dim=1)
    if full == vocab:
        return picked
    tail = x[:, full:]
    best = x.gather(1, picked.unsqueeze(1)).squeeze(1)
    tail_best = tail.amax(dim=1)
    # The tail comes last: it wins only with a strictly larger value, or a NaN against none.
    wins = (tail_best > best) | (tail_best.isnan() & ~best.isnan())
    return torch.where(wins, full + tail.argmax(dim=1), picked)


def _pick_blocks(weights: torch.Tensor, uniforms: torch.Tensor,
                 rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of an inverse-CDF draw (see :func:`_inverse_cdf`): for each row of
    ``weights [R, V]`` (or only its ``rows [R']``, when given: block sums of every row cost
    less than a copy of some) and each of its ``uniforms [R, M]`` (``[R', M]``), the
    ``_CDF_BLOCK``-token block the draw falls in. Returns the blocks' weights
    ``[R, M, _CDF_BLOCK]`` (zero past the vocabulary), the cumulative weight before each
    ``[R, M]``, the draw's threshold ``u * total`` ``[R, M]``, the block's index ``[R, M]``
    and the row totals ``[R]``: what :func:`_pick_in_blocks` needs, small enough to keep
    once the rows are gone."""
    count, vocab = weights.shape
    blocks = -(-vocab // _CDF_BLOCK)
    if vocab % _CDF_BLOCK == 0 and weights.is_contiguous():  # 32000, 152064, ...: no copy
        padded = weights.view(count, blocks, _CDF_BLOCK)
    else:
        padded = weights.new_zeros(count, blocks * _CDF_BLOCK)
        padded[:, :vocab] = weights
        padded = padded.view(count, blocks, _CDF_BLOCK)
    # Block sums in the weights' own precision (a float64 copy of the rows would cost more
    # than the draw); the running sums over them in float64, from 0 before the first block.
    block_sums = padded.sum(dim=2)
    if rows is None:
        rows = torch.arange(weights.shape[0], device=weights.device)
    else:
        block_sums = block_sums.index_select(0, rows)
    block_cdf = torch.nn.functional.pad(block_sums.double().cumsum(dim=1), (1, 0))
    total = block_cdf[:, -1]
    threshold = uniforms.double() * total.unsqueeze(1)
    block = (torch.searchsorted(block_cdf, threshold, right=True) - 1).clamp_(0, blocks - 1)
    # The picked blocks' weights: one read of [R * M, _CDF_BLOCK] values.
    flat = block + (rows * blocks).unsqueeze(1)
    inside = padded.reshape(-1, _CDF_BLOCK).index_select(0, flat.view(-1))
    return (inside.view(*block.shape, _CDF_BLOCK), block_cdf.gather(1, block), threshold,
            block, total)


def _pick_in_blocks(inside: torch.Tensor, before: torch.Tensor, threshold: torch.Tensor,
                    block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of an inverse-CDF draw, from what :func:`_pick_blocks` returned: the
    tokens ``[R, M]`` and their weights."""
    inner_cdf = inside.cumsum(dim=2, dtype=torch.float64).add_(before.unsqueeze(2))
    offset = torch.searchsorted(inner_cdf, threshold.unsqueeze(2), right=True)
    # Summation order can leave the threshold at or past the block's last running sum
    # (u within rounding of 1): take the block's last token with weight.
    overflow = offset.squeeze(2) >= _CDF_BLOCK
    if bool(overflow.any()):
        last_with_weight = _CDF_BLOCK - 1 - (inside[overflow].flip(1) > 0).int().argmax(dim=1)
        offset[overflow] = last_with_weight.unsqueeze(1)
    return (block * _CDF_BLOCK + offset.squeeze(2), inside.gather(2, offset).squeeze(2))


def _inverse_cdf(weights: torch.Tensor,
                 uniforms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``weights [R, V]`` (>= 0) and each of its ``uniforms [R, M]``: the first
    token whose cumulative weight exceeds ``u * total``, a draw from ``weights / total``
    (``[R, M]``), and the row's total (a row without weight gets an arbitrary token). A
    token without weight is never picked, as its cumulative sum equals its predecessor's.
    Two levels: the block by the running sum of block sums, then the token by a running sum
    inside that block only (a running sum over a whole 150k row is sequential and slow)."""
    inside, before, threshold, block, total = _pick_blocks(weights, uniforms)
    return _pick_in_blocks(inside, before, threshold, block)[0], total


def _sample_residual(probs: torch.Tensor, draft_probs: torch.Tensor | None,
                     drafts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [R, V]`` (changed in place), from
    ``normalize(max(p - q, 0))`` by inverse CDF at ``uniforms [R]``; ``draft_probs`` are the
    rows' ``q`` (None: one-hot at ``drafts``)."""
    if draft_probs is None:
        probs.scatter_(1, drafts.unsqueeze(1), 0.0)  # q is one-hot at the draft token
    else:
        probs.sub_(draft_probs).clamp_(min=0.0)
    picked, total = _inverse_cdf(probs, uniforms.unsqueeze(1))
    picked = picked.squeeze(1)
    empty = total <= 0
    # No residual mass at all: p equals q, or p is one-hot at the draft. The draft is then
    # always accepted, so this is never emitted; q's argmax (p's) keeps it well defined.
    if bool(empty.any()):
        fallback = drafts if draft_probs is None else draft_probs.argmax(dim=-1)
        picked = torch.where(empty, fallback, picked)
    return picked


def _read_rows(source: torch.Tensor, rows: torch.Tensor, into: torch.Tensor) -> torch.Tensor:
    """``source[rows]`` as float32, written into the buffer ``into`` (``[len(rows), V]``)."""
    if source.dtype == torch.float32:
        return torch.index_select(source, 0, rows, out=into)
    return into.copy_(source.index_select(0, rows))


def _target_probs(target_logits: torch.Tensor, rows: torch.Tensor, scale: torch.Tensor | None,
                  into: torch.Tensor) -> torch.Tensor:
    """The target's ``p`` for ``rows`` of ``target_logits``, multiplied by ``scale [R]``
    first (None: as they are), computed in the buffer ``into``."""
    probs = _read_rows(target_logits, rows, into)
    if scale is not None:
        probs.mul_(scale.unsqueeze(1))
    return torch.softmax(probs, dim=-1, out=probs)


def _verify_position(target_logits: torch.Tensor, rows: torch.Tensor,
                     scale: torch.Tensor | None, drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, draft_rows: torch.Tensor,
                     uniforms: torch.Tensor, candidate_uniforms: torch.Tensor,
                     buffer: torch.Tensor) -> tuple[torch.Tensor, list[tuple]]:
    """Verify one draft token of each of ``R`` requests: ``rows [R]`` their rows of
    ``target_logits``, ``scale [R]`` what to multiply them by first (None: nothing),
    ``drafts [R]`` (-1: padding, rejected), ``draft_rows [R]`` their rows of ``draft_probs``,
    ``uniforms [R]``, ``candidate_uniforms [R, _CANDIDATES]``; ``buffer``: a float32
    ``[rows, V]`` tensor to work in, ``rows`` at a time. Returns whether each was accepted
    and, for the rejected ones, their indices and the blocks their recovered-token
    candidates fall in (:func:`_pick_blocks`), per chunk of rows."""
    vocab_ids = drafts.clamp(min=0)
    accepted = torch.empty(rows.shape[0], dtype=torch.bool, device=rows.device)
    candidates = []
    at_a_time = buffer.shape[0]
    for start in range(0, rows.shape[0], at_a_time):
        part = slice(start, start + at_a_time)
        ids = vocab_ids[part]
        probs = _target_probs(target_logits, rows[part], None if scale is None else scale[part],
                              buffer[:ids.shape[0]])
        target_p = probs.gather(1, ids.unsqueeze(1)).squeeze(1)
        if draft_probs is None:
            accept = target_p >= uniforms[part]  # q = 1 for argmax drafts
        else:
            draft_p = draft_probs[draft_rows[part], ids].float()
            accept = (draft_p > 0) & (target_p / torch.where(draft_p > 0, draft_p, 1.0)
                                      >= uniforms[part])
        accept &= drafts[part] >= 0
        accepted[part] = accept
        rejected = (~accept).nonzero().squeeze(1)
        if rejected.numel():
            # While the rows are in cache: the blocks of the candidates for their recovered
            # tokens, drawn from p (the rest of the draw waits for every position's).
            candidates.append((start + rejected, _pick_blocks(
                probs, candidate_uniforms[part][rejected], rejected)[:4]))
    return accepted, candidates


def _recovered_tokens(picks: list[tuple], target_logits: torch.Tensor,
                      row_of: torch.Tensor | None, scale: torch.Tensor | None,
                      draft_probs: torch.Tensor | None, drafts: torch.Tensor,
                      requests: torch.Tensor, flat_ids: torch.Tensor,
                      uniforms: torch.Tensor) -> torch.Tensor:
    """The recovered token of each rejected draft, a draw from ``normalize(max(p - q, 0))``:
    ``picks``, the candidates' blocks of every rejected draft (from :func:`_verify_position`,
    in the order of ``requests`` and ``flat_ids``); ``uniforms [R, RECOVERY_DRAWS]`` their
    requests'. The first candidate ``y ~ p`` kept (with probability
    ``max(p(y) - q(y), 0) / p(y)``) wins; a draft that keeps none draws from the residual
    built from whole rows, its target row read again (see the module docstring)."""
    inside, before, threshold, block = (torch.cat(part) for part in zip(*picks, strict=True))
    candidates, p = _pick_in_blocks(inside, before, threshold, block)
    p = p.double()
    if draft_probs is None:  # q one-hot at the draft
        q = (candidates == drafts.unsqueeze(1)).double()
    else:
        q = draft_probs[flat_ids.unsqueeze(1), candidates].double()
    kept = uniforms[:, _CANDIDATES:2 * _CANDIDATES] * p < p - q
    tokens = candidates.gather(1, kept.int().argmax(dim=1, keepdim=True)).squeeze(1)
    refused = (~kept.any(dim=1)).nonzero().squeeze(1)
    if refused.numel():
        rows = flat_ids[refused] if row_of is None else row_of[flat_ids[refused]]
        probs = _target_probs(target_logits, rows,
                              None if scale is None else scale[requests[refused]],
                              target_logits.new_empty(refused.numel(), target_logits.shape[1],
                                                      dtype=torch.float32))
        q_rows = None
        if draft_probs is not None:
            q_rows = draft_probs.index_select(0, flat_ids[refused]).float()
        tokens[refused] = _sample_residual(probs, q_rows, drafts[refused],
                                           uniforms[refused, -1])
    return tokens


def rejection_sample_from_logits_reference(out: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                           draft_token_ids: torch.Tensor,
                                           draft_probs: torch.Tensor | None,
                                           target_logits: torch.Tensor,
                                           bonus_token_ids: torch.Tensor,
                                           uniform_probs: torch.Tensor,
                                           recovery_uniform: torch.Tensor,
                                           is_greedy: torch.Tensor | None,
                                           target_rows: torch.Tensor | None = None,
                                           temperature: torch.Tensor | None = None
                                           ) -> torch.Tensor:
    width = out.shape[1]
    tokens = draft_token_ids.shape[0]
    counts, real, flat = _positions(cu_num_draft_tokens, tokens, width - 1)
    random_rows = None if is_greedy is None else ~is_greedy
    emitted = torch.zeros_like(flat)
    accepted = torch.zeros_like(counts)
    if tokens == 0:
        return _write_rows(out, random_rows, emitted, counts, counts, bonus_token_ids)
    drafts = draft_token_ids.long()
    uniforms = uniform_probs.double()
    recovery = recovery_uniform.double()
    scale = None if temperature is None else 1.0 / temperature.float()
    row_of = None if target_rows is None else target_rows.long()
    vocab = target_logits.shape[1]
    at_a_time = max(1, min(_CHUNK_ELEMENTS // max(vocab, 1), out.shape[0]))
    buffer = torch.empty(at_a_time, vocab, device=target_logits.device)
    rejections = []  # per position: the requests that rejected, their flat ids, candidates
    # Requests still verifying: the first position of every random request with drafts;
    # from there on, only those that accepted every earlier draft.
    alive = real[:, 0] if random_rows is None else real[:, 0] & random_rows
    for position in range(width - 1):
        requests = alive.nonzero().squeeze(1)
        if requests.numel() == 0:
            break
        flat_ids = flat[requests, position]
        accept, picks = _verify_position(
            target_logits, flat_ids if row_of is None else row_of[flat_ids],
            None if scale is None else scale[requests], drafts[flat_ids], draft_probs,
            flat_ids, uniforms[flat_ids], recovery[requests, :_CANDIDATES], buffer)
        emitted[requests, position] = drafts[flat_ids]
        accepted[requests] += accept.long()
        for rejected, blocks in picks:
            rejections.append((requests[rejected], flat_ids[rejected], blocks))
        alive = torch.zeros_like(alive)
        if position + 1 < width - 1:
            alive[requests] = accept & real[requests, position + 1]
    if rejections:
        requests, flat_ids, picks = zip(*rejections, strict=True)
        requests, flat_ids = torch.cat(requests), torch.cat(flat_ids)
        # A request's first rejection is at the position of its accepted count.
        emitted[requests, accepted[requests]] = _recovered_tokens(
            list(picks), target_logits, row_of, scale, draft_probs, drafts[flat_ids],
            requests, flat_ids, recovery[requests])
    return _write_rows(out, random_rows, emitted, counts, accepted, bonus_token_ids)


def rejection_sample_from_logits(cu_num_draft_tokens: torch.Tensor,
                                 draft_token_ids: torch.Tensor,
                                 draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                                 bonus_token_ids: torch.Tensor, uniform_probs: torch.Tensor,
                                 recovery_uniform: torch.Tensor, max_spec_len: int,
                                 is_greedy: torch.Tensor | None = None, *,
                                 target_rows: torch.Tensor | None = None,
                                 temperature: torch.Tensor | None = None,
                                 out: torch.Tensor | None = None,
                                 backend: str | None = None) -> torch.Tensor:
    """Random verification from the target's logits (see the module docstring).

    ``target_logits [N, V]`` (after top-k / top-p, and after temperature unless
    ``temperature`` is given; ``p`` is their softmax), ``draft_probs [N, V]`` or None
    (``q = 1``, argmax drafts), ``uniform_probs [N]``,
    ``recovery_uniform [B, RECOVERY_DRAWS]`` (:func:`generate_recovery_uniforms`).
    ``target_rows [N]``: the row of ``target_logits`` that holds each draft token's logits,
    when it holds other rows too (the runner's whole logits, bonus rows included: no copy
    of the draft rows is made). ``temperature [B]``: each request's, to divide its rows by
    on the way (the logits are not changed). Rows with ``is_greedy`` True are left alone;
    ``out`` as in :func:`ascend_kernels.rejection.rejection_greedy_sample`.
    """
    op = "rejection_sample_from_logits"
    batch, tokens = _check_layout(op, cu_num_draft_tokens, draft_token_ids, max_spec_len)
    if target_rows is None:
        vocab = _check_probs(op, "target_logits", target_logits, tokens, None)
    else:
        require_float(op, "target_logits", target_logits)
        if target_logits.dim() != 2:
            raise ValueError(f"{op}: target_logits has shape {tuple(target_logits.shape)}; "
                             "it must be (rows, vocab)")
        _require_int(op, "target_rows", target_rows, 1)
        _require_shape(op, "target_rows", target_rows, (tokens,), "one per draft token")
        vocab = target_logits.shape[1]
    if draft_probs is not None:
        _check_probs(op, "draft_probs", draft_probs, tokens, vocab)
    if temperature is not None:
        require_float(op, "temperature", temperature)
        _require_shape(op, "temperature", temperature, (batch,), "one per request")
        if is_greedy is None and bool((temperature <= 0).any()):
            raise ValueError(f"{op}: temperature has values <= 0 "
                             f"({temperature[temperature <= 0].tolist()[:4]}) for requests "
                             "not marked greedy; give is_greedy for them, or a positive "
                             "temperature")
        temperature = torch.where(temperature > 0, temperature, 1.0)
    _require_noise(op, "uniform_probs", uniform_probs, "float64 (as vLLM) or float32")
    _require_shape(op, "uniform_probs", uniform_probs, (tokens,), "one per draft token")
    _require_noise(op, "recovery_uniform", recovery_uniform, "float64 or float32")
    _require_shape(op, "recovery_uniform", recovery_uniform, (batch, RECOVERY_DRAWS),
                   f"{RECOVERY_DRAWS} per request, from generate_recovery_uniforms")
    bonus = _check_bonus_and_greedy(op, bonus_token_ids, is_greedy, batch)
    out = _check_out(op, out, batch, max_spec_len, draft_token_ids.device)
    resolve_backend(op, target_logits, (REFERENCE,), backend)
    if batch == 0:
        return out
    return rejection_sample_from_logits_reference(out, cu_num_draft_tokens, draft_token_ids,
                                                  draft_probs, target_logits, bonus,
                                                  uniform_probs, recovery_uniform, is_greedy,
                                                  target_rows, temperature)
