"""torch_npu's gated delta-net op, computed with plain torch on CPU tensors.

``npu_recurrent_gated_delta_rule`` follows its page (Ascend/op-plugin
``docs/zh/custom_APIs/torch_npu/torch_npu-npu_recurrent_gated_delta_rule.md``, newer than the
schema snapshot's yaml; the binding's schema line is in ``schema/op_plugin_functions.txt``),
with the same rules as ``torch_npu._ops``: ``RuntimeError`` for what the page rules out,
``NotImplementedError`` for what the reference does not model.

Per batch ``b`` of ``actual_seq_lengths[b]`` tokens (1 to 8: decode, or a request's draft
tokens under speculative verification) and each value head, a state ``S`` ``[D_v, D_k]``:

    S   <- state[ssm_state_indices[first + num_accepted_tokens[b] - 1]]   (default: first)
    S   <- exp(g_t) * S                       (g: log decay, float32; absent: 0)
    S   <- S + beta_t (v_t - S k_t) k_t^T
    o_t  = scale * S q_t,   state[ssm_state_indices[t]] <- S

for the batch's tokens ``t`` in order: each token's state is written to its own index (where
speculative verification finds the state after the last accepted token the next step). q /
k are taken as given (the page's example L2-normalises them first); value head ``h`` reads
key head ``h // (N_v / N_k)``. Arithmetic in float32 (the state carried across a batch's
tokens unrounded), each written state and the output cast to bfloat16.
"""

from __future__ import annotations

import torch

from torch_npu._unmodelled import unmodelled_argument

_OP = "npu_recurrent_gated_delta_rule"
_MAX_TOKENS_PER_BATCH = 8
_MAX_HEADS = 256
_MAX_HEAD_DIM = 512


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"{_OP}: {message}")


def _require_dtype(name: str, tensor, dtype: torch.dtype) -> None:
    _require(isinstance(tensor, torch.Tensor), f"{name} is required")
    _require(tensor.dtype == dtype, f"{name} has dtype {tensor.dtype}; the page takes {dtype}")


def npu_recurrent_gated_delta_rule(query, key, value, state, *, beta=None, scale=None,
                                   actual_seq_lengths=None, ssm_state_indices=None,
                                   num_accepted_tokens=None, g=None, gk=None):
    if gk is not None:
        raise unmodelled_argument(_OP, "gk", "a tensor")  # the page: not supported yet
    for name, tensor in (("query", query), ("key", key), ("value", value), ("state", state),
                         ("beta", beta)):
        _require_dtype(name, tensor, torch.bfloat16)
    _require(scale is not None, "scale is required (the page: 1 / sqrt(D_k) in the formula)")
    _require(actual_seq_lengths is not None and ssm_state_indices is not None,
             "actual_seq_lengths and ssm_state_indices are required")
    _require(query.dim() == 3 and key.shape == query.shape,
             f"query {tuple(query.shape)} and key {tuple(key.shape)} must be equal (T, N_k, "
             "D_k)")
    tokens, key_heads, key_dim = query.shape
    _require(value.dim() == 3 and value.shape[0] == tokens,
             f"value {tuple(value.shape)} must be (T={tokens}, N_v, D_v)")
    value_heads, value_dim = value.shape[1:]
    _require(1 <= key_heads <= _MAX_HEADS and 1 <= value_heads <= _MAX_HEADS
             and value_heads % key_heads == 0,
             f"N_k={key_heads}, N_v={value_heads}: each 1 to {_MAX_HEADS}, N_v a multiple of "
             "N_k")
    _require(key_dim <= _MAX_HEAD_DIM and value_dim <= _MAX_HEAD_DIM,
             f"D_k={key_dim}, D_v={value_dim}: each at most {_MAX_HEAD_DIM}")
    _require(state.dim() == 4 and tuple(state.shape[1:]) == (value_heads, value_dim, key_dim),
             f"state {tuple(state.shape)} must be (BlockNum, N_v={value_heads}, "
             f"D_v={value_dim}, D_k={key_dim})")
    _require(state.shape[0] >= tokens, f"BlockNum={state.shape[0]} must be at least T={tokens}")
    _require(beta.shape == (tokens, value_heads),
             f"beta {tuple(beta.shape)} must be (T={tokens}, N_v={value_heads})")
    if g is not None:
        _require_dtype("g", g, torch.float32)
        _require(g.shape == (tokens, value_heads),
                 f"g {tuple(g.shape)} must be (T={tokens}, N_v={value_heads})")
    _require_dtype("actual_seq_lengths", actual_seq_lengths, torch.int32)
    _require_dtype("ssm_state_indices", ssm_state_indices, torch.int32)
    lengths = actual_seq_lengths.tolist()
    _require(actual_seq_lengths.dim() == 1 and sum(lengths) == tokens
             and all(1 <= n <= _MAX_TOKENS_PER_BATCH for n in lengths),
             f"actual_seq_lengths {lengths}: each 1 to {_MAX_TOKENS_PER_BATCH}, summing to "
             f"T={tokens}")
    _require(ssm_state_indices.shape == (tokens,),
             f"ssm_state_indices {tuple(ssm_state_indices.shape)} must be (T={tokens},)")
    indices = ssm_state_indices.tolist()
    _require(all(0 <= i < state.shape[0] for i in indices),
             f"ssm_state_indices must lie in [0, BlockNum={state.shape[0]})")
    accepted = [1] * len(lengths)
    if num_accepted_tokens is not None:
        _require_dtype("num_accepted_tokens", num_accepted_tokens, torch.int32)
        accepted = num_accepted_tokens.tolist()
        _require(len(accepted) == len(lengths)
                 and all(1 <= a <= n for a, n in zip(accepted, lengths, strict=True)),
                 f"num_accepted_tokens {accepted}: one per batch, 1 to its length")

    group = value_heads // key_heads
    out = torch.empty(tokens, value_heads, value_dim, dtype=torch.float32)
    first = 0
    for length, taken in zip(lengths, accepted, strict=True):
        s = state[indices[first + taken - 1]].float()  # [N_v, D_v, D_k]
        for t in range(first, first + length):
            q = query[t].float().repeat_interleave(group, 0)  # [N_v, D_k]
            k = key[t].float().repeat_interleave(group, 0)
            if g is not None:
                s = s * torch.exp(g[t])[:, None, None]
            u = (value[t].float() - (s * k[:, None, :]).sum(-1)) * beta[t].float()[:, None]
            s = s + u[:, :, None] * k[:, None, :]
            out[t] = (s * q[:, None, :]).sum(-1) * float(scale)
            state[indices[t]] = s.to(state.dtype)
        first += length
    return out.to(torch.bfloat16)
