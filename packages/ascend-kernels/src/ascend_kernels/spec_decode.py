"""Per-request bookkeeping of EAGLE-style drafting (EAGLE, EAGLE-3, MTP), as batched torch ops.

vLLM does these steps with Triton kernels (and C++ fallbacks on its CPU backend); neither runs
on an Ascend NPU without triton-ascend. Each op here is a handful of vectorised torch calls
with no host synchronisation, so one implementation serves every device (CPU, npu, cuda), and
it is the specification the tests hold vLLM's kernels to.

Conventions (vLLM's): rejected or padded sampled tokens are -1; ``cu_num_draft_tokens`` is the
inclusive cumulative sum of draft tokens per request; ``query_start_loc`` has one more entry
than requests; a slot of ``pad_slot_id`` (-1) is written nowhere by attention.
"""

from __future__ import annotations

import torch

PAD_SLOT_ID = -1


def _check_1d(name: str, tensor: torch.Tensor, length: int | None = None) -> None:
    if tensor.dim() != 1 or (length is not None and tensor.shape[0] != length):
        want = f"[{length}]" if length is not None else "one dimension"
        raise ValueError(f"{name} must have shape {want}, got {tuple(tensor.shape)}")


def next_token_ids_padded(sampled_token_ids: torch.Tensor, discard_mask: torch.Tensor,
                          backup_token_ids: torch.Tensor,
                          vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The token each request's draft starts from, and how many sampled tokens are valid.

    sampled_token_ids: [requests, k + 1], -1 where rejected; discard_mask: [requests] bool
    (requests whose sampled token is thrown away, e.g. partial prefills); backup_token_ids:
    [requests], the last token each request already had.
    Returns (next_token_ids [requests] int32, valid_count [requests] int32): the last valid
    sampled token, or the backup token when there is none or the request is discarded, whose
    count is then 0.
    """
    if sampled_token_ids.dim() != 2:
        raise ValueError("sampled_token_ids must have shape [requests, k + 1], got "
                         f"{tuple(sampled_token_ids.shape)}")
    requests, width = sampled_token_ids.shape
    _check_1d("discard_mask", discard_mask, requests)
    _check_1d("backup_token_ids", backup_token_ids, requests)
    if discard_mask.dtype != torch.bool:
        raise ValueError(f"discard_mask must be torch.bool, got {discard_mask.dtype}")
    valid = (sampled_token_ids != -1) & (sampled_token_ids < vocab_size)
    count = valid.sum(dim=1)
    columns = torch.arange(width, device=sampled_token_ids.device)
    last = torch.where(valid, columns, -1).amax(dim=1).clamp_min(0)
    last_token = sampled_token_ids.gather(1, last.unsqueeze(1)).squeeze(1)
    keep = (count > 0) & ~discard_mask
    next_ids = torch.where(keep, last_token, backup_token_ids.to(last_token.dtype))
    count = torch.where(discard_mask, 0, count)
    return next_ids.to(torch.int32), count.to(torch.int32)


def sample_indices_padded(cu_num_draft_tokens: torch.Tensor, valid_count: torch.Tensor,
                          query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each request's draft reads its hidden state, when rejected tokens stay as padding.

    A request that verified d drafts and kept ``valid_count`` = a + 1 tokens has d - a
    rejected tokens at the end of its query; its next draft starts from the last kept one.
    Requests without drafts reject nothing.
    Returns (token_indices_to_sample [requests] int32, num_rejected [requests] int32).
    """
    _check_1d("cu_num_draft_tokens", cu_num_draft_tokens)
    requests = cu_num_draft_tokens.shape[0]
    _check_1d("valid_count", valid_count, requests)
    _check_1d("query_start_loc", query_start_loc, requests + 1)
    num_drafts = torch.diff(cu_num_draft_tokens.long(),
                            prepend=cu_num_draft_tokens.new_zeros(1).long())
    rejected = torch.where(num_drafts > 0, num_drafts + 1 - valid_count.long(), 0)
    last_index = query_start_loc[1:].long() - 1
    return (last_index - rejected).to(torch.int32), rejected.to(torch.int32)


def step_positions_and_slots(positions: torch.Tensor, block_table: torch.Tensor,
                             seq_lens: torch.Tensor, *, block_size: int, max_model_len: int,
                             out_positions: torch.Tensor, out_slot_mapping: torch.Tensor,
                             pad_slot_id: int = PAD_SLOT_ID) -> None:
    """Advance every request by one drafted token: position, KV-cache slot and length.

    positions: [requests]; block_table: [requests, blocks]; seq_lens: [requests], updated in
    place. Writes out_positions[:requests] and out_slot_mapping (every entry past
    ``requests`` is padding and gets ``pad_slot_id``). A request whose next position reaches
    ``max_model_len`` drafts nothing useful: it is parked at position 0, slot ``pad_slot_id``,
    length 1, so it never writes outside its blocks.
    """
    _check_1d("positions", positions)
    requests = positions.shape[0]
    _check_1d("seq_lens", seq_lens, requests)
    if block_table.dim() != 2 or block_table.shape[0] < requests:
        raise ValueError(f"block_table must have shape [>= {requests}, blocks], got "
                         f"{tuple(block_table.shape)}")
    if out_slot_mapping.shape[0] < requests or out_positions.shape[0] < requests:
        raise ValueError(f"out_positions ({out_positions.shape[0]}) and out_slot_mapping "
                         f"({out_slot_mapping.shape[0]}) must hold the {requests} requests")
    if block_size <= 0 or max_model_len <= 0:
        raise ValueError(f"block_size={block_size} and max_model_len={max_model_len} must be "
                         "positive")
    advanced = positions.long() + 1
    beyond = advanced >= max_model_len
    position = torch.where(beyond, 0, advanced)
    block_index = (position // block_size).clamp_max(block_table.shape[1] - 1)
    rows = torch.arange(requests, device=positions.device)
    block_id = block_table[rows, block_index].long()
    slot = torch.where(beyond, pad_slot_id, block_id * block_size + position % block_size)
    new_len = torch.where(beyond, 1, seq_lens.long() + 1).clamp_max(max_model_len)
    seq_lens.copy_(new_len.to(seq_lens.dtype))
    out_positions[:requests] = position.to(out_positions.dtype)
    out_slot_mapping[:requests] = slot.to(out_slot_mapping.dtype)
    out_slot_mapping[requests:] = pad_slot_id
