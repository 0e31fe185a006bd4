"""Expert load recording: per MoE layer, per logical expert, token counts over a
sliding window of forward steps.

The MoE layers call ``record`` with the logical experts each token was routed to (and,
when known, which tokens are prefill tokens); the serving loop calls ``end_step`` once
per forward step. A step enters the window only if it had tokens of the recorded phase
(``all``, ``prefill`` or ``decode``), so e.g. a decode-only window is not flushed by a
burst of prefill steps. ``window_load()`` is the ``[layers, experts]`` load a policy
plans from.
"""

from __future__ import annotations

import torch

from ascend_eplb.validation import positive_int

__all__ = ["PHASES", "ExpertLoadRecorder"]

PHASES = ("all", "prefill", "decode")


class ExpertLoadRecorder:
    """Token counts per (layer, logical expert) over the last ``window_steps`` steps."""

    def __init__(
        self, num_layers: int, num_experts: int, window_steps: int, phase: str = "all"
    ) -> None:
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
            raise ValueError(f"num_layers must be an integer >= 0, got {num_layers!r}")
        self.num_layers = num_layers
        self.num_experts = positive_int("num_experts", num_experts)
        self.window_steps = positive_int("window_steps", window_steps)
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)}, got {phase!r}")
        self.phase = phase
        # Ring of committed steps; row ``steps_committed % window_steps`` is the oldest.
        self._window = torch.zeros(self.window_steps, num_layers, num_experts, dtype=torch.int64)
        self._pending = torch.zeros(num_layers, num_experts, dtype=torch.int64)
        self.steps_committed = 0  # steps that entered the window, ever
        self.steps_seen = 0  # steps ended, whether or not they entered the window

    def record(
        self,
        layer: int,
        expert_ids: torch.Tensor,
        prefill_mask: torch.Tensor | None = None,
    ) -> None:
        """Count the tokens of one MoE layer in the current step.

        Args:
            layer: MoE layer index in ``[0, num_layers)``.
            expert_ids: [tokens, top_k] logical expert of each (token, choice); ids
                outside ``[0, num_experts)`` (e.g. -1 for dropped choices) are ignored.
            prefill_mask: [tokens] bool, True for prefill tokens. Needed for the
                ``prefill`` and ``decode`` phases; without it those phases record
                nothing from this call.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer must be in [0, {self.num_layers}), got {layer}")
        ids = expert_ids
        if ids.dim() == 1:
            ids = ids.unsqueeze(-1)
        if self.phase != "all":
            if prefill_mask is None:
                return
            keep = prefill_mask if self.phase == "prefill" else ~prefill_mask
            ids = ids[keep.to(device=ids.device, dtype=torch.bool)]
        ids = ids.reshape(-1).to(device="cpu", dtype=torch.int64)
        ids = ids[(ids >= 0) & (ids < self.num_experts)]
        if ids.numel():
            self._pending[layer] += torch.bincount(ids, minlength=self.num_experts)

    def end_step(self) -> bool:
        """Close the current step; returns whether it entered the window."""
        self.steps_seen += 1
        if not bool(self._pending.any()):
            return False
        self._window[self.steps_committed % self.window_steps] = self._pending
        self._pending.zero_()
        self.steps_committed += 1
        return True

    def window_load(self) -> torch.Tensor:
        """[layers, experts] int64: tokens per expert over the window's steps."""
        return self._window.sum(0)

    @property
    def steps_in_window(self) -> int:
        return min(self.steps_committed, self.window_steps)

    def reset(self) -> None:
        self._window.zero_()
        self._pending.zero_()
        self.steps_committed = 0
        self.steps_seen = 0
