"""Triton kernels for rejection sampling.

Verification runs one program per request and handles all of its positions at once: a
request has at most ``max_spec_len`` drafts, so its positions fit one block, and the
first rejection is the smallest rejected position (a ``tl.min``), with no sequential
loop. Recovered tokens run one program per draft token, sweeping the vocabulary in
blocks and keeping the first maximum of ``prob * inv_q``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_kernels.rejection import PLACEHOLDER_TOKEN_ID, request_of_token
from ascend_kernels.triton_kernels import next_power_of_2

_VOCAB_BLOCK = 4096


@triton.jit
def _request_span(cu_ptr, request):
    start = tl.load(cu_ptr + request - 1, mask=request > 0, other=0).to(tl.int64)
    end = tl.load(cu_ptr + request).to(tl.int64)
    return start, end - start


@triton.jit
def _write_row(out_ptr, request, width, tokens, count, accepted, bonus, enabled,
               PLACEHOLDER: tl.constexpr, BLOCK: tl.constexpr):
    """Positions < ``accepted`` and the first rejection take ``tokens``; position
    ``count`` takes the bonus when all were accepted; the rest are placeholders."""
    pos = tl.arange(0, BLOCK)
    row = tl.where(pos == count, bonus, tokens)
    row = tl.where(pos <= accepted, row, PLACEHOLDER)
    # A scalar folded into the bound, not and-ed with the mask: Triton's interpreter turns
    # (block & scalar bool) into int32, which tl.store rejects as a mask.
    writable = tl.where(enabled, width, 0)
    tl.store(out_ptr + request * width + pos, row.to(tl.int32), mask=pos < writable)


@triton.jit
def _greedy_kernel(out_ptr, cu_ptr, draft_ptr, target_argmax_ptr, bonus_ptr, is_greedy_ptr,
                   width, HAS_IS_GREEDY: tl.constexpr, PLACEHOLDER: tl.constexpr,
                   BLOCK: tl.constexpr):
    request = tl.program_id(0).to(tl.int64)
    start, count = _request_span(cu_ptr, request)
    pos = tl.arange(0, BLOCK)
    real = pos < count
    draft = tl.load(draft_ptr + start + pos, mask=real, other=-1).to(tl.int64)
    target = tl.load(target_argmax_ptr + start + pos, mask=real, other=0).to(tl.int64)
    accepted = tl.min(tl.where(real & (draft != target), pos, count), axis=0)
    bonus = tl.load(bonus_ptr + request).to(tl.int64)
    enabled = True
    if HAS_IS_GREEDY:
        enabled = tl.load(is_greedy_ptr + request) != 0
    _write_row(out_ptr, request, width, target, count, accepted, bonus, enabled,
               PLACEHOLDER, BLOCK)


@triton.jit
def _random_kernel(out_ptr, cu_ptr, draft_ptr, draft_probs_ptr, target_probs_ptr, bonus_ptr,
                   recovered_ptr, uniform_ptr, is_greedy_ptr, width, draft_probs_stride,
                   target_probs_stride, HAS_DRAFT_PROBS: tl.constexpr,
                   HAS_IS_GREEDY: tl.constexpr, PLACEHOLDER: tl.constexpr,
                   BLOCK: tl.constexpr):
    request = tl.program_id(0).to(tl.int64)
    start, count = _request_span(cu_ptr, request)
    pos = tl.arange(0, BLOCK)
    real = pos < count
    token = start + pos
    draft = tl.load(draft_ptr + token, mask=real, other=-1).to(tl.int64)
    vocab_id = tl.where(draft >= 0, draft, 0)  # -1 marks a padded draft, rejected below
    uniform = tl.load(uniform_ptr + token, mask=real, other=1.0)
    target_p = tl.load(target_probs_ptr + token * target_probs_stride + vocab_id, mask=real,
                       other=0.0).to(tl.float32)
    if HAS_DRAFT_PROBS:
        draft_p = tl.load(draft_probs_ptr + token * draft_probs_stride + vocab_id, mask=real,
                          other=0.0).to(tl.float32)
        ratio = target_p / tl.where(draft_p > 0, draft_p, 1.0)
        accept = (draft_p > 0) & (ratio >= uniform)
    else:
        accept = target_p >= uniform
    accept = accept & (draft >= 0)
    accepted = tl.min(tl.where(real & (accept == 0), pos, count), axis=0)
    recovered = tl.load(recovered_ptr + token, mask=real, other=0).to(tl.int64)
    tokens = tl.where(pos < accepted, draft, recovered)
    bonus = tl.load(bonus_ptr + request).to(tl.int64)
    enabled = True
    if HAS_IS_GREEDY:
        enabled = tl.load(is_greedy_ptr + request) == 0
    _write_row(out_ptr, request, width, tokens, count, accepted, bonus, enabled,
               PLACEHOLDER, BLOCK)


@triton.jit
def _recovered_kernel(out_ptr, request_ptr, draft_ptr, draft_probs_ptr, target_probs_ptr,
                      inv_q_ptr, vocab_size, draft_probs_stride, target_probs_stride,
                      inv_q_stride, HAS_DRAFT_PROBS: tl.constexpr, FP64_NOISE: tl.constexpr,
                      BLOCK: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    request = tl.load(request_ptr + token).to(tl.int64)
    draft = tl.load(draft_ptr + token).to(tl.int64)
    if FP64_NOISE:
        best_score = tl.full([], float("-inf"), tl.float64)
    else:
        best_score = tl.full([], float("-inf"), tl.float32)
    best_id = tl.zeros([], dtype=tl.int64)
    lanes = tl.arange(0, BLOCK)
    for start in range(0, vocab_size, BLOCK):
        vocab_id = start + lanes
        inside = vocab_id < vocab_size
        target = tl.load(target_probs_ptr + token * target_probs_stride + vocab_id,
                         mask=inside, other=0.0).to(tl.float32)
        if HAS_DRAFT_PROBS:
            drafted = tl.load(draft_probs_ptr + token * draft_probs_stride + vocab_id,
                              mask=inside, other=0.0).to(tl.float32)
            prob = tl.maximum(target - drafted, 0.0)
        else:
            prob = tl.where(vocab_id == draft, 0.0, target)
        noise = tl.load(inv_q_ptr + request * inv_q_stride + vocab_id, mask=inside, other=0.0)
        score = tl.where(inside, prob * noise, float("-inf"))
        block_best = tl.max(score, axis=0)
        # Strictly greater: an earlier block keeps a tie, so the first maximum wins.
        better = block_best > best_score
        best_id = tl.where(better, start + tl.argmax(score, axis=0), best_id)
        best_score = tl.where(better, block_best, best_score)
    tl.store(out_ptr + token, best_id.to(tl.int32))


def _block_for(width: int) -> int:
    return next_power_of_2(max(width, 1))


def rejection_greedy_sample_triton(out: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                   draft_token_ids: torch.Tensor, target_argmax: torch.Tensor,
                                   bonus_token_ids: torch.Tensor,
                                   is_greedy: torch.Tensor | None) -> torch.Tensor:
    batch, width = out.shape
    _greedy_kernel[(batch,)](
        out, cu_num_draft_tokens.contiguous(), draft_token_ids.contiguous(),
        target_argmax.contiguous(), bonus_token_ids.contiguous(),
        is_greedy if is_greedy is not None else out, width,
        HAS_IS_GREEDY=is_greedy is not None, PLACEHOLDER=PLACEHOLDER_TOKEN_ID,
        BLOCK=_block_for(width),
    )
    return out


def rejection_random_sample_triton(out: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                                   draft_token_ids: torch.Tensor,
                                   draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                                   bonus_token_ids: torch.Tensor,
                                   recovered_token_ids: torch.Tensor,
                                   uniform_probs: torch.Tensor,
                                   is_greedy: torch.Tensor | None) -> torch.Tensor:
    batch, width = out.shape
    target = _unit_stride_rows(target_probs)
    drafted = _unit_stride_rows(draft_probs) if draft_probs is not None else target
    _random_kernel[(batch,)](
        out, cu_num_draft_tokens.contiguous(), draft_token_ids.contiguous(), drafted, target,
        bonus_token_ids.contiguous(), recovered_token_ids.contiguous(),
        uniform_probs.contiguous(), is_greedy if is_greedy is not None else out, width,
        drafted.stride(0), target.stride(0),
        HAS_DRAFT_PROBS=draft_probs is not None, HAS_IS_GREEDY=is_greedy is not None,
        PLACEHOLDER=PLACEHOLDER_TOKEN_ID, BLOCK=_block_for(width),
    )
    return out


def sample_recovered_tokens_triton(cu_num_draft_tokens: torch.Tensor,
                                   draft_token_ids: torch.Tensor,
                                   draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                                   inv_q: torch.Tensor) -> torch.Tensor:
    tokens = draft_token_ids.shape[0]
    vocab = target_probs.shape[1]
    target = _unit_stride_rows(target_probs)
    drafted = _unit_stride_rows(draft_probs) if draft_probs is not None else target
    noise = _unit_stride_rows(inv_q)
    out = torch.empty(tokens, dtype=torch.int32, device=draft_token_ids.device)
    _recovered_kernel[(tokens,)](
        out, request_of_token(cu_num_draft_tokens, tokens), draft_token_ids.contiguous(),
        drafted, target, noise, vocab, drafted.stride(0), target.stride(0), noise.stride(0),
        HAS_DRAFT_PROBS=draft_probs is not None, FP64_NOISE=inv_q.dtype == torch.float64,
        BLOCK=min(_VOCAB_BLOCK, next_power_of_2(vocab)),
    )
    return out


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
