"""Let vLLM's configuration accept ``method="suffix"`` where our proposer serves it.

vLLM 0.32 refuses the method while it builds ``SpeculativeConfig`` unless the
``arctic-inference`` package imports (``_validate_suffix_decoding`` asks
``vllm.config.speculative.has_arctic_inference``), which happens in the user's process before
any platform hook runs, so a core ``CONFIG_HOOKS`` entry would come too late. ``register()``
(vLLM's general-plugin entry point, which ``EngineArgs`` runs before it builds the config)
therefore wraps that one check: it also answers yes when the active platform is one of ours
(its model runner installs ``AscendSuffixProposer``, which needs no arctic-inference). With the
plugin inactive, or arctic-inference installed, vLLM's answer stands; every other check of
the suffix parameters stays vLLM's.
"""

from __future__ import annotations

from typing import Any


def ascend_platform_active() -> bool:
    from ascend_core.platform import active_target

    return active_target() is not None


def accept_suffix_without_arctic_inference() -> None:
    """Idempotent: wraps vLLM's arctic-inference check once per process."""
    import vllm.config.speculative as speculative

    check = speculative.has_arctic_inference
    if getattr(check, "ascend_suffix", False):
        return

    def has_arctic_inference_or_ascend_suffix(original: Any = check) -> bool:
        return bool(original()) or ascend_platform_active()

    has_arctic_inference_or_ascend_suffix.ascend_suffix = True  # type: ignore[attr-defined]
    speculative.has_arctic_inference = has_arctic_inference_or_ascend_suffix
