"""EAGLE / EAGLE-3 / MTP: registration under vLLM's method names and the draft check (no vLLM)."""

import pytest
import torch
from safetensors.torch import save_file

import ascend_specdec
from ascend_core.registry import SPECULATIVE_PROPOSERS
from ascend_specdec.eagle import (
    EAGLE_METHODS,
    DraftConfigError,
    check_draft_against_target,
    check_draft_weights,
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


def _draft(folder, tensors: dict) -> str:
    folder.mkdir()
    save_file({name: torch.zeros(shape) for name, shape in tensors.items()},
              str(folder / "model.safetensors"))
    return str(folder)


def test_draft_weights_tell_eagle_from_eagle3_and_from_a_full_model(tmp_path):
    hidden = 128
    eagle = _draft(tmp_path / "eagle", {"fc.weight": (hidden, 2 * hidden)})
    eagle3 = _draft(tmp_path / "eagle3", {"fc.weight": (hidden, 3 * hidden), "d2t": (1024,)})
    full = _draft(tmp_path / "full", {"model.embed_tokens.weight": (2048, hidden),
                                      "lm_head.weight": (2048, hidden)})
    check_draft_weights(method="eagle", draft_folder=eagle, target_hidden_size=hidden)
    check_draft_weights(method="eagle3", draft_folder=eagle3, target_hidden_size=hidden)
    with pytest.raises(DraftConfigError, match=r"is an EAGLE-3 draft \(fc.weight \[128, 384\] "
                                               r"reads three hidden states of 128, with a d2t"):
        check_draft_weights(method="eagle", draft_folder=eagle3, target_hidden_size=hidden)
    with pytest.raises(DraftConfigError, match=r"is an EAGLE \(1\) draft.*method 'eagle'"):
        check_draft_weights(method="eagle3", draft_folder=eagle, target_hidden_size=hidden)
    for method in ("eagle", "eagle3"):
        with pytest.raises(DraftConfigError, match="is not an EAGLE draft.*no fc.weight"):
            check_draft_weights(method=method, draft_folder=full, target_hidden_size=hidden)
    # MTP layers live in the target's own checkpoint; hub names are left to vLLM.
    check_draft_weights(method="mtp", draft_folder=full, target_hidden_size=hidden)
    check_draft_weights(method="eagle", draft_folder="org/some-hub-draft",
                        target_hidden_size=hidden)
