"""ascend-specdec: see the package README for what it provides."""

from ascend_specdec.__about__ import __version__

__all__ = ["__version__", "register"]


def register() -> None:
    """Register this package's proposers in ascend-core's speculative registry.

    Idempotent (the same factory object each time). Imports no vLLM: a factory imports its
    vLLM-facing proposer class when a model runner calls it.
    """
    from ascend_core.registry import SPECULATIVE_PROPOSERS
    from ascend_specdec.medusa import medusa_proposer_factory

    SPECULATIVE_PROPOSERS.register("medusa", medusa_proposer_factory)
    from ascend_specdec.eagle import EAGLE_METHODS, eagle_proposer_factory

    for method in EAGLE_METHODS:
        SPECULATIVE_PROPOSERS.register(method, eagle_proposer_factory)
    _register_rejection_sampler()


def _register_rejection_sampler() -> None:
    """Our rejection sampler under core's "ascend" entry, used by both model runners."""
    from ascend_core.registry import REJECTION_SAMPLERS
    from ascend_specdec.rejection import rejection_sampler_factory

    REJECTION_SAMPLERS.register("ascend", rejection_sampler_factory)
