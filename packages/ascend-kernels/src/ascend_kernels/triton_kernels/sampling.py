"""Triton kernels for top-k / top-p masking and for the penalties.

Top-k / top-p without sorting (Triton 3.2 has no sort we may use on Ascend): one program
per row, which finds its thresholds by bisection over an integer key that orders floats
like the floats themselves:

- top-k keeps the logits >= the k-th largest; that value is the largest key ``t`` with
  ``count(key >= t) >= k``, found in 32 halvings of the int32 key range;
- top-p drops, from the bottom, the tokens whose running probability mass stays <= 1 - p.
  The tokens dropped whole are those with key <= the largest ``t`` whose mass
  ``sum(prob[key <= t]) <= 1 - p`` (33 halvings). Of the tokens tied at the next value,
  the reference's stable sort drops the lower token ids first, as many as still fit under
  1 - p; a final pass ranks those ties by token id.

Each halving is a pass over the row, so a row is read about 70 times; that is the price
of staying within Triton 3.2's language.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ascend_kernels.triton_kernels import next_power_of_2

_BLOCK = 1024
_TIE_BLOCK = 32


@triton.jit
def _order_key(x):
    """int64 key whose order is ``x``'s float order (-0.0 counts as +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _top_k_top_p_kernel(logits_ptr, out_ptr, k_ptr, p_ptr, vocab_size, in_stride, out_stride,
                        HAS_K: tl.constexpr, HAS_P: tl.constexpr,
                        BLOCK: tl.constexpr, TIE_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    src = logits_ptr + row * in_stride
    dst = out_ptr + row * out_stride
    lanes = tl.arange(0, BLOCK)

    key_min = tl.full([], 2147483647, tl.int64)
    key_max = tl.full([], -2147483647, tl.int64)
    x_max = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab_size, BLOCK):
        idx = start + lanes
        inside = idx < vocab_size
        x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32)
        key = _order_key(x)
        key_min = tl.minimum(key_min, tl.min(tl.where(inside, key, 2147483647), axis=0))
        key_max = tl.maximum(key_max, tl.max(tl.where(inside, key, -2147483647), axis=0))
        x_max = tl.maximum(x_max, tl.max(tl.where(inside, x, float("-inf")), axis=0))

    # Top-k: tokens with key >= threshold stay.
    threshold = key_min
    if HAS_K:
        k = tl.load(k_ptr + row).to(tl.int64)
        low = key_min
        high = key_max
        for _ in range(32):
            mid = low + (high - low + 1) // 2
            count = tl.zeros([], dtype=tl.int64)
            for start in range(0, vocab_size, BLOCK):
                idx = start + lanes
                inside = idx < vocab_size
                key = _order_key(tl.load(src + idx, mask=inside, other=0.0).to(tl.float32))
                count += tl.sum(tl.where(inside & (key >= mid), 1, 0), axis=0)
            enough = count >= k
            low = tl.where(enough, mid, low)
            high = tl.where(enough, high, mid - 1)
        threshold = low

    # Top-p: every kept token with key < boundary goes, and the first `tie_drops` (by
    # token id) of those with key == boundary.
    boundary = threshold
    tie_drops = tl.zeros([], dtype=tl.int64)
    if HAS_P:
        limit = 1.0 - tl.load(p_ptr + row).to(tl.float32)
        total = tl.zeros([], dtype=tl.float32)
        for start in range(0, vocab_size, BLOCK):
            idx = start + lanes
            inside = idx < vocab_size
            x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32)
            kept = inside & (_order_key(x) >= threshold)
            total += tl.sum(tl.where(kept, tl.exp(x - x_max), 0.0), axis=0)

        low = threshold - 1
        high = key_max
        for _ in range(33):
            mid = low + (high - low + 1) // 2
            mass = tl.zeros([], dtype=tl.float32)
            for start in range(0, vocab_size, BLOCK):
                idx = start + lanes
                inside = idx < vocab_size
                x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32)
                key = _order_key(x)
                under = inside & (key >= threshold) & (key <= mid)
                mass += tl.sum(tl.where(under, tl.exp(x - x_max) / total, 0.0), axis=0)
            fits = mass <= limit
            low = tl.where(fits, mid, low)
            high = tl.where(fits, high, mid - 1)
        all_fit = low >= key_max

        boundary = tl.full([], 2147483647, tl.int64)
        for start in range(0, vocab_size, BLOCK):
            idx = start + lanes
            inside = idx < vocab_size
            key = _order_key(tl.load(src + idx, mask=inside, other=0.0).to(tl.float32))
            above = inside & (key >= threshold) & (key > low)
            boundary = tl.minimum(boundary, tl.min(tl.where(above, key, 2147483647), axis=0))
        # When everything fits under 1 - p, only the most likely token (the last of the
        # ties at the top) stays.
        boundary = tl.where(all_fit, key_max, boundary)

        mass_below = tl.zeros([], dtype=tl.float32)
        tie_prob = tl.zeros([], dtype=tl.float32)
        ties = tl.zeros([], dtype=tl.int64)
        for start in range(0, vocab_size, BLOCK):
            idx = start + lanes
            inside = idx < vocab_size
            x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32)
            key = _order_key(x)
            prob = tl.exp(x - x_max) / total
            kept = inside & (key >= threshold)
            mass_below += tl.sum(tl.where(kept & (key < boundary), prob, 0.0), axis=0)
            tie_prob = tl.maximum(tie_prob, tl.max(tl.where(kept & (key == boundary), prob,
                                                            0.0), axis=0))
            ties += tl.sum(tl.where(kept & (key == boundary), 1, 0), axis=0)
        room = (limit - mass_below) / tl.maximum(tie_prob, 1e-30)
        room = tl.minimum(tl.maximum(room, 0.0), 2147483647.0)
        tie_drops = tl.minimum(room.to(tl.int64), ties - 1)
        tie_drops = tl.where(all_fit, ties - 1, tie_drops)

    # Ties at the boundary are written by the tie pass below when some of them go.
    tie_pass = tie_drops > 0
    for start in range(0, vocab_size, BLOCK):
        idx = start + lanes
        inside = idx < vocab_size
        raw = tl.load(src + idx, mask=inside, other=0.0)
        key = _order_key(raw.to(tl.float32))
        dropped = key < boundary  # boundary >= threshold, so this covers top-k too
        tied = key == boundary
        out = tl.where(dropped, float("-inf"), raw.to(tl.float32))
        # (tied & scalar) would do, but Triton's interpreter makes int32 of a block and-ed
        # with a scalar bool, which tl.store rejects as a mask.
        held_back = tl.where(tied, tie_drops, 0) > 0
        tl.store(dst + idx, out.to(dst.dtype.element_ty), mask=inside & (held_back == 0))

    if tie_pass:
        tie_lanes = tl.arange(0, TIE_BLOCK)
        seen = tl.zeros([], dtype=tl.int64)
        for start in range(0, vocab_size, TIE_BLOCK):
            idx = start + tie_lanes
            inside = idx < vocab_size
            raw = tl.load(src + idx, mask=inside, other=0.0)
            tied = inside & (_order_key(raw.to(tl.float32)) == boundary)
            earlier = tl.sum(tl.where((tie_lanes[None, :] < tie_lanes[:, None])
                                      & tied[None, :], 1, 0), axis=1)
            dropped = seen + earlier < tie_drops
            out = tl.where(dropped, float("-inf"), raw.to(tl.float32))
            tl.store(dst + idx, out.to(dst.dtype.element_ty), mask=tied)
            seen += tl.sum(tl.where(tied, 1, 0), axis=0)


@triton.jit
def _penalties_kernel(logits_ptr, out_ptr, prompt_counts_ptr, output_counts_ptr,
                      presence_ptr, frequency_ptr, repetition_ptr, vocab_size, in_stride,
                      BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    idx = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = idx < vocab_size
    x = tl.load(logits_ptr + row * in_stride + idx, mask=inside, other=0.0).to(tl.float32)
    in_prompt = tl.load(prompt_counts_ptr + row * vocab_size + idx, mask=inside, other=0)
    in_output = tl.load(output_counts_ptr + row * vocab_size + idx, mask=inside, other=0)
    repetition = tl.load(repetition_ptr + row).to(tl.float32)
    frequency = tl.load(frequency_ptr + row).to(tl.float32)
    presence = tl.load(presence_ptr + row).to(tl.float32)
    penalty = tl.where((in_prompt > 0) | (in_output > 0), repetition, 1.0)
    x = x * tl.where(x > 0, 1.0 / penalty, penalty)
    x = x - frequency * in_output.to(tl.float32)
    x = x - presence * tl.where(in_output > 0, 1.0, 0.0)
    tl.store(out_ptr + row * vocab_size + idx, x.to(out_ptr.dtype.element_ty), mask=inside)


def _unit_stride_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def apply_top_k_top_p_triton(logits: torch.Tensor, k: torch.Tensor | None,
                             p: torch.Tensor | None) -> torch.Tensor:
    source = _unit_stride_rows(logits)
    batch, vocab = source.shape
    out = torch.empty(batch, vocab, dtype=logits.dtype, device=logits.device)
    _top_k_top_p_kernel[(batch,)](
        source, out, k if k is not None else source, p if p is not None else source,
        vocab, source.stride(0), out.stride(0),
        HAS_K=k is not None, HAS_P=p is not None,
        BLOCK=min(_BLOCK, next_power_of_2(vocab)), TIE_BLOCK=_TIE_BLOCK,
    )
    return out


def apply_penalties_triton(logits: torch.Tensor, prompt_counts: torch.Tensor,
                           output_counts: torch.Tensor, presence_penalties: torch.Tensor,
                           frequency_penalties: torch.Tensor,
                           repetition_penalties: torch.Tensor) -> torch.Tensor:
    source = _unit_stride_rows(logits)
    batch, vocab = source.shape
    out = torch.empty(batch, vocab, dtype=logits.dtype, device=logits.device)
    block = min(_BLOCK, next_power_of_2(vocab))
    _penalties_kernel[(batch, triton.cdiv(vocab, block))](
        source, out, prompt_counts, output_counts, presence_penalties.contiguous(),
        frequency_penalties.contiguous(), repetition_penalties.contiguous(), vocab,
        source.stride(0), BLOCK=block,
    )
    return out
