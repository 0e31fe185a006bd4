"""Multi-LoRA ops: ``lora_shrink`` and ``lora_expand`` over a batch of mixed adapters.

A batch may hold tokens of several LoRA adapters and tokens of none. The adapters' weights
sit stacked in one tensor per layer slice, adapter slot first, as vLLM's LoRA layers keep
them (``[slots, 1, rows, cols]`` or ``[slots, rows, cols]``), and ``token_lora[t]`` names the
slot of token ``t``, or -1 for no adapter. A LoRA linear layer is the two ops in a row:

    buffer = lora_shrink(x, A)            # [tokens, rank], float32
    y[:, offset:offset+n] += lora_expand(buffer, B)

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| lora_shrink | yes | yes | none documented (npu tensors take Triton, else the reference) |
| lora_expand | yes | yes | none documented (npu tensors take Triton, else the reference) |

Both are safe to capture in a device graph: no host synchronisation, no shape that depends
on the indices, and the slot index is read on the device. The reference multiplies each
token by every slot's weights and keeps its own slot's result (slots are few, ranks small;
it never materialises a weight matrix per token), so its cost and memory do not grow with
how the tokens are spread over adapters.
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import REFERENCE, TRITON, require_float, resolve_backend


def _slot_weights(op: str, name: str, weights: torch.Tensor) -> torch.Tensor:
    """``weights`` as ``[slots, rows, cols]`` (vLLM stacks them as ``[slots, 1, rows, cols]``)."""
    require_float(op, name, weights)
    if weights.dim() == 4 and weights.shape[1] == 1:
        return weights[:, 0]
    if weights.dim() != 3:
        raise ValueError(f"{op}: {name} must be [slots, rows, cols] or [slots, 1, rows, cols], "
                         f"got shape {tuple(weights.shape)}")
    return weights


def _check_rows(op: str, x: torch.Tensor, width: int, meaning: str,
                token_lora: torch.Tensor) -> None:
    """``x`` ``[tokens, width]`` and one slot per token in ``token_lora``."""
    require_float(op, "x", x)
    if x.dim() != 2 or x.shape[1] != width:
        raise ValueError(f"{op}: x must be [tokens, {width}] to match {meaning}, got shape "
                         f"{tuple(x.shape)}")
    tokens = x.shape[0]
    if token_lora.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: token_lora has dtype {token_lora.dtype}; use int32 or int64")
    if token_lora.dim() != 1 or token_lora.shape[0] != tokens:
        raise ValueError(f"{op}: token_lora must be [{tokens}] (one slot per token), got shape "
                         f"{tuple(token_lora.shape)}")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, out: torch.Tensor,
                token_lora: torch.Tensor, scale: float = 1.0, *,
                backend: str | None = None) -> torch.Tensor:
    """``out[t] = scale * x[t] @ lora_a[token_lora[t]].T``; rows of tokens without an
    adapter (slot -1) are set to 0. ``x`` ``[tokens, hidden]``, ``lora_a`` ``[slots, rank,
    hidden]`` (or with vLLM's unit dim), ``out`` ``[tokens, rank]`` (any float dtype; vLLM
    passes a float32 buffer), written in full and returned."""
    op = "lora_shrink"
    weights = _slot_weights(op, "lora_a", lora_a)
    _, rank, hidden = weights.shape
    _check_rows(op, x, hidden, "lora_a's hidden size", token_lora)
    if out.shape != (x.shape[0], rank):
        raise ValueError(f"{op}: out must be [{x.shape[0]}, {rank}] (tokens, rank), got shape "
                         f"{tuple(out.shape)}")
    chosen = resolve_backend(op, x, (REFERENCE, TRITON), backend)
    if chosen == REFERENCE or x.shape[0] == 0:
        return lora_shrink_reference(x, weights, out, token_lora, scale)
    from ascend_kernels.triton_kernels import lora as triton_lora

    triton_lora.lora_matmul(x, weights, out, token_lora, scale, 0, add=False, zero_unmapped=True)
    return out


def lora_expand(x: torch.Tensor, lora_b: torch.Tensor, out: torch.Tensor,
                token_lora: torch.Tensor, offset: int = 0, add_inputs: bool = True, *,
                backend: str | None = None) -> torch.Tensor:
    """``out[t, offset:offset+n] (+)= x[t] @ lora_b[token_lora[t]].T`` in float32, stored in
    ``out``'s dtype; rows of tokens without an adapter (slot -1) are left as they are.
    ``x`` ``[tokens, rank]``, ``lora_b`` ``[slots, n, rank]`` (or with vLLM's unit dim),
    ``out`` ``[tokens, width]`` with ``offset + n <= width``. Returns ``out``."""
    op = "lora_expand"
    require_float(op, "out", out)
    weights = _slot_weights(op, "lora_b", lora_b)
    _, n, rank = weights.shape
    _check_rows(op, x, rank, "lora_b's rank", token_lora)
    if out.dim() != 2 or out.shape[0] != x.shape[0] or not 0 <= offset <= out.shape[1] - n:
        raise ValueError(f"{op}: out must be [{x.shape[0]}, >= offset + {n}] with offset >= 0, "
                         f"got shape {tuple(out.shape)} and offset {offset}")
    chosen = resolve_backend(op, x, (REFERENCE, TRITON), backend)
    if chosen == REFERENCE or x.shape[0] == 0:
        return lora_expand_reference(x, weights, out, token_lora, offset, add_inputs)
    from ascend_kernels.triton_kernels import lora as triton_lora

    triton_lora.lora_matmul(x, weights, out, token_lora, 1.0, offset, add=add_inputs,
                          zero_unmapped=False)
    return out


def lora_shrink_reference(x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                          token_lora: torch.Tensor, scale: float) -> torch.Tensor:
    """``lora_shrink`` for checked inputs, ``weights`` ``[slots, rank, hidden]``."""
    slots, rank, hidden = weights.shape
    # Every slot's product, then each token's own: one matrix product, no per-token weights.
    all_slots = x.float() @ weights.float().reshape(slots * rank, hidden).T
    index = token_lora.clamp(min=0).long().view(-1, 1, 1).expand(-1, 1, rank)
    picked = all_slots.view(-1, slots, rank).gather(1, index).squeeze(1) * scale
    out.copy_(torch.where((token_lora >= 0)[:, None], picked, 0.0))
    return out


def lora_expand_reference(x: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                          token_lora: torch.Tensor, offset: int,
                          add_inputs: bool) -> torch.Tensor:
    """``lora_expand`` for checked inputs, ``weights`` ``[slots, n, rank]``."""
    slots, n, rank = weights.shape
    # Each token's rank vector placed in its own slot's block, zeros elsewhere: one product
    # with every slot's weights gives each token its own adapter's output.
    blocks = torch.zeros(x.shape[0], slots, rank, dtype=torch.float32, device=x.device)
    index = token_lora.clamp(min=0).long().view(-1, 1, 1).expand(-1, 1, rank)
    blocks.scatter_(1, index, x.float().unsqueeze(1))
    product = torch.einsum("tsr,snr->tn", blocks, weights.float())
    target = out[:, offset:offset + n]
    if add_inputs:
        product = product + target.float()
    target.copy_(torch.where((token_lora >= 0)[:, None], product.to(out.dtype), target))
    return out
