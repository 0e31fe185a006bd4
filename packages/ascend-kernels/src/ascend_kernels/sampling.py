"""Sampling ops on the logits: top-k / top-p masking and repetition, frequency and
presence penalties.

Shapes: ``logits`` is ``[B, V]`` (requests x vocabulary); per-request parameters are
``[B]``. Both ops return a new tensor in ``logits``' dtype (vLLM updates its logits in
place; these leave the input alone) and compute in float32.

Values of per-request tensors (``k``, ``p``, token ids, penalties) are checked only for
CPU tensors: checking a device tensor would read it back and synchronise every step.

| op | reference | triton | npu (torch_npu) |
|---|---|---|---|
| apply_top_k_top_p | yes | yes | ``npu_top_k_top_p`` (both k and p, k <= 1024) |
| apply_penalties | yes | yes | none (torch_npu has no fused penalties op) |
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import (
    NPU,
    REFERENCE,
    TRITON,
    require_float,
    require_same_device,
    resolve_backend,
)
from ascend_kernels.npu_ops.routing import top_k_top_p_problem

_INT_DTYPES = (torch.int32, torch.int64)


def _check_logits(op: str, logits: torch.Tensor) -> None:
    require_float(op, "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be 2-D [batch, vocab], got shape "
                         f"{tuple(logits.shape)}")


def _check_per_request(op: str, name: str, tensor: torch.Tensor, batch: int,
                       kind: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor or None, got "
                        f"{type(tensor).__name__}")
    if kind == "int" and tensor.dtype not in _INT_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {tensor.dtype}; use int32 or int64")
    if kind == "float":
        require_float(op, name, tensor)
    if tuple(tensor.shape) != (batch,):
        raise ValueError(f"{op}: {name} has shape {tuple(tensor.shape)}; it must be ({batch},), "
                         "one value per row of logits")


def _bad_values(mask: torch.Tensor, values: torch.Tensor) -> str:
    rows = mask.nonzero().flatten()[:4].tolist()
    return ", ".join(f"row {r}: {values[r].item()}" for r in rows)


# --- top-k / top-p ------------------------------------------------------------------------


def apply_top_k_top_p_reference(logits: torch.Tensor, k: torch.Tensor | None,
                                p: torch.Tensor | None) -> torch.Tensor:
    values = logits.float()
    vocab = values.shape[1]
    # A stable ascending sort: among equal logits the higher token id ranks higher.
    ranked, order = values.sort(dim=-1, stable=True)
    if k is not None:
        kth_largest = ranked.gather(1, (vocab - k.long()).unsqueeze(1))
        ranked = ranked.masked_fill(ranked < kth_largest, float("-inf"))
    if p is not None:
        mass_up_to = ranked.softmax(dim=-1).cumsum(dim=-1)
        dropped = mass_up_to <= (1 - p.float()).unsqueeze(1)
        dropped[:, -1] = False  # the most likely token always stays
        ranked = ranked.masked_fill(dropped, float("-inf"))
    return torch.empty_like(values).scatter_(1, order, ranked).to(logits.dtype)


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None = None,
                      p: torch.Tensor | None = None, *,
                      backend: str | None = None) -> torch.Tensor:
    """Mask to ``-inf`` the logits outside each row's top-k and top-p sets (vLLM's
    ``apply_top_k_top_p``).

    - ``k`` (int ``[B]``, each in ``[1, V]``; ``V`` disables top-k for a row): keeps every
      logit >= the row's k-th largest, so a tie at the k-th value keeps all its tokens.
    - ``p`` (float ``[B]``, each in ``(0, 1]``): applied after top-k, on the softmax of what
      top-k kept. Tokens ranked from least to most likely (equal logits: lower token id
      first, a stable sort, as vLLM's sort and torch_npu's ``npu_top_k_top_p``) are dropped
      while the running sum of their probabilities stays <= ``1 - p``; the most likely token
      always stays.

    ``k`` and ``p`` both None returns ``logits`` itself.
    """
    op = "apply_top_k_top_p"
    _check_logits(op, logits)
    batch, vocab = logits.shape
    if k is not None:
        _check_per_request(op, "k", k, batch, "int")
    if p is not None:
        _check_per_request(op, "p", p, batch, "float")
    require_same_device(op, logits=logits, k=k, p=p)
    if k is None and p is None:
        return logits
    if k is not None and k.device.type == "cpu" and batch:
        bad = (k < 1) | (k > vocab)
        if bad.any():
            raise ValueError(f"{op}: k must be in [1, {vocab}] (the vocabulary size; {vocab} "
                             f"disables top-k), got {_bad_values(bad, k)}")
    if p is not None and p.device.type == "cpu" and batch:
        bad = ~((p > 0) & (p <= 1))
        if bad.any():
            raise ValueError(f"{op}: p must be in (0, 1] (1 disables top-p), got "
                             f"{_bad_values(bad, p)}")
    unsupported = {}
    if logits.device.type == NPU or backend == NPU:  # the check reads k back from the device
        unsupported[NPU] = top_k_top_p_problem(k, p)
    chosen = resolve_backend(op, logits, (REFERENCE, TRITON, NPU), backend, unsupported)
    if batch == 0 or vocab == 0:
        return logits.clone()
    if chosen == TRITON:
        from ascend_kernels.triton_kernels.sampling import apply_top_k_top_p_triton

        return apply_top_k_top_p_triton(logits, k, p)
    if chosen == NPU:
        from ascend_kernels.npu_ops.routing import top_k_top_p_npu

        return top_k_top_p_npu(logits, k, p)
    return apply_top_k_top_p_reference(logits, k, p)


# --- penalties ----------------------------------------------------------------------------


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, L]`` token ids padded with ``vocab_size`` or ``-1`` -> int32 ``[B, V]`` counts."""
    ids = token_ids.long()
    ids = torch.where(ids < 0, vocab_size, ids)  # -1 padding joins the vocab_size bin
    counts = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab_size].contiguous()


def apply_penalties_reference(logits: torch.Tensor, prompt_counts: torch.Tensor,
                              output_counts: torch.Tensor, presence_penalties: torch.Tensor,
                              frequency_penalties: torch.Tensor,
                              repetition_penalties: torch.Tensor) -> torch.Tensor:
    values = logits.float()
    seen = (prompt_counts > 0) | (output_counts > 0)
    penalty = torch.where(seen, repetition_penalties.float().unsqueeze(1), 1.0)
    values = values * torch.where(values > 0, 1.0 / penalty, penalty)
    values = values - frequency_penalties.float().unsqueeze(1) * output_counts
    values = values - presence_penalties.float().unsqueeze(1) * (output_counts > 0)
    return values.to(logits.dtype)


def apply_penalties(logits: torch.Tensor, prompt_token_ids: torch.Tensor,
                    output_token_ids: torch.Tensor, presence_penalties: torch.Tensor,
                    frequency_penalties: torch.Tensor, repetition_penalties: torch.Tensor,
                    *, backend: str | None = None) -> torch.Tensor:
    """Repetition, frequency and presence penalties (vLLM's ``apply_penalties``).

    ``prompt_token_ids`` ``[B, P]`` and ``output_token_ids`` ``[B, O]`` are token ids padded
    with ``V`` (vLLM's padding) or ``-1``. For token ``t`` of row ``b``:

    - seen in the prompt or the output: a positive logit is divided by
      ``repetition_penalties[b]``, a negative one multiplied by it;
    - then ``frequency_penalties[b] * count_in_output(t)`` is subtracted,
    - then ``presence_penalties[b]`` if ``t`` occurs in the output.
    """
    op = "apply_penalties"
    _check_logits(op, logits)
    batch, vocab = logits.shape
    for name, ids in (("prompt_token_ids", prompt_token_ids),
                      ("output_token_ids", output_token_ids)):
        if not isinstance(ids, torch.Tensor) or ids.dtype not in _INT_DTYPES:
            raise TypeError(f"{op}: {name} must be an int32 or int64 tensor, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() != 2 or ids.shape[0] != batch:
            raise ValueError(f"{op}: {name} has shape {tuple(ids.shape)}; it must be "
                             f"({batch}, length), padded with {vocab} or -1")
        if ids.device.type == "cpu" and ids.numel():
            bad = (ids < -1) | (ids > vocab)
            if bad.any():
                raise ValueError(f"{op}: {name} holds {ids[bad][0].item()}; token ids must be "
                                 f"in [0, {vocab}), padding {vocab} or -1")
    penalties = (("presence_penalties", presence_penalties),
                 ("frequency_penalties", frequency_penalties),
                 ("repetition_penalties", repetition_penalties))
    for name, tensor in penalties:
        _check_per_request(op, name, tensor, batch, "float")
    require_same_device(op, logits=logits, prompt_token_ids=prompt_token_ids,
                        output_token_ids=output_token_ids, **dict(penalties))
    if repetition_penalties.device.type == "cpu" and batch:
        bad = ~(repetition_penalties > 0)
        if bad.any():
            raise ValueError(f"{op}: repetition_penalties must be > 0 (1 disables it), got "
                             f"{_bad_values(bad, repetition_penalties)}")
    chosen = resolve_backend(op, logits, (REFERENCE, TRITON), backend)
    if batch == 0 or vocab == 0:
        return logits.clone()
    prompt_counts = token_counts(prompt_token_ids, vocab)
    output_counts = token_counts(output_token_ids, vocab)
    if chosen == TRITON:
        from ascend_kernels.triton_kernels.sampling import apply_penalties_triton

        return apply_penalties_triton(logits, prompt_counts, output_counts, presence_penalties,
                                      frequency_penalties, repetition_penalties)
    return apply_penalties_reference(logits, prompt_counts, output_counts, presence_penalties,
                                     frequency_penalties, repetition_penalties)
