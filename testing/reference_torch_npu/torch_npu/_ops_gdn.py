"""torch_npu's gated delta-net ops, computed with plain torch on CPU tensors.

Each follows its page (Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu/torch_npu-<op>.md``,
newer than the schema snapshot's yaml; their schema lines in ``schema/op_plugin_functions.txt``
say where they come from), with the same rules as ``torch_npu._ops``: ``RuntimeError`` for
what the page rules out, ``NotImplementedError`` for what the reference does not model.

``npu_recurrent_gated_delta_rule`` (decode and speculative verification):

Per batch ``b`` of ``actual_seq_lengths[b]`` tokens (1 to 8: decode, or a request's draft
tokens under speculative verification) and each value head, a state ``S`` ``[D_v, D_k]``:

    S   <- state[ssm_state_indices[first + num_accepted_tokens[b] - 1]]   (default: first)
    S   <- exp(g_t) * S                       (g: log decay, float32; absent: 0)
    S   <- S + beta_t (v_t - S k_t) k_t^T
    o_t  = scale * S q_t,   state[ssm_state_indices[t]] <- S

for the batch's tokens ``t`` in order: each token's state is written to its own index (where
speculative verification finds the state after the last accepted token the next step).

``npu_chunk_gated_delta_rule`` (prefill): the same recurrence over each batch's tokens from
``initial_state[b]`` (zeros when absent), returning the outputs and each batch's final state
``(B, N_v, D_v, D_k)``; ``actual_seq_lengths`` are the batches' lengths, as the page's
parameter list and its single-op example give them (its graph-mode example passes running
ends instead); ``scale`` defaults to 1.0; D_k = D_v = 128 and at most 64 heads. The real op
computes in chunks; the reference token by token (the same values up to rounding).

Both take q / k as given (the pages' examples L2-normalise them first); value head ``h``
reads key head ``h // (N_v / N_k)``. Arithmetic in float32 (the state carried across a
batch's tokens unrounded), states and outputs cast to bfloat16.
"""

from __future__ import annotations

import torch

from torch_npu._unmodelled import unmodelled_argument

_OP = "npu_recurrent_gated_delta_rule"
_CHUNK_OP = "npu_chunk_gated_delta_rule"
_MAX_TOKENS_PER_BATCH = 8
_MAX_HEADS = 256
_MAX_HEAD_DIM = 512
_CHUNK_MAX_HEADS = 64
_CHUNK_HEAD_DIM = 128


def _require(condition: bool, message: str, op: str = _OP) -> None:
    if not condition:
        raise RuntimeError(f"{op}: {message}")


def _require_dtype(name: str, tensor, dtype: torch.dtype, op: str = _OP) -> None:
    _require(isinstance(tensor, torch.Tensor), f"{name} is required", op)
    _require(tensor.dtype == dtype, f"{name} has dtype {tensor.dtype}; the page takes {dtype}",
             op)


def _step(s, query, key, value, beta, g, t, group):
    """One token ``t`` on the states ``s`` ``[N_v, D_v, D_k]`` (float32)."""
    q = query[t].float().repeat_interleave(group, 0)  # [N_v, D_k]
    k = key[t].float().repeat_interleave(group, 0)
    if g is not None:
        s = s * torch.exp(g[t])[:, None, None]
    u = (value[t].float() - (s * k[:, None, :]).sum(-1)) * beta[t].float()[:, None]
    s = s + u[:, :, None] * k[:, None, :]
    return s, (s * q[:, None, :]).sum(-1)


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
            s, o = _step(s, query, key, value, beta, g, t, group)
            out[t] = o * float(scale)
            state[indices[t]] = s.to(state.dtype)
        first += length
    return out.to(torch.bfloat16)


def npu_chunk_gated_delta_rule(query, key, value, *, beta=None, initial_state=None,
                               actual_seq_lengths=None, scale=None, g=None):
    op = _CHUNK_OP
    for name, tensor in (("query", query), ("key", key), ("value", value), ("beta", beta)):
        _require_dtype(name, tensor, torch.bfloat16, op)
    _require(actual_seq_lengths is not None, "actual_seq_lengths is required", op)
    _require(query.dim() == 3 and key.shape == query.shape and value.dim() == 3
             and value.shape[0] == query.shape[0],
             f"query {tuple(query.shape)}, key {tuple(key.shape)}, value "
             f"{tuple(value.shape)}: (T, N_k, D_k) twice and (T, N_v, D_v)", op)
    tokens, key_heads, key_dim = query.shape
    value_heads, value_dim = value.shape[1:]
    _require(key_dim == value_dim == _CHUNK_HEAD_DIM,
             f"D_k={key_dim}, D_v={value_dim}: both must be {_CHUNK_HEAD_DIM}", op)
    _require(key_heads <= _CHUNK_MAX_HEADS and value_heads <= _CHUNK_MAX_HEADS
             and value_heads % key_heads == 0,
             f"N_k={key_heads}, N_v={value_heads}: each at most {_CHUNK_MAX_HEADS}, N_v a "
             "multiple of N_k", op)
    _require(beta.shape == (tokens, value_heads),
             f"beta {tuple(beta.shape)} must be (T={tokens}, N_v={value_heads})", op)
    if g is not None:
        _require_dtype("g", g, torch.float32, op)
        _require(g.shape == (tokens, value_heads),
                 f"g {tuple(g.shape)} must be (T={tokens}, N_v={value_heads})", op)
    _require_dtype("actual_seq_lengths", actual_seq_lengths, torch.int32, op)
    lengths = actual_seq_lengths.tolist()
    _require(actual_seq_lengths.dim() == 1 and sum(lengths) == tokens
             and all(n >= 1 for n in lengths),
             f"actual_seq_lengths {lengths}: the batches' lengths, each at least 1, summing to "
             f"T={tokens}", op)
    batches = len(lengths)
    shape = (batches, value_heads, value_dim, key_dim)
    if initial_state is not None:
        _require_dtype("initial_state", initial_state, torch.bfloat16, op)
        _require(tuple(initial_state.shape) == shape,
                 f"initial_state {tuple(initial_state.shape)} must be (B, N_v, D_v, D_k) = "
                 f"{shape}", op)
    scale = 1.0 if scale is None else float(scale)

    group = value_heads // key_heads
    out = torch.empty(tokens, value_heads, value_dim, dtype=torch.float32)
    final = torch.empty(shape, dtype=torch.bfloat16)
    first = 0
    for b, length in enumerate(lengths):
        s = (torch.zeros(shape[1:]) if initial_state is None
             else initial_state[b].float())
        for t in range(first, first + length):
            s, o = _step(s, query, key, value, beta, g, t, group)
            out[t] = o * scale
        final[b] = s.to(torch.bfloat16)
        first += length
    return out.to(torch.bfloat16), final
