"""EAGLE / EAGLE-3 / MTP: registration under vLLM's method names and the draft check (no vLLM)."""

import pytest

import ascend_specdec
from ascend_core.registry import SPECULATIVE_PROPOSERS
from ascend_specdec.eagle import (
    EAGLE_METHODS,
    DraftConfigError,
    check_draft_against_target,
    eagle_proposer_factory,
)


def test_register_puts_eagle_eagle3_and_mtp_in_the_registry_idempotently():
    ascend_specdec.register()
    ascend_specdec.register()
    assert EAGLE_METHODS == ("eagle", "eagle3", "mtp")
    for method in EAGLE_METHODS:
        assert SPECULATIVE_PROPOSERS.get(method) is eagle_proposer_factory


def test_a_draft_reading_another_hidden_size_names_both_sizes():
    with pytest.raises(DraftConfigError) as error:
        check_draft_against_target(method="eagle", draft_reads_hidden_size=256,
                                   target_hidden_size=128, where="/drafts/x")
    message = str(error.value)
    assert "'eagle'" in message and "/drafts/x" in message
    assert "size 256 (hidden_size in its config.json)" in message
    assert "target model's hidden size is 128" in message
    with pytest.raises(DraftConfigError, match="target_hidden_size in its config.json"):
        check_draft_against_target(method="eagle3", draft_reads_hidden_size=64,
                                   target_hidden_size=128, where="d")
    check_draft_against_target(method="mtp", draft_reads_hidden_size=128,
                               target_hidden_size=128, where="d")
