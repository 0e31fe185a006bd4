"""Causal depthwise 1-D convolution with a per-sequence state: the short convolution in
front of Qwen3-Next / Qwen3.5's gated delta-net attention (and of Mamba layers).

Channel ``c`` of token ``t`` is ``act(bias[c] + sum_j weight[c, j] * x[t - W + 1 + j, c])``
over the kernel's ``W`` taps, where the inputs before a sequence's first token come from its
conv state: the last ``W - 1`` inputs the sequence saw (zeros for a sequence without one).
States live in a cache ``[slots, dim, W - 1]`` (any strides: vLLM views its cache that way);
sequence ``n`` reads and writes slot ``state_indices[n]`` in place, leaving there its last
``W - 1`` inputs (state and new tokens together).

- ``causal_conv1d``: variable-length sequences (prefill, chunked prefill);
- ``causal_conv1d_update``: one token per sequence (decode), without host synchronisation,
  so an NPU graph can capture it;
- ``causal_conv1d_verify``: a step of speculative verification (a few tokens per sequence)
  over a wider state that lets the next step start after the last accepted draft token.

Backends: the reference (float32 sums, the output rounded once to ``x``'s dtype); Triton
(one program per sequence and block of channels, the window of each token read as one
tile). The activation is SiLU (``"silu"`` / ``"swish"``) or none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ascend_kernels.dispatch import REFERENCE, TRITON, require_float, resolve_backend

ACTIVATIONS = (None, "silu", "swish")


def _check(op, x, weight, bias, conv_states, activation, min_state_len=None) -> None:
    require_float(op, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [tokens, dim], got {tuple(x.shape)}")
    dim = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 2:
        raise ValueError(f"{op}: weight must be [dim={dim}, width >= 2], got "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"{op}: bias must be [dim={dim}], got {tuple(bias.shape)}")
    width = weight.shape[1]
    # The plain forms keep exactly W - 1 inputs; the verification form a longer buffer.
    columns_ok, columns = ((conv_states.shape[-1] == width - 1, f"width - 1={width - 1}")
                           if min_state_len is None else
                           (conv_states.shape[-1] >= min_state_len,
                            f"state_len >= {min_state_len}"))
    if conv_states.dim() != 3 or conv_states.shape[1] != dim or not columns_ok:
        raise ValueError(f"{op}: conv_states must be [slots, dim={dim}, {columns}], got "
                         f"{tuple(conv_states.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")


def _finish(sums: torch.Tensor, bias, activation) -> torch.Tensor:
    if bias is not None:
        sums = sums + bias.float()
    return F.silu(sums) if activation is not None else sums


def causal_conv1d_reference(x, weight, bias, conv_states, cu_seqlens, state_indices=None,
                            has_initial_state=None, activation="silu"):
    _check("causal_conv1d", x, weight, bias, conv_states, activation)
    width = weight.shape[1]
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    slots = (list(range(len(bounds) - 1)) if state_indices is None
             else state_indices.tolist())
    initial = (None if has_initial_state is None else has_initial_state.tolist())
    taps = weight.float()[:, None, :]  # [dim, 1, W]
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        if end == start:
            continue
        slot = slots[n]
        state = conv_states[slot]
        if initial is not None and not initial[n]:
            state = torch.zeros_like(state)
        window = torch.cat([state.float(), x[start:end].float().T], dim=1)  # [dim, W-1+L]
        # Windows of W inputs ending at each token: [dim, L, W] (plain torch: any device).
        sums = (window.unfold(1, width, 1) * taps).sum(-1).T  # [L, dim]
        out[start:end] = _finish(sums, bias, activation).to(x.dtype)
        conv_states[slot] = window[:, -(width - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_update_reference(x, weight, bias, conv_states, state_indices,
                                   activation="silu"):
    _check("causal_conv1d_update", x, weight, bias, conv_states, activation)
    slots = state_indices.long()
    window = torch.cat([conv_states[slots].float(), x.float()[:, :, None]], dim=2)
    out = _finish((window * weight.float()).sum(-1), bias, activation).to(x.dtype)
    conv_states[slots] = window[:, :, 1:].to(conv_states.dtype)
    return out


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                  state_indices: torch.Tensor | None = None,
                  has_initial_state: torch.Tensor | None = None, activation: str | None = "silu",
                  *, backend: str | None = None) -> torch.Tensor:
    """The convolution of each sequence of ``cu_seqlens`` over ``x`` ``[tokens, dim]``:
    ``weight`` ``[dim, W]``, ``bias`` ``[dim]`` or None, states ``[slots, dim, W - 1]`` read
    at ``state_indices`` (default: slot ``n`` for sequence ``n``) unless
    ``has_initial_state[n]`` is false (zeros), and written there. Returns ``[tokens, dim]``
    in ``x``'s dtype."""
    chosen = resolve_backend("causal_conv1d", x, (REFERENCE, TRITON), backend)
    if chosen == REFERENCE:
        return causal_conv1d_reference(x, weight, bias, conv_states, cu_seqlens,
                                       state_indices, has_initial_state, activation)
    _check("causal_conv1d", x, weight, bias, conv_states, activation)
    sequences = cu_seqlens.numel() - 1
    if state_indices is None:
        state_indices = torch.arange(sequences, device=x.device)
    if has_initial_state is None:
        has_initial_state = torch.ones(sequences, dtype=torch.bool, device=x.device)
    return _triton(x, weight, bias, conv_states, cu_seqlens, state_indices, has_initial_state,
                   activation)


def _triton(x, weight, bias, conv_states, cu_seqlens, state_indices, has_initial_state,
            activation) -> torch.Tensor:
    from ascend_kernels.triton_kernels import conv as triton_conv

    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    triton_conv.causal_conv1d(x, weight.contiguous(), bias, conv_states,
                              cu_seqlens.contiguous(), state_indices.contiguous(),
                              has_initial_state.to(torch.int8).contiguous(),
                              activation is not None, out)
    return out


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor,
                         activation: str | None = "silu", *,
                         backend: str | None = None) -> torch.Tensor:
    """One token per sequence: ``x`` ``[sequences, dim]``, sequence ``n``'s state at slot
    ``state_indices[n]`` (always read: a decode step continues its sequence). Returns
    ``[sequences, dim]`` in ``x``'s dtype; graph-safe."""
    chosen = resolve_backend("causal_conv1d_update", x, (REFERENCE, TRITON), backend)
    if chosen == REFERENCE:
        return causal_conv1d_update_reference(x, weight, bias, conv_states, state_indices,
                                              activation)
    _check("causal_conv1d_update", x, weight, bias, conv_states, activation)
    sequences = x.shape[0]
    cu = torch.arange(sequences + 1, dtype=torch.int32, device=x.device)
    every = torch.ones(sequences, dtype=torch.bool, device=x.device)
    return _triton(x, weight, bias, conv_states, cu, state_indices, every, activation)


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                         state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """A speculative verification step: sequence ``n`` holds the rows
    ``cu_seqlens[n]:cu_seqlens[n + 1]`` of ``x`` (its last token and its drafts) and its
    state is the slot ``state_indices[n]`` of a cache ``[slots, dim, state_len]`` with
    ``state_len >= W - 2 + `` the longest query.

    The state is a rolling buffer (vLLM's layout under speculative decoding): the previous
    step left ``W - 2`` inputs of history and then its ``q`` tokens, of which
    ``num_accepted_tokens[n]`` were accepted, so this step's window starts at column
    ``num_accepted_tokens[n] - 1``. Afterwards the buffer holds the last ``W - 2`` inputs of
    that window and this step's tokens (columns past them untouched; a sequence without
    tokens keeps its buffer). Plain torch, vectorised over tokens, no host synchronisation
    (graph-safe; rows past ``cu_seqlens[-1]``, a graph's padding, go to the last sequence,
    which must then be a zero-length one on a slot nothing reads). Returns ``[tokens, dim]``
    in ``x``'s dtype."""
    width = weight.shape[1]
    _check("causal_conv1d_verify", x, weight, bias, conv_states, activation,
           min_state_len=width - 1)
    device, tokens = x.device, x.shape[0]
    if cu_seqlens.numel() < 2:
        return torch.empty_like(x)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    slots = state_indices.to(device=device, dtype=torch.long)
    history_start = num_accepted_tokens.to(device=device, dtype=torch.long) - 1
    token = torch.arange(tokens, device=device)
    seq = torch.bucketize(token, cu[1:], right=True).clamp(max=cu.numel() - 2)
    pos = token - cu[seq]
    # The window of token i is columns pos..pos+W-1 of [history (W - 1), tokens]: column c
    # comes from the state (c < W - 1) or from token i + j - (W - 1).
    taps = torch.arange(width, device=device)
    column = pos[:, None] + taps  # [tokens, W]
    from_state = column < width - 1
    state_column = (history_start[seq][:, None] + column).clamp(max=conv_states.shape[2] - 1)
    state_part = conv_states[slots[seq][:, None], :, state_column]  # [tokens, W, dim]
    x_part = x[(token[:, None] + taps - (width - 1)).clamp(min=0)]  # [tokens, W, dim]
    window = torch.where(from_state[..., None], state_part.float(), x_part.float())
    out = _finish((window * weight.float().T).sum(1), bias, activation).to(x.dtype)
    # Roll: columns 0..W-3 take the window's history after its first input, then the tokens.
    keep = torch.arange(width - 2, device=device)
    shifted = conv_states[slots[:, None], :, history_start[:, None] + 1 + keep]
    unchanged = conv_states[slots[:, None], :, keep]
    has_tokens = (cu[1:] > cu[:-1])[:, None, None]
    conv_states[slots[:, None], :, keep] = torch.where(has_tokens, shifted, unchanged)
    # Rows past cu_seqlens[-1] (a captured graph's padding: vLLM pads a batch with
    # zero-length sequences on its null slot, which nothing reads) land on the last
    # sequence, their columns clamped into the buffer.
    written = (width - 2 + pos).clamp(max=conv_states.shape[2] - 1)
    conv_states[slots[seq], :, written] = x.to(conv_states.dtype)
    return out
