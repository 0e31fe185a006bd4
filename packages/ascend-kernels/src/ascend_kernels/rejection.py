"""Rejection-sampling kernels of speculative decoding (vLLM v1's ``rejection_sampler``).

Layout (ragged, as vLLM's ``SpecDecodeMetadata``): request ``b`` of ``B`` owns draft
tokens ``[cu_num_draft_tokens[b-1], cu_num_draft_tokens[b])`` of the ``N`` flattened
ones (``cu_num_draft_tokens`` is the inclusive cumulative count, ``[B]``). Outputs are
``output_token_ids [B, max_spec_len + 1]`` int32: the accepted draft tokens, then one more
token (the correction at the first rejection, or the bonus token when every draft was
accepted), then ``PLACEHOLDER_TOKEN_ID`` (-1).

Randomness is supplied by the caller, never drawn inside the ops, so that every backend
returns the same tokens for the same inputs:

- ``uniform_probs [N]`` (float64 like vLLM, or float32): one uniform draw per draft
  token, from :func:`generate_uniform_probs`;
- ``inv_q [B, V]``: the reciprocal of Exp(1) noise, one row per request and shared by its
  positions (as vLLM draws it), from :func:`generate_recovery_noise`. ``argmax(prob *
  inv_q)`` is a sample from ``prob / sum(prob)`` (the exponential race: ``E_i / prob_i``
  is exponential with rate ``prob_i``, and the smallest of them falls on ``i`` with
  probability ``prob_i / sum(prob)``).

Both generators draw from the device's default generator and overwrite the rows of
requests that carry their own ``torch.Generator`` (per-request seeds), so a seeded
request's draws do not depend on the rest of the batch.

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| rejection_greedy_sample | yes | yes | none |
| rejection_random_sample | yes | yes | none |
| sample_recovered_tokens | yes | yes | none |
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ascend_kernels.dispatch import REFERENCE, TRITON, require_float, resolve_backend

PLACEHOLDER_TOKEN_ID = -1
_INT_DTYPES = (torch.int32, torch.int64)


# --- randomness ---------------------------------------------------------------------------


def generate_uniform_probs(num_draft_tokens: Sequence[int],
                           generators: Mapping[int, torch.Generator] | None = None,
                           device: torch.device | str = "cpu",
                           dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``[N]`` uniform draws in [0, 1), one per draft token; request ``i`` in
    ``generators`` draws its ``num_draft_tokens[i]`` values from its own generator.

    float64 by default, as vLLM: float32 draws hit exactly 0.0 often enough to matter.
    """
    counts = [int(n) for n in num_draft_tokens]
    probs = torch.rand(sum(counts), dtype=dtype, device=device)
    start = 0
    for request, count in enumerate(counts):
        generator = (generators or {}).get(request)
        if generator is not None and count:
            probs[start:start + count].uniform_(generator=generator)
        start += count
    return probs


def generate_recovery_noise(num_draft_tokens: Sequence[int], vocab_size: int,
                            generators: Mapping[int, torch.Generator] | None = None,
                            device: torch.device | str = "cpu",
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``inv_q [B, V]``: ``1 / Exp(1)`` noise for :func:`sample_recovered_tokens`.

    Request ``i`` in ``generators`` draws its row from its own generator, and only when it
    has draft tokens (so a seeded request without drafts consumes nothing), as vLLM does.
    """
    noise = torch.empty(len(num_draft_tokens), vocab_size, dtype=dtype, device=device)
    noise.exponential_()
    for request, generator in (generators or {}).items():
        if num_draft_tokens[request] > 0:
            noise[request].exponential_(generator=generator)
    return noise.reciprocal_()


# --- checks -------------------------------------------------------------------------------


def _require_int(op: str, name: str, tensor: object, dims: int) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in _INT_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {tensor.dtype}; use int32 or int64")
    if tensor.dim() != dims:
        raise ValueError(f"{op}: {name} must be {dims}-D, got shape {tuple(tensor.shape)}")


def _require_shape(op: str, name: str, tensor: torch.Tensor, shape: tuple[int, ...],
                   says: str) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)}; it must be {shape} "
                         f"({says})")


def _check_layout(op: str, cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                  max_spec_len: int | None) -> tuple[int, int]:
    _require_int(op, "cu_num_draft_tokens", cu_num_draft_tokens, 1)
    _require_int(op, "draft_token_ids", draft_token_ids, 1)
    batch, tokens = cu_num_draft_tokens.shape[0], draft_token_ids.shape[0]
    if cu_num_draft_tokens.device != draft_token_ids.device:
        raise ValueError(f"{op}: cu_num_draft_tokens is on {cu_num_draft_tokens.device} but "
                         f"draft_token_ids on {draft_token_ids.device}; use one device")
    if max_spec_len is not None and (isinstance(max_spec_len, bool)
                                     or not isinstance(max_spec_len, int) or max_spec_len < 0):
        raise ValueError(f"{op}: max_spec_len must be an int >= 0, got {max_spec_len!r}")
    if cu_num_draft_tokens.device.type == "cpu":
        counts = torch.diff(cu_num_draft_tokens, prepend=cu_num_draft_tokens.new_zeros(1))
        if batch and (counts < 0).any():
            raise ValueError(f"{op}: cu_num_draft_tokens must be non-decreasing and >= 0 (an "
                             f"inclusive cumulative count), got "
                             f"{cu_num_draft_tokens[:8].tolist()}")
        last = int(cu_num_draft_tokens[-1]) if batch else 0
        if last != tokens:
            raise ValueError(f"{op}: cu_num_draft_tokens ends at {last} but there are {tokens} "
                             "draft tokens; its last entry must be the number of draft tokens")
        if max_spec_len is not None and batch and int(counts.max()) > max_spec_len:
            raise ValueError(f"{op}: a request has {int(counts.max())} draft tokens but "
                             f"max_spec_len={max_spec_len}; max_spec_len must be at least the "
                             "longest draft")
    return batch, tokens


def _check_bonus_and_greedy(op: str, bonus_token_ids: torch.Tensor,
                            is_greedy: torch.Tensor | None, batch: int) -> torch.Tensor:
    if not isinstance(bonus_token_ids, torch.Tensor) or bonus_token_ids.dtype not in _INT_DTYPES:
        raise TypeError(f"{op}: bonus_token_ids must be an int32 or int64 tensor, got "
                        f"{getattr(bonus_token_ids, 'dtype', type(bonus_token_ids).__name__)}")
    if tuple(bonus_token_ids.shape) not in ((batch,), (batch, 1)):
        raise ValueError(f"{op}: bonus_token_ids has shape {tuple(bonus_token_ids.shape)}; it "
                         f"must be ({batch},) or ({batch}, 1), one token per request")
    if is_greedy is not None:
        if not isinstance(is_greedy, torch.Tensor) or is_greedy.dtype != torch.bool:
            raise TypeError(f"{op}: is_greedy must be a bool tensor or None, got "
                            f"{getattr(is_greedy, 'dtype', type(is_greedy).__name__)}")
        _require_shape(op, "is_greedy", is_greedy, (batch,), "one flag per request")
    return bonus_token_ids.reshape(batch)


def _check_out(op: str, out: torch.Tensor | None, batch: int, max_spec_len: int,
               device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                          device=device)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.int32:
        raise TypeError(f"{op}: out must be an int32 tensor, got "
                        f"{getattr(out, 'dtype', type(out).__name__)}")
    _require_shape(op, "out", out, (batch, max_spec_len + 1), "[batch, max_spec_len + 1]")
    if not out.is_contiguous():
        raise ValueError(f"{op}: out must be contiguous")
    return out


def _require_noise(op: str, name: str, tensor: object, allowed: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"{op}: {name} has dtype {tensor.dtype}; use {allowed}")


def _check_probs(op: str, name: str, probs: torch.Tensor, tokens: int,
                 vocab: int | None) -> int:
    require_float(op, name, probs)
    if probs.dim() != 2 or probs.shape[0] != tokens or (vocab is not None
                                                        and probs.shape[1] != vocab):
        want = f"({tokens}, {vocab if vocab is not None else 'vocab'})"
        raise ValueError(f"{op}: {name} has shape {tuple(probs.shape)}; it must be {want}, "
                         "one row per draft token")
    return probs.shape[1]


# --- layout helpers -----------------------------------------------------------------------


def _positions(cu_num_draft_tokens: torch.Tensor, tokens: int, width: int):
    """Per request: draft count ``[B]``, a ``[B, width]`` mask of real positions and the
    flat token index of each (clamped to stay in range where the mask is False)."""
    cu = cu_num_draft_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    starts = cu - counts
    pos = torch.arange(width, device=cu.device)
    real = pos.unsqueeze(0) < counts.unsqueeze(1)
    flat = (starts.unsqueeze(1) + pos.unsqueeze(0)).clamp(max=max(tokens - 1, 0))
    return counts, real, flat


def _leading_true(flags: torch.Tensor) -> torch.Tensor:
    """How many leading entries of each row are True."""
    return flags.int().cumprod(dim=1).sum(dim=1)


def _write_rows(out: torch.Tensor, rows: torch.Tensor | None, tokens: torch.Tensor,
                counts: torch.Tensor, accepted: torch.Tensor,
                bonus: torch.Tensor) -> torch.Tensor:
    """Fill each selected row: ``tokens`` up to and including position ``accepted`` (the
    first rejection), or the bonus token at ``counts`` when all were accepted."""
    width = out.shape[1]
    pos = torch.arange(width, device=out.device).unsqueeze(0)
    padded = torch.cat([tokens, tokens.new_zeros(tokens.shape[0], 1)], dim=1)[:, :width]
    padded = torch.where(pos == counts.unsqueeze(1), bonus.unsqueeze(1).to(padded.dtype), padded)
    row = torch.where(pos <= accepted.unsqueeze(1), padded, PLACEHOLDER_TOKEN_ID).to(torch.int32)
    if rows is None:
        out.copy_(row)
    else:
        out[rows] = row[rows]
    return out


# --- greedy -------------------------------------------------------------------------------


def rejection_greedy_sample_reference(out: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                      draft_token_ids: torch.Tensor,
                                      target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor,
                                      is_greedy: torch.Tensor | None) -> torch.Tensor:
    width = out.shape[1]
    tokens = draft_token_ids.shape[0]
    counts, real, flat = _positions(cu_num_draft_tokens, tokens, width - 1)
    if tokens:
        target = torch.where(real, target_argmax.long()[flat], 0)
        matches = real & (draft_token_ids.long()[flat] == target)
    else:
        target = torch.zeros_like(flat)
        matches = real
    accepted = _leading_true(matches)
    return _write_rows(out, is_greedy, target, counts, accepted, bonus_token_ids)


def rejection_greedy_sample(cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                            target_argmax: torch.Tensor, bonus_token_ids: torch.Tensor,
                            max_spec_len: int, is_greedy: torch.Tensor | None = None, *,
                            out: torch.Tensor | None = None,
                            backend: str | None = None) -> torch.Tensor:
    """Greedy verification: each position emits the target's argmax, and verification
    stops after the first position where the draft differs from it; when every draft
    matched, the bonus token follows.

    ``target_argmax [N]``; ``bonus_token_ids [B]`` or ``[B, 1]``; ``is_greedy [B]`` bool
    selects the rows to fill (None: all). ``out`` ``[B, max_spec_len + 1]`` int32 is
    filled in place when given (rows not selected are left as they are, so the greedy and
    the random pass can share one buffer); otherwise a new one is returned.
    """
    op = "rejection_greedy_sample"
    batch, tokens = _check_layout(op, cu_num_draft_tokens, draft_token_ids, max_spec_len)
    _require_int(op, "target_argmax", target_argmax, 1)
    _require_shape(op, "target_argmax", target_argmax, (tokens,), "one per draft token")
    bonus = _check_bonus_and_greedy(op, bonus_token_ids, is_greedy, batch)
    out = _check_out(op, out, batch, max_spec_len, draft_token_ids.device)
    chosen = resolve_backend(op, draft_token_ids, (REFERENCE, TRITON), backend)
    if batch == 0:
        return out
    if chosen == TRITON:
        from ascend_kernels.triton_kernels.rejection import rejection_greedy_sample_triton

        return rejection_greedy_sample_triton(out, cu_num_draft_tokens, draft_token_ids,
                                              target_argmax, bonus, is_greedy)
    return rejection_greedy_sample_reference(out, cu_num_draft_tokens, draft_token_ids,
                                             target_argmax, bonus, is_greedy)


# --- random -------------------------------------------------------------------------------


def rejection_random_sample_reference(out: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                      draft_token_ids: torch.Tensor,
                                      draft_probs: torch.Tensor | None,
                                      target_probs: torch.Tensor, bonus_token_ids: torch.Tensor,
                                      recovered_token_ids: torch.Tensor,
                                      uniform_probs: torch.Tensor,
                                      is_greedy: torch.Tensor | None) -> torch.Tensor:
    width = out.shape[1]
    tokens = draft_token_ids.shape[0]
    counts, real, flat = _positions(cu_num_draft_tokens, tokens, width - 1)
    if tokens:
        drafts = draft_token_ids.long()
        vocab_ids = drafts.clamp(min=0)  # -1 marks a padded draft, rejected below
        rows = torch.arange(tokens, device=drafts.device)
        target_p = target_probs[rows, vocab_ids].float()
        if draft_probs is None:
            accept = target_p >= uniform_probs  # q = 1 for argmax drafts
        else:
            draft_p = draft_probs[rows, vocab_ids].float()
            ratio = target_p / torch.where(draft_p > 0, draft_p, 1.0)
            accept = (draft_p > 0) & (ratio >= uniform_probs)
        accept &= drafts >= 0
        accepted = _leading_true(real & accept[flat])
        emitted = torch.where(real, drafts[flat], 0)
        recovered = recovered_token_ids.long()[flat]
        pos = torch.arange(width - 1, device=drafts.device).unsqueeze(0)
        emitted = torch.where(pos < accepted.unsqueeze(1), emitted, recovered)
    else:
        accepted = counts
        emitted = torch.zeros_like(flat)
    rows_to_fill = None if is_greedy is None else ~is_greedy
    return _write_rows(out, rows_to_fill, emitted, counts, accepted, bonus_token_ids)


def rejection_random_sample(cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                            draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                            bonus_token_ids: torch.Tensor, recovered_token_ids: torch.Tensor,
                            uniform_probs: torch.Tensor, max_spec_len: int,
                            is_greedy: torch.Tensor | None = None, *,
                            out: torch.Tensor | None = None,
                            backend: str | None = None) -> torch.Tensor:
    """Random verification: draft token ``x`` at a position is accepted when
    ``uniform <= p(x) / q(x)`` (``p`` the target, ``q`` the draft probabilities; ``q = 1``
    when ``draft_probs`` is None, for argmax drafts; ``q(x) = 0`` and padded drafts
    ``x = -1`` reject). The first rejected position emits ``recovered_token_ids`` there
    (see :func:`sample_recovered_tokens`); when all are accepted the bonus token follows.

    ``draft_probs`` / ``target_probs`` ``[N, V]`` (compared in float32), ``uniform_probs
    [N]``, ``recovered_token_ids [N]``. Rows with ``is_greedy`` True are left alone (None:
    every row is random). ``out`` as in :func:`rejection_greedy_sample`.
    """
    op = "rejection_random_sample"
    batch, tokens = _check_layout(op, cu_num_draft_tokens, draft_token_ids, max_spec_len)
    vocab = _check_probs(op, "target_probs", target_probs, tokens, None)
    if draft_probs is not None:
        _check_probs(op, "draft_probs", draft_probs, tokens, vocab)
    _require_int(op, "recovered_token_ids", recovered_token_ids, 1)
    _require_shape(op, "recovered_token_ids", recovered_token_ids, (tokens,),
                   "one per draft token")
    _require_noise(op, "uniform_probs", uniform_probs, "float64 (as vLLM) or float32")
    _require_shape(op, "uniform_probs", uniform_probs, (tokens,), "one per draft token")
    bonus = _check_bonus_and_greedy(op, bonus_token_ids, is_greedy, batch)
    out = _check_out(op, out, batch, max_spec_len, draft_token_ids.device)
    chosen = resolve_backend(op, target_probs, (REFERENCE, TRITON), backend)
    if batch == 0:
        return out
    if chosen == TRITON:
        from ascend_kernels.triton_kernels.rejection import rejection_random_sample_triton

        return rejection_random_sample_triton(out, cu_num_draft_tokens, draft_token_ids,
                                              draft_probs, target_probs, bonus,
                                              recovered_token_ids, uniform_probs, is_greedy)
    return rejection_random_sample_reference(out, cu_num_draft_tokens, draft_token_ids,
                                             draft_probs, target_probs, bonus,
                                             recovered_token_ids, uniform_probs, is_greedy)


# --- recovered tokens ---------------------------------------------------------------------


def request_of_token(cu_num_draft_tokens: torch.Tensor, tokens: int) -> torch.Tensor:
    """``[N]`` index of the request each draft token belongs to."""
    cu = cu_num_draft_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    return torch.repeat_interleave(torch.arange(cu.shape[0], device=cu.device), counts,
                                   output_size=tokens)


def sample_recovered_tokens_reference(cu_num_draft_tokens: torch.Tensor,
                                      draft_token_ids: torch.Tensor,
                                      draft_probs: torch.Tensor | None,
                                      target_probs: torch.Tensor,
                                      inv_q: torch.Tensor) -> torch.Tensor:
    tokens = draft_token_ids.shape[0]
    target = target_probs.float()
    if draft_probs is None:
        # max(p - onehot(draft), 0): the draft token's probability drops to 0.
        vocab_ids = torch.arange(target.shape[1], device=target.device)
        prob = torch.where(vocab_ids.unsqueeze(0) == draft_token_ids.long().unsqueeze(1), 0.0,
                           target)
    else:
        prob = (target - draft_probs.float()).clamp(min=0.0)
    scores = prob * inv_q[request_of_token(cu_num_draft_tokens, tokens)]
    return scores.argmax(dim=1).to(torch.int32)


def sample_recovered_tokens(cu_num_draft_tokens: torch.Tensor, draft_token_ids: torch.Tensor,
                            draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                            inv_q: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """The token each position emits if its draft is rejected: a sample from
    ``normalize(max(p - q, 0))`` (``q`` one-hot at the draft token when ``draft_probs`` is
    None), drawn as ``argmax(max(p - q, 0) * inv_q[request])``; the first maximum wins.

    Returns ``[N]`` int32. ``inv_q [B, V]`` (float32, or float64 as vLLM's fp64 Gumbel
    option) comes from :func:`generate_recovery_noise`.
    """
    op = "sample_recovered_tokens"
    batch, tokens = _check_layout(op, cu_num_draft_tokens, draft_token_ids, None)
    vocab = _check_probs(op, "target_probs", target_probs, tokens, None)
    if draft_probs is not None:
        _check_probs(op, "draft_probs", draft_probs, tokens, vocab)
    _require_noise(op, "inv_q", inv_q, "float32 or float64")
    _require_shape(op, "inv_q", inv_q, (batch, vocab), "one noise row per request")
    chosen = resolve_backend(op, target_probs, (REFERENCE, TRITON), backend)
    if tokens == 0:
        return torch.empty(0, dtype=torch.int32, device=draft_token_ids.device)
    if chosen == TRITON:
        from ascend_kernels.triton_kernels.rejection import sample_recovered_tokens_triton

        return sample_recovered_tokens_triton(cu_num_draft_tokens, draft_token_ids,
                                              draft_probs, target_probs, inv_q)
    return sample_recovered_tokens_reference(cu_num_draft_tokens, draft_token_ids, draft_probs,
                                             target_probs, inv_q)
