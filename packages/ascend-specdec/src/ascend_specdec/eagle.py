"""EAGLE, EAGLE-3 and MTP: the registry factory and the draft checks. Imports no vLLM.

The three methods share vLLM's drafting loop (a draft model fed the target's hidden states),
so one proposer class serves them; the factory imports it when a model runner asks.
"""

from __future__ import annotations

from typing import Any

EAGLE_METHODS = ("eagle", "eagle3", "mtp")


class DraftConfigError(ValueError):
    """A draft model that cannot run on this target."""


def check_draft_against_target(*, method: str, draft_reads_hidden_size: int,
                               target_hidden_size: int, where: str) -> None:
    """The draft must read hidden states of the target's width (its ``fc`` / ``eh_proj``)."""
    if draft_reads_hidden_size != target_hidden_size:
        key = "target_hidden_size" if method == "eagle3" else "hidden_size"
        raise DraftConfigError(
            f"speculative method {method!r}: the draft model {where} reads target hidden "
            f"states of size {draft_reads_hidden_size} ({key} in its config.json), but the "
            f"target model's hidden size is {target_hidden_size}. Use a draft trained for "
            "this target model."
        )


def eagle_proposer_factory(vllm_config: Any, device: Any, runner: Any) -> Any:
    """What ascend-core's model runners call for "eagle", "eagle3" and "mtp"."""
    from ascend_specdec.vllm.eagle_proposer import AscendEagleProposer

    return AscendEagleProposer(vllm_config, device, runner)
