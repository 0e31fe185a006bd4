"""Gated delta rule (the linear attention of Qwen3-Next / Qwen3.5's gated delta-net layers),
token by token over variable-length sequences, with a state cache.

For each sequence and value head a state ``S`` ``[V, K]`` evolves over the sequence's tokens
``t`` (in float32; read from and written back to the cache in the cache's dtype):

    q_t, k_t = l2norm(q_t), l2norm(k_t)          (with ``use_qk_l2norm``; ``x / sqrt(|x|^2 + eps)``)
    S   = S * exp(g_t)                           (``g``: log of the decay)
    u   = (v_t - S k_t) * beta_t                 (the delta rule's correction)
    S   = S + u k_t^T
    o_t = S (q_t * scale)

``q`` / ``k`` have ``H`` heads and ``v`` ``HV`` (a multiple of ``H``): value head ``hv`` reads
query / key head ``hv // (HV / H)``. The states live in a cache ``[slots, HV, V, K]`` (vLLM's
layout); sequence ``n`` starts from slot ``state_indices[n]`` and leaves its final state there
(in place). What vLLM's recurrent kernel computes for decode and, one token at a time, for
prefill (its chunked form for long prefills computes the same values in another order).

Backends: the reference (float32, vectorised over heads); Triton (one program per sequence,
value head and block of V, the state block in registers across the sequence's tokens);
torch_npu: ``npu_chunk_gated_delta_rule`` for sequences and ``npu_recurrent_gated_delta_rule``
for the decode form (bfloat16 states; ``npu_ops.gdn``).

``gated_delta_rule_verify`` is the speculative-verification form (vLLM's layout): sequence
``n`` has a row of state slots ``state_indices[n]``, starts from the slot of the last token
the previous step accepted (column ``num_accepted_tokens[n] - 1``) and writes the state after
its ``t``-th token to column ``t``, so the next step finds the state after whichever draft
was accepted last. Reference (vectorised, no host synchronisation), Triton (the same kernel,
storing the state after each token) and torch_npu (``npu_recurrent_gated_delta_rule``,
whose per-token state indices and ``num_accepted_tokens`` are this layout).
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import NPU, REFERENCE, TRITON, require_float, resolve_backend

DEFAULT_EPS = 1e-6


def _check(q, k, v, g, beta, state, cu_seqlens, state_indices) -> tuple[int, int, int]:
    op = "gated_delta_rule"
    for name, x in (("q", q), ("k", k), ("v", v)):
        require_float(op, name, x)
        if x.dim() != 3:
            raise ValueError(f"{op}: {name} must be [tokens, heads, head_dim], got "
                             f"{tuple(x.shape)}")
    tokens, heads, key_dim = q.shape
    value_heads = v.shape[1]
    if k.shape != q.shape or v.shape[0] != tokens:
        raise ValueError(f"{op}: q {tuple(q.shape)}, k {tuple(k.shape)} and v "
                         f"{tuple(v.shape)} must share the token count, q and k their shape")
    if value_heads % heads:
        raise ValueError(f"{op}: v's {value_heads} heads must be a multiple of q's {heads}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (tokens, value_heads):
            raise ValueError(f"{op}: {name} must be [tokens={tokens}, value heads="
                             f"{value_heads}], got {tuple(x.shape)}")
    if state.dim() != 4 or state.shape[1:] != (value_heads, v.shape[2], key_dim) or (
            not state.dtype.is_floating_point):
        raise ValueError(f"{op}: state must be a float [slots, {value_heads}, {v.shape[2]}, "
                         f"{key_dim}] cache, got {state.dtype} {tuple(state.shape)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"{op}: cu_seqlens must be a 1-D integer tensor [sequences + 1], got "
                         f"{cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    sequences = cu_seqlens.numel() - 1
    if state_indices is not None and (state_indices.shape != (sequences,)
                                      or state_indices.dtype.is_floating_point):
        raise ValueError(f"{op}: state_indices must be [{sequences}] integers (one state slot "
                         f"per sequence), got {tuple(state_indices.shape)}")
    return sequences, heads, value_heads


def gated_delta_rule_reference(q, k, v, g, beta, state, cu_seqlens, state_indices=None,
                               scale=None, use_qk_l2norm=False, eps=DEFAULT_EPS):
    """The output ``[tokens, HV, V]`` (``v``'s dtype); ``state`` updated in place. Float32;
    the sequences step together (step ``j`` takes the ``j``-th token of every sequence that
    long), so a decode batch is one vectorised step."""
    sequences, heads, value_heads = _check(q, k, v, g, beta, state, cu_seqlens, state_indices)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = value_heads // heads
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if sequences == 0:
        return out.to(v.dtype)
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    slots = (torch.arange(sequences, device=state.device) if state_indices is None
             else state_indices.long())
    s = state[slots].float()  # [N, HV, V, K], a copy
    for step in range(int(lengths.max())):
        active = lengths > step
        t = (starts + step)[active]
        s[active], out[t] = _step(s[active], q[t], k[t], v[t], g[t], beta[t], group, scale,
                                  use_qk_l2norm, eps)
    state[slots] = s.to(state.dtype)
    return out.to(v.dtype)


def _step(s, q, k, v, g, beta, group, scale, use_qk_l2norm, eps):
    """One token of ``n`` sequences: states ``[n, HV, V, K]`` and their rows of ``q`` / ``k``
    ``[n, H, K]``, ``v`` ``[n, HV, V]``, ``g`` / ``beta`` ``[n, HV]`` -> (new states, float32
    outputs ``[n, HV, V]``)."""
    q = q.float().repeat_interleave(group, dim=1)  # [n, HV, K]
    k = k.float().repeat_interleave(group, dim=1)
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + eps)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + eps)
    s = s * torch.exp(g.float())[..., None, None]
    u = (v.float() - (s * k[:, :, None, :]).sum(-1)) * beta.float()[..., None]
    s = s + u[..., None] * k[:, :, None, :]
    return s, (s * (q * scale)[:, :, None, :]).sum(-1)


def gated_delta_rule_decode_reference(q, k, v, g, beta, state, cu_seqlens, state_indices,
                                      scale=None, use_qk_l2norm=False, eps=DEFAULT_EPS):
    """The reference for a decode batch (sequence ``n`` is token ``n``), without host
    synchronisation (CUDA-graph capturable); ``cu_seqlens`` is not read."""
    group = v.shape[1] // q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    slots = state_indices.long()
    s, out = _step(state[slots].float(), q, k, v, g, beta, group, scale, use_qk_l2norm, eps)
    state[slots] = s.to(state.dtype)
    return out.to(v.dtype)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                     state_indices: torch.Tensor | None = None, scale: float | None = None,
                     use_qk_l2norm: bool = False, eps: float = DEFAULT_EPS, *,
                     backend: str | None = None) -> torch.Tensor:
    """Run the gated delta rule over each sequence of ``cu_seqlens`` (see the module
    docstring): ``q`` / ``k`` ``[tokens, H, K]``, ``v`` ``[tokens, HV, V]``, ``g`` / ``beta``
    ``[tokens, HV]``, ``state`` ``[slots, HV, V, K]`` (float32, or the model's dtype as
    vLLM's default state cache holds it) read and written at
    ``state_indices`` (default: slot ``n`` for sequence ``n``). Returns ``[tokens, HV, V]`` in
    ``v``'s dtype; ``scale`` defaults to ``K ** -0.5``."""
    from ascend_kernels.npu_ops.gdn import gated_delta_rule_problem

    sequences, _, _ = _check(q, k, v, g, beta, state, cu_seqlens, state_indices)
    npu_problem = (gated_delta_rule_problem(q, v, state, cu_seqlens) if sequences
                   else "no sequences")
    chosen = resolve_backend("gated_delta_rule", v, (REFERENCE, TRITON, NPU), backend,
                             {NPU: npu_problem})
    if chosen == REFERENCE:
        return gated_delta_rule_reference(q, k, v, g, beta, state, cu_seqlens, state_indices,
                                          scale, use_qk_l2norm, eps)
    if state_indices is None:
        state_indices = torch.arange(sequences, device=v.device)
    if chosen == NPU:
        from ascend_kernels.npu_ops import gdn as npu_gdn

        return npu_gdn.gated_delta_rule(q, k, v, g, beta, state, cu_seqlens, state_indices,
                                        q.shape[-1] ** -0.5 if scale is None else scale,
                                        use_qk_l2norm, eps)
    return _triton(q, k, v, g, beta, state, cu_seqlens, state_indices,
                   q.shape[-1] ** -0.5 if scale is None else scale, use_qk_l2norm, eps)


def _triton(q, k, v, g, beta, state, cu_seqlens, state_indices, scale, use_qk_l2norm, eps):
    from ascend_kernels.triton_kernels import gdn as triton_gdn

    out = torch.empty_like(v)
    triton_gdn.gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(),
                                g.contiguous(), beta.contiguous(), state,
                                cu_seqlens.contiguous(), state_indices.contiguous(), out,
                                scale, use_qk_l2norm, eps)
    return out


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                            state_indices: torch.Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = False, eps: float = DEFAULT_EPS, *,
                            backend: str | None = None) -> torch.Tensor:
    """A decode batch: sequence ``n`` is token ``n``, its state at slot ``state_indices[n]``.
    What ``gated_delta_rule`` computes for one-token sequences, without host
    synchronisation (an NPU graph can capture it)."""
    from ascend_kernels.npu_ops.gdn import gated_delta_rule_decode_problem

    sequences = q.shape[0]
    cu = torch.arange(sequences + 1, dtype=torch.int32, device=q.device)
    _check(q, k, v, g, beta, state, cu, state_indices)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    chosen = resolve_backend("gated_delta_rule_decode", v, (REFERENCE, TRITON, NPU), backend,
                             {NPU: gated_delta_rule_decode_problem(q, v, state)})
    if chosen == NPU:
        from ascend_kernels.npu_ops import gdn as npu_gdn

        return npu_gdn.gated_delta_rule_decode(q, k, v, g, beta, state, state_indices, scale,
                                               use_qk_l2norm, eps)
    if chosen == REFERENCE:
        return gated_delta_rule_decode_reference(q, k, v, g, beta, state, cu, state_indices,
                                                 scale, use_qk_l2norm, eps)
    # Straight to the kernel: gated_delta_rule's npu check reads the lengths on the host.
    return _triton(q, k, v, g, beta, state, cu, state_indices, scale, use_qk_l2norm, eps)


def gated_delta_rule_verify_reference(q, k, v, g, beta, state, cu_seqlens, state_indices,
                                      num_accepted_tokens, scale, use_qk_l2norm, eps):
    group = v.shape[1] // q.shape[1]
    tokens, sequences, columns = q.shape[0], state_indices.shape[0], state_indices.shape[1]
    cu = cu_seqlens.long()
    starts, lengths = cu[:-1], cu[1:] - cu[:-1]
    slots = state_indices.long()
    first = slots.gather(1, (num_accepted_tokens.long() - 1)[:, None]).squeeze(1)
    s = state[first].float()
    outputs = []
    for step in range(columns):
        active = (lengths > step)[:, None, None, None]
        t = (starts + step).clamp(max=tokens - 1)
        stepped, out = _step(s, q[t], k[t], v[t], g[t], beta[t], group, scale, use_qk_l2norm,
                             eps)
        outputs.append(out)
        s = torch.where(active, stepped, s)
        target = slots[:, step]
        state[target] = torch.where(active, s, state[target].float()).to(state.dtype)
    outputs = torch.stack(outputs, 1)  # [sequences, columns, HV, V]
    token = torch.arange(tokens, device=v.device)
    seq = torch.bucketize(token, cu[1:], right=True).clamp(max=sequences - 1)
    return outputs[seq, (token - cu[seq]).clamp(max=columns - 1)].to(v.dtype)


def gated_delta_rule_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                            cu_seqlens: torch.Tensor, state_indices: torch.Tensor,
                            num_accepted_tokens: torch.Tensor, scale: float | None = None,
                            use_qk_l2norm: bool = False, eps: float = DEFAULT_EPS, *,
                            backend: str | None = None) -> torch.Tensor:
    """A speculative verification step (see the module docstring): sequence ``n`` holds the
    rows ``cu_seqlens[n]:cu_seqlens[n + 1]`` (at most ``state_indices.shape[1]``; rows past
    ``cu_seqlens[-1]``, a captured graph's padding, change no state), ``state_indices``
    ``[sequences, columns]`` its slots, ``num_accepted_tokens`` ``[sequences]`` (1 or more)
    the previous step's accepted count. Returns ``[tokens, HV, V]`` in ``v``'s dtype."""
    from ascend_kernels.npu_ops.gdn import gated_delta_rule_verify_problem

    sequences = cu_seqlens.numel() - 1
    _check(q, k, v, g, beta, state, cu_seqlens, None)
    if (state_indices.dim() != 2 or state_indices.shape[0] != sequences
            or state_indices.dtype.is_floating_point):
        raise ValueError(f"gated_delta_rule_verify: state_indices must be [sequences="
                         f"{sequences}, columns] integers, got {state_indices.dtype} "
                         f"{tuple(state_indices.shape)}")
    if num_accepted_tokens.shape != (sequences,):
        raise ValueError(f"gated_delta_rule_verify: num_accepted_tokens must be [sequences="
                         f"{sequences}], got {tuple(num_accepted_tokens.shape)}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if sequences == 0 or q.shape[0] == 0:
        return torch.empty_like(v)
    chosen = resolve_backend("gated_delta_rule_verify", v, (REFERENCE, TRITON, NPU), backend,
                             {NPU: gated_delta_rule_verify_problem(q, v, state, state_indices)})
    if chosen == TRITON:
        from ascend_kernels.triton_kernels import gdn as triton_gdn

        # Zeros: rows past cu_seqlens[-1] (a graph's padding) are not written.
        out = torch.zeros_like(v)
        triton_gdn.gated_delta_rule(q.contiguous(), k.contiguous(), v.contiguous(),
                                    g.contiguous(), beta.contiguous(), state,
                                    cu_seqlens.contiguous(), state_indices.contiguous(), out,
                                    scale, use_qk_l2norm, eps,
                                    num_accepted_tokens.contiguous())
        return out
    if chosen == NPU:
        from ascend_kernels.npu_ops import gdn as npu_gdn

        return npu_gdn.gated_delta_rule_verify(q, k, v, g, beta, state, cu_seqlens,
                                               state_indices, num_accepted_tokens, scale,
                                               use_qk_l2norm, eps)
    return gated_delta_rule_verify_reference(q, k, v, g, beta, state, cu_seqlens,
                                             state_indices, num_accepted_tokens, scale,
                                             use_qk_l2norm, eps)
