"""Hooks the platforms call on vLLM's config, kept import-light (vLLM loads on call)."""

from __future__ import annotations


def select_checkpoint_quantization(vllm_config) -> None:
    """Serve an msModelSlim folder with ``quantization="ascend"`` when none was given.

    Meant for the platforms' ``check_and_update_config`` (see ``ascend_quant.vllm.detect``).
    """
    from ascend_quant.vllm.detect import select_checkpoint_quantization as select

    select(vllm_config)
