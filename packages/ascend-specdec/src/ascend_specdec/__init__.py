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
    from ascend_specdec.ngram import ngram_proposer_factory
    from ascend_specdec.suffix import suffix_proposer_factory

    SPECULATIVE_PROPOSERS.register("ngram", ngram_proposer_factory)
    SPECULATIVE_PROPOSERS.register("suffix", suffix_proposer_factory)
    _accept_suffix_method()
    from ascend_specdec.eagle import EAGLE_METHODS, eagle_proposer_factory

    for method in EAGLE_METHODS:
        SPECULATIVE_PROPOSERS.register(method, eagle_proposer_factory)
    _register_rejection_sampler()
    from ascend_core.registry import CONFIG_HOOKS

    CONFIG_HOOKS.register(DRAFT_LENGTH_HOOK, _install_draft_length_scheduler)
    CONFIG_HOOKS.register(MEDUSA_TREE_HOOK, _check_medusa_tree)
    from ascend_core.registry import REQUEST_CHECKS

    REQUEST_CHECKS.register(MEDUSA_TREE_HOOK, _check_medusa_tree_request)


# Core's CONFIG_HOOKS entry that puts the draft-length controller in vLLM's scheduler.
DRAFT_LENGTH_HOOK = "ascend_specdec.draft_length"


def _install_draft_length_scheduler(vllm_config) -> None:
    from ascend_specdec.vllm.draft_length import install_draft_length_scheduler

    install_draft_length_scheduler(vllm_config)


# Core's CONFIG_HOOKS and REQUEST_CHECKS entries for Medusa trees.
MEDUSA_TREE_HOOK = "ascend_specdec.medusa_tree"


def _check_medusa_tree(vllm_config) -> None:
    from ascend_specdec.vllm.medusa_tree import check_config

    check_config(vllm_config)


def _check_medusa_tree_request(params) -> None:
    from ascend_specdec.vllm.medusa_tree import check_request

    check_request(params)


def _register_rejection_sampler() -> None:
    """Our rejection sampler under core's "ascend" entry, used by both model runners."""
    from ascend_core.registry import REJECTION_SAMPLERS
    from ascend_specdec.rejection import rejection_sampler_factory

    REJECTION_SAMPLERS.register("ascend", rejection_sampler_factory)


def _accept_suffix_method() -> None:
    """vLLM refuses method "suffix" without arctic-inference while it builds its config; let it
    through where our platform serves it (see ascend_specdec.vllm.suffix_config). Only when
    vLLM is already loaded (it is, when it runs its plugins): register() itself imports no vLLM.
    """
    import sys

    if "vllm.config" in sys.modules:
        from ascend_specdec.vllm.suffix_config import accept_suffix_without_arctic_inference

        accept_suffix_without_arctic_inference()
