"""The gated delta rule on torch_npu (pages: Ascend/op-plugin docs/zh/custom_APIs/torch_npu/).

- decode: ``npu_recurrent_gated_delta_rule`` runs batches of 1 to 8 tokens from a bfloat16
  state cache ``(BlockNum, N_v, D_v, D_k)``: here one token per sequence, its index the
  sequence's slot (read, and written with the new state);
- speculative verification: the same op, each token's index the state slot its sequence
  keeps for that position, and ``num_accepted_tokens`` (where each sequence starts);
- prefill: ``npu_chunk_gated_delta_rule`` runs whole sequences from per-sequence initial
  states ``(B, N_v, D_v, D_k)`` (gathered here from the sequences' slots) and returns their
  final states (scattered back); D_k = D_v = 128 and at most 64 heads.

Both take bfloat16 q / k / v / beta, a float32 log decay ``g`` and int32 lengths, and
L2-normalise nothing: q and k are normalised here first, as the pages' examples do.
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import torch_npu_module
from ascend_kernels.norm import l2norm

_MAX_HEADS = 256
_MAX_HEAD_DIM = 512
_CHUNK_MAX_HEADS = 64
_CHUNK_HEAD_DIM = 128


def gated_delta_rule_decode_problem(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                                    ) -> str | None:
    if q.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        return f"npu_recurrent_gated_delta_rule takes bfloat16 q / k / v, got {v.dtype}"
    if state.dtype != torch.bfloat16:
        return (f"npu_recurrent_gated_delta_rule keeps a bfloat16 state, the cache holds "
                f"{state.dtype}")
    if max(q.shape[1], v.shape[1]) > _MAX_HEADS:
        return f"npu_recurrent_gated_delta_rule takes at most {_MAX_HEADS} heads"
    if max(q.shape[2], v.shape[2]) > _MAX_HEAD_DIM:
        return f"npu_recurrent_gated_delta_rule takes head sizes up to {_MAX_HEAD_DIM}"
    if state.shape[0] < q.shape[0]:
        return "npu_recurrent_gated_delta_rule needs at least as many state slots as tokens"
    return None


def gated_delta_rule_decode(q, k, v, g, beta, state, state_indices, scale, use_qk_l2norm,
                            eps) -> torch.Tensor:
    if use_qk_l2norm:
        q, k = l2norm(q, eps), l2norm(k, eps)
    sequences = q.shape[0]
    return torch_npu_module().npu_recurrent_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), state,
        beta=beta.to(torch.bfloat16).contiguous(), scale=float(scale),
        actual_seq_lengths=torch.ones(sequences, dtype=torch.int32, device=q.device),
        ssm_state_indices=state_indices.to(torch.int32),
        g=g.float().contiguous())


def gated_delta_rule_problem(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                             cu_seqlens: torch.Tensor) -> str | None:
    if q.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or state.dtype != torch.bfloat16:
        return (f"npu_chunk_gated_delta_rule takes bfloat16 q / k / v and states, got "
                f"{v.dtype} inputs and a {state.dtype} state")
    if q.shape[2] != _CHUNK_HEAD_DIM or v.shape[2] != _CHUNK_HEAD_DIM:
        return f"npu_chunk_gated_delta_rule takes head sizes of {_CHUNK_HEAD_DIM} only"
    if max(q.shape[1], v.shape[1]) > _CHUNK_MAX_HEADS:
        return f"npu_chunk_gated_delta_rule takes at most {_CHUNK_MAX_HEADS} heads"
    if bool((cu_seqlens[1:] <= cu_seqlens[:-1]).any()):
        return "npu_chunk_gated_delta_rule takes sequences of at least one token"
    return None


def gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, state_indices, scale, use_qk_l2norm,
                     eps) -> torch.Tensor:
    if use_qk_l2norm:
        q, k = l2norm(q, eps), l2norm(k, eps)
    slots = state_indices.long()
    out, final = torch_npu_module().npu_chunk_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(),
        beta=beta.to(torch.bfloat16).contiguous(), initial_state=state[slots],
        actual_seq_lengths=(cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32),
        scale=float(scale), g=g.float().contiguous())
    state[slots] = final
    return out


_RECURRENT_MAX_TOKENS = 8  # per batch (sequence): the page's limit


def gated_delta_rule_verify_problem(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor,
                                    state_indices: torch.Tensor) -> str | None:
    if state_indices.shape[1] > _RECURRENT_MAX_TOKENS:
        return (f"npu_recurrent_gated_delta_rule takes at most {_RECURRENT_MAX_TOKENS} tokens "
                f"per sequence, the state rows have {state_indices.shape[1]}")
    return gated_delta_rule_decode_problem(q, v, state)


def gated_delta_rule_verify(q, k, v, g, beta, state, cu_seqlens, state_indices,
                            num_accepted_tokens, scale, use_qk_l2norm, eps) -> torch.Tensor:
    if use_qk_l2norm:
        q, k = l2norm(q, eps), l2norm(k, eps)
    sequences, columns = state_indices.shape
    if q.shape[0] == sequences * columns:
        # Every sequence full (a uniform batch, or a captured graph's, whose padding
        # sequences sit on vLLM's null slot): lengths and indices without reading cu_seqlens.
        lengths = torch.full((sequences,), columns, dtype=torch.int32, device=q.device)
        per_token = state_indices.reshape(-1)
    else:
        cu = cu_seqlens.long()
        token = torch.arange(q.shape[0], device=q.device)
        seq = torch.bucketize(token, cu[1:], right=True)
        lengths, per_token = (cu[1:] - cu[:-1]).to(torch.int32), state_indices[seq, token - cu[seq]]
    return torch_npu_module().npu_recurrent_gated_delta_rule(
        q.contiguous(), k.contiguous(), v.contiguous(), state,
        beta=beta.to(torch.bfloat16).contiguous(), scale=float(scale),
        actual_seq_lengths=lengths, ssm_state_indices=per_token.to(torch.int32),
        num_accepted_tokens=num_accepted_tokens.to(torch.int32), g=g.float().contiguous())
