"""Speculative proposers and the rejection sampler, chosen through core's registries, for
both model runners.

ascend-specdec registers a proposer factory per vLLM method name; a method with no
registered factory keeps the proposer vLLM's own model runner built. Likewise the
rejection sampler: the registered "ascend" one replaces vLLM's when there is one.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ascend_core.registry import REJECTION_SAMPLERS, SPECULATIVE_PROPOSERS

logger = logging.getLogger(__name__)

# The REJECTION_SAMPLERS entry the model runners use.
REJECTION_SAMPLER_NAME = "ascend"


# Where vLLM's model runner looks up the proposer class it builds for a method, while it is
# being built. For a registered method that proposer is replaced straight after, and building it
# costs (n-gram: a numba JIT warm-up) or fails (suffix: vLLM's needs arctic-inference).
_VLLM_PROPOSER_LOOKUPS = {
    "ngram": ("vllm.v1.spec_decode.ngram_proposer", "NgramProposer"),
    "suffix": ("vllm.v1.worker.gpu_model_runner", "SuffixDecodingProposer"),
}


class PendingProposer:
    """Stands in for vLLM's proposer until install_registered_proposer replaces it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass


@contextmanager
def vllm_proposer_deferred(vllm_config: Any) -> Iterator[None]:
    """While vLLM's runner ``__init__`` runs, skip building its proposer for a method that has
    a registered one (only the methods of ``_VLLM_PROPOSER_LOOKUPS``; others are cheap)."""
    spec_config = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec_config, "method", None)
    lookup = _VLLM_PROPOSER_LOOKUPS.get(method)
    if lookup is None or SPECULATIVE_PROPOSERS.find(method) is None:
        yield
        return
    module = importlib.import_module(lookup[0])
    original = getattr(module, lookup[1])
    setattr(module, lookup[1], PendingProposer)
    try:
        yield
    finally:
        setattr(module, lookup[1], original)


def create_registered_proposer(vllm_config: Any, device: Any, runner: Any) -> Any | None:
    """The registered proposer for the configured method, or None if there is none."""
    spec_config = getattr(vllm_config, "speculative_config", None)
    if spec_config is None:
        return None
    factory = SPECULATIVE_PROPOSERS.find(spec_config.method)
    if factory is None:
        return None
    return factory(vllm_config, device, runner)


def install_registered_proposer(runner: Any) -> str:
    """Replace ``runner.drafter`` with the registered proposer, if any.

    Returns where the proposer comes from ("ascend" or "vllm"), for logs and tests.
    """
    if not hasattr(runner, "drafter"):
        return "none"
    proposer = create_registered_proposer(runner.vllm_config, runner.device, runner)
    method = runner.vllm_config.speculative_config.method
    if proposer is None:
        logger.info("speculative method %r: using vLLM's proposer %s", method,
                    type(runner.drafter).__name__)
        return "vllm"
    runner.drafter = proposer
    logger.info("speculative method %r: using %s.%s from the Ascend registry", method,
                type(proposer).__module__, type(proposer).__qualname__)
    return "ascend"


def install_registered_rejection_sampler(runner: Any, name: str = REJECTION_SAMPLER_NAME) -> str:
    """Replace ``runner.rejection_sampler`` with the registered one, if any.

    The factory gets what vLLM's ``RejectionSampler`` is built from (the runner's sampler,
    the speculative config, the device) and may return None for a configuration it does
    not serve, which keeps vLLM's. Returns "ascend", "vllm", or "none" (no speculation).
    """
    if getattr(runner, "rejection_sampler", None) is None:
        return "none"
    spec_config = runner.vllm_config.speculative_config
    factory = REJECTION_SAMPLERS.find(name)
    sampler = None if factory is None else factory(runner.sampler, spec_config, runner.device)
    if sampler is None:
        why = ("none is registered" if factory is None
               else f"{_describe(factory)} declined this configuration")
        logger.info("rejection sampler: using vLLM's %s (%s under %r)",
                    type(runner.rejection_sampler).__name__, why, name)
        return "vllm"
    runner.rejection_sampler = sampler
    logger.info("rejection sampler: using %s from the Ascend registry (%r)",
                _describe(type(sampler)), name)
    return "ascend"


def _describe(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
