"""Speculative proposers chosen through core's registry, for both model runners.

ascend-specdec registers a factory per vLLM method name; a method with no
registered factory keeps the proposer vLLM's own model runner built.
"""

from __future__ import annotations

import logging
from typing import Any

from ascend_core.registry import SPECULATIVE_PROPOSERS

logger = logging.getLogger(__name__)


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
