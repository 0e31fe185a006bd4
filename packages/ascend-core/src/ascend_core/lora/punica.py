"""vLLM's multi-LoRA layers on the plugin's kernels: the Punica wrapper of both targets.

vLLM keeps every loaded adapter's weights stacked per layer (one slot per adapter, up to
``max_loras``) and, each step, maps every token to its request's slot
(``PunicaWrapperBase.update_metadata``, slot -1 for a request without an adapter). The
layers then call the wrapper's ``add_*`` methods; this wrapper runs them on
``ascend_kernels.lora_shrink`` / ``lora_expand``, which pick Triton (triton-ascend) for npu
tensors and the torch reference on the host. Platforms name it through
``get_punica_wrapper``.

Nothing here depends on the step's data on the host, so a FULL decode graph captures it:
prefill and decode take the same ops (vLLM's prefill/decode split of the CPU wrapper only
chooses between its kernels), and the slot index tensors are read as views of vLLM's
persistent buffers, as long as the step's (padded) token count. Those buffers start at -1
here, so padding rows never name a slot that was not loaded.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase

from ascend_kernels import lora_expand, lora_shrink


class AscendPunicaWrapper(PunicaWrapperBase):
    def __init__(self, max_num_batched_tokens: int, max_batches: int,
                 device: torch.device | str, **kwargs: Any) -> None:
        super().__init__(max_num_batched_tokens, max_batches, device)
        for buffer in (self._token_lora_indices, self._sampler_indices):
            buffer.fill_(-1)

    def update_metadata(self, mapping, lora_index_to_id: list[int | None], max_loras: int,
                        vocab_size: int, **kwargs: Any) -> None:
        """The step's slots into vLLM's buffers. vLLM's prefill metadata (token runs per
        adapter, for the CPU and GPU wrappers' segment kernels) is not computed: these ops
        take the per-token slots, and that computation syncs with the device every step.
        ``no_lora`` comes from the host-side mapping (adapter id 0 = none): a step without
        any adapter skips the LoRA ops, as vLLM's wrappers do. A FULL graph captured with
        adapters keeps them (vLLM captures with warm-up adapters active)."""
        self._update_base_metadata(mapping, lora_index_to_id, max_loras, vocab_size)
        self.is_prefill = mapping.is_prefill
        self.no_lora = max(mapping.index_mapping, default=0) <= 0

    def _token_slots(self, tokens: int) -> torch.Tensor:
        """Each token's slot; rows past this step's tokens (graph padding) read whatever an
        earlier step left, -1 or a loaded slot, and are discarded by the caller."""
        return self._token_lora_indices[:tokens]

    def _sampler_slots(self, rows: int) -> torch.Tensor:
        return self._sampler_indices[:rows]

    def add_shrink(self, y: tuple[torch.Tensor, ...] | torch.Tensor, x: torch.Tensor,
                   lora_a_stacked: tuple[torch.Tensor, ...], scale: float,
                   **kwargs: Any) -> None:
        """``y[i] = scale * x @ lora_a_stacked[i]`` per slice, each token with its slot's
        weights (rows of tokens without an adapter are zero)."""
        if self.no_lora:
            return
        x = x.view(-1, x.shape[-1])
        slots = self._token_slots(x.shape[0])
        for index, lora_a in enumerate(lora_a_stacked):
            out = y[index]
            lora_shrink(x, lora_a, out.view(-1, out.shape[-1]), slots, scale)

    def add_expand(self, y: torch.Tensor, x: tuple[torch.Tensor, ...] | torch.Tensor,
                   lora_b_stacked: tuple[torch.Tensor, ...], output_slices: tuple[int, ...],
                   offset_start: int = 0, add_inputs: bool = True, **kwargs: Any) -> None:
        """``y[:, offset:offset+slice_i] += x[i] @ lora_b_stacked[i]``, slice after slice."""
        if self.no_lora:
            return
        out = y.view(-1, y.shape[-1])
        slots = self._token_slots(out.shape[0])
        offset = offset_start
        for index, lora_b in enumerate(lora_b_stacked):
            lora_expand(x[index].view(out.shape[0], -1), lora_b, out, slots, offset,
                        add_inputs)
            offset += output_slices[index]

    def add_lora_embedding(self, y: torch.Tensor, x: torch.Tensor,
                           lora_b_stacked: torch.Tensor, add_inputs: bool = True,
                           **kwargs: Any) -> None:
        if self.no_lora:
            return
        out = y.view(-1, y.shape[-1])
        lora_expand(x.view(out.shape[0], -1), lora_b_stacked, out,
                    self._token_slots(out.shape[0]), 0, add_inputs)

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor,
                        lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float,
                        output_slices: tuple[int, ...], *,
                        buffer: tuple[torch.Tensor, ...] | None = None,
                        **kwargs: Any) -> None:
        if not len(lora_a_stacked) == len(lora_b_stacked) == len(output_slices):
            raise ValueError(f"add_lora_linear: {len(lora_a_stacked)} lora_a slices, "
                             f"{len(lora_b_stacked)} lora_b slices and {len(output_slices)} "
                             "output slices; they must be as many")
        if self.no_lora:
            return
        if buffer is None:
            rank = lora_b_stacked[0].size(-1)
            buffer = tuple(torch.empty(x.size(0), rank, dtype=torch.float32, device=x.device)
                           for _ in output_slices)
        self.add_shrink(buffer, x, lora_a_stacked, scale)
        self.add_expand(y, buffer, lora_b_stacked, output_slices)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale: float, *,
                        buffer: torch.Tensor | None = None, **kwargs: Any) -> None:
        """The logits rows are one per sampled token, mapped by the sampler's slots."""
        if self.no_lora:
            return
        out = y.view(-1, y.shape[-1])
        x = x.view(-1, x.shape[-1])
        slots = self._sampler_slots(x.shape[0])
        if buffer is None:
            buffer = torch.empty(x.size(0), lora_b_stacked.size(-1), dtype=torch.float32,
                                 device=x.device)
        lora_shrink(x, lora_a_stacked, buffer, slots, scale)
        lora_expand(buffer, lora_b_stacked, out, slots, 0, True)

    def apply_lora_full_linear(self, y: torch.Tensor, x: torch.Tensor,
                               weight_stacked: torch.Tensor, bias_stacked: torch.Tensor,
                               module_enabled: torch.Tensor) -> None:
        """Rows of requests whose adapter replaces this linear layer whole take its output."""
        if self.no_lora:
            return
        adapter_y = torch.empty(x.size(0), weight_stacked.size(-2), dtype=torch.float32,
                                device=x.device)
        lora_shrink(x, weight_stacked, adapter_y, self._sampler_slots(x.size(0)), 1.0)
        y.copy_(self._select_full_linear_output(y, adapter_y, bias_stacked, module_enabled))
