"""ascend_specdec.register() fills core's speculative registry, idempotently, without vLLM."""

import ascend_specdec
from ascend_core.registry import SPECULATIVE_PROPOSERS
from ascend_specdec.medusa import medusa_proposer_factory


def test_register_puts_medusa_in_the_registry_and_is_idempotent():
    ascend_specdec.register()
    ascend_specdec.register()
    assert SPECULATIVE_PROPOSERS.get("medusa") is medusa_proposer_factory
