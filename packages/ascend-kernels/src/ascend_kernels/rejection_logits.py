"""Random rejection sampling straight from the target's logits, for the CPU.

The same verification as :func:`ascend_kernels.rejection.rejection_random_sample` with
:func:`~ascend_kernels.rejection.sample_recovered_tokens` (accept draft ``x`` when
``u <= p(x) / q(x)``, at the first rejection emit a sample of ``normalize(max(p - q, 0))``,
bonus token when all are accepted), arranged so that a CPU reads as little of the ``[N, V]``
target as the outcome allows:

- position by position: a row is read only if every earlier draft of its request was
  accepted (the rows after a request's first rejection never matter);
- each read row is turned into ``p`` a few rows at a time, in a small buffer that stays in
  cache, with the temperature applied on the way when the caller has not applied it;
- at a rejection the residual ``max(p - q, 0)`` is built from those rows while they are
  still in cache (in place for the whole chunk when most of it was rejected, from a copy of
  the rejected rows otherwise), and its token drawn by inverse CDF from one uniform per
  request (block sums, then a running sum inside one block, and binary searches), instead
  of ``[B, V]`` exponential noise, which costs more to draw on a CPU than the target costs
  to read.

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
# Target logits turned into probabilities at a time: about 8 MB (13 rows of a 150k
# vocabulary, 64 of a 32k one) stay in cache from the softmax to the residual, and the
# per-chunk work is spread over enough rows to cost little (of 2, 4, 8 and 16 MB, 8 MB was the
# quickest on a 2-core EPYC at batch 64, k = 4).
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
    # Block sums in the weights' own precision (a float64 copy of the rows would cost more
    # than the draw); the running sums over them in float64.
    block_cdf = padded.sum(dim=2).double().cumsum(dim=1)
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
                     drafts: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [R, V]`` (changed in place), from
    ``normalize(max(p - q, 0))``; ``draft_probs`` are the rows' ``q`` (None: one-hot at
    ``drafts``)."""
    if draft_probs is None:
        probs.scatter_(1, drafts.unsqueeze(1), 0.0)  # q is one-hot at the draft token
    else:
        probs.sub_(draft_probs).clamp_(min=0.0)
    picked, total = _inverse_cdf(probs, uniforms)
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


def _verify_position(target_logits: torch.Tensor, rows: torch.Tensor,
                     scale: torch.Tensor | None, drafts: torch.Tensor,
                     draft_probs: torch.Tensor | None, draft_rows: torch.Tensor,
                     uniforms: torch.Tensor, recovery_uniform: torch.Tensor,
                     buffers: tuple[torch.Tensor, torch.Tensor]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one draft token of each of ``R`` requests: ``rows [R]`` their rows of
    ``target_logits``, ``scale [R]`` what to multiply them by first (None: nothing),
    ``drafts [R]`` (-1: padding, rejected), ``draft_rows [R]`` their rows of ``draft_probs``,
    ``uniforms [R]`` and ``recovery_uniform [R]``; ``buffers``: two float32 ``[rows, V]``
    tensors to work in, ``rows`` at a time. Returns whether each was accepted and the
    recovered token where it was not (anything where it was)."""
    vocab_ids = drafts.clamp(min=0)
    accepted = torch.empty(rows.shape[0], dtype=torch.bool, device=rows.device)
    recovered = torch.zeros_like(vocab_ids)
    at_a_time = buffers[0].shape[0]
    for start in range(0, rows.shape[0], at_a_time):
        part = slice(start, start + at_a_time)
        count = rows[part].shape[0]
        logits, probs = (buffer[:count] for buffer in buffers)
        _read_rows(target_logits, rows[part], logits)
        if scale is not None:
            logits.mul_(scale[part].unsqueeze(1))
        torch.softmax(logits, dim=-1, out=probs)
        target_p = probs.gather(1, vocab_ids[part].unsqueeze(1)).squeeze(1)
        if draft_probs is None:
            accept = target_p >= uniforms[part]  # q = 1 for argmax drafts
        else:
            draft_p = draft_probs[draft_rows[part], vocab_ids[part]].float()
            accept = (draft_p > 0) & (target_p / torch.where(draft_p > 0, draft_p, 1.0)
                                      >= uniforms[part])
        accept &= drafts[part] >= 0
        accepted[part] = accept
        rejected = (~accept).nonzero().squeeze(1)
        rejections = rejected.numel()
        if rejections == 0:
            continue
        if 2 * rejections >= count:
            # Most rows rejected: build the residual of every row of the chunk in place (an
            # accepted row's draw is ignored), cheaper than gathering the rejected ones.
            q_rows = None
            if draft_probs is not None:
                q_rows = _read_rows(draft_probs, draft_rows[part], logits)
            recovered[part] = _sample_residual(probs, q_rows, vocab_ids[part],
                                               recovery_uniform[part])
            continue
        # Few rejected: gather them, p's rows into one buffer and q's into the other.
        residual = torch.index_select(probs, 0, rejected, out=logits[:rejections])
        residual_q = None
        if draft_probs is not None:
            residual_q = _read_rows(draft_probs, draft_rows[part][rejected],
                                    probs[:rejections])
        recovered[start + rejected] = _sample_residual(
            residual, residual_q, vocab_ids[part][rejected], recovery_uniform[part][rejected])
    return accepted, recovered


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
    vocab = target_logits.shape[1]
    at_a_time = max(1, min(_CHUNK_ELEMENTS // max(vocab, 1), out.shape[0]))
    buffers = tuple(torch.empty(at_a_time, vocab, device=target_logits.device)
                    for _ in range(2))
    # Requests still verifying: the first position of every random request with drafts;
    # from there on, only those that accepted every earlier draft.
    alive = real[:, 0] if random_rows is None else real[:, 0] & random_rows
    for position in range(width - 1):
        requests = alive.nonzero().squeeze(1)
        if requests.numel() == 0:
            break
        flat_ids = flat[requests, position]
        rows = flat_ids if target_rows is None else target_rows.long()[flat_ids]
        accept, recovered = _verify_position(
            target_logits, rows, None if scale is None else scale[requests],
            drafts[flat_ids], draft_probs, flat_ids, uniforms[flat_ids],
            recovery[requests], buffers)
        emitted[requests, position] = torch.where(accept, drafts[flat_ids], recovered)
        accepted[requests] += accept.long()
        alive = torch.zeros_like(alive)
        if position + 1 < width - 1:
            alive[requests] = accept & real[requests, position + 1]
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
    (``q = 1``, argmax drafts), ``uniform_probs [N]``, ``recovery_uniform [B]``.
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
    _require_shape(op, "recovery_uniform", recovery_uniform, (batch,), "one per request")
    bonus = _check_bonus_and_greedy(op, bonus_token_ids, is_greedy, batch)
    out = _check_out(op, out, batch, max_spec_len, draft_token_ids.device)
    resolve_backend(op, target_logits, (REFERENCE,), backend)
    if batch == 0:
        return out
    return rejection_sample_from_logits_reference(out, cu_num_draft_tokens, draft_token_ids,
                                                  draft_probs, target_logits, bonus,
                                                  uniform_probs, recovery_uniform, is_greedy,
                                                  target_rows, temperature)
