"""vLLM-facing EPLB glue (imports vLLM): the MoE layer that serves a placement with
redundant experts, records expert load and applies rearrangements between steps.

``register_layers()`` puts ``AscendRoutedExperts`` into ascend-core's custom-op
registry under vLLM's ``RoutedExperts`` name; core registers it with vLLM (only when
an Ascend platform is active), so every MoE model vLLM builds gets it. It behaves as
vLLM's own layer unless ``eplb_config`` asks for EPLB (or expert parallelism runs on
the CPU, where vLLM's own MoE kernel cannot serve it).
"""

from __future__ import annotations

from ascend_core.registry import CUSTOM_OPS

__all__ = ["register_layers"]


def register_layers() -> None:
    """Register the EPLB MoE layer in ``ascend_core.registry.CUSTOM_OPS`` (idempotent)."""
    from ascend_eplb.vllm.routed_experts import AscendRoutedExperts

    CUSTOM_OPS.register("RoutedExperts", AscendRoutedExperts)
