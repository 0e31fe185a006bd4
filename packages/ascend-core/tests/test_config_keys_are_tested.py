"""Every additional_config key has a test that shows it changing what the plugin does.

A key that is parsed and documented but read by nothing is a silently wrong deployment
(issue 18 found seven). This walks the schema (``AscendConfig.describe()``) and fails for
a key without an entry here, or whose entry names a test that does not exist.
"""

from pathlib import Path

import pytest

from ascend_core.config import AscendConfig

ROOT = Path(__file__).resolve().parents[3]

# key -> the tests (path from the repository root :: function) where setting it changes
# an outcome that is asserted.
BEHAVIOUR_TESTS = {
    "eplb_config.dynamic_eplb": [
        "tests/e2e/test_eplb.py::test_one_rank_rearranges_and_keeps_greedy_tokens",
        "tests/e2e/test_eplb.py::test_baseline_is_prompt_dependent",
    ],
    "eplb_config.expert_map_path": [
        "tests/e2e/test_eplb.py::test_one_rank_rearranges_and_keeps_greedy_tokens",
    ],
    "eplb_config.expert_heat_collection_interval": [
        "tests/e2e/test_eplb.py::test_heat_collection_phases",
        "packages/ascend-eplb/tests/test_eplb_runtime.py::test_execution_delay_and_interval",
    ],
    "eplb_config.algorithm_execution_interval": [
        "packages/ascend-eplb/tests/test_eplb_runtime.py::test_execution_delay_and_interval",
    ],
    "eplb_config.expert_map_record_path": [
        "tests/e2e/test_eplb.py::test_replans_are_recorded_as_expert_maps",
    ],
    "eplb_config.num_redundant_experts": [
        "tests/e2e/test_eplb.py::test_one_rank_rearranges_and_keeps_greedy_tokens",
    ],
    "eplb_config.policy": [
        "packages/ascend-eplb/tests/test_vllm_eplb_layer.py::test_start_up_errors",
    ],
    "eplb_config.heat_collection_phase": [
        "tests/e2e/test_eplb.py::test_heat_collection_phases",
    ],
    "rejection_sampler_config.backend": [
        "packages/ascend-specdec/tests/test_rejection_backend.py::"
        "test_a_forced_backend_verifies_through_the_softmax_ops",
        "packages/ascend-specdec/tests/test_vllm_rejection_sampler.py::"
        "test_factory_takes_the_configured_backend",
    ],
    "draft_length_config.dynamic": [
        "tests/e2e/test_draft_length.py::test_pinned_length_and_the_switch_off",
        "packages/ascend-specdec/tests/test_vllm_draft_length.py::test_left_to_vllm",
    ],
    "draft_length_config.min_num_speculative_tokens": [
        "tests/e2e/test_draft_length.py::test_pinned_length_and_the_switch_off",
        "packages/ascend-specdec/tests/test_draft_length.py::test_min_and_max_bound_every_choice",
    ],
    "draft_length_config.max_num_speculative_tokens": [
        "tests/e2e/test_draft_length.py::test_pinned_length_and_the_switch_off",
        "tests/e2e/test_draft_length.py::test_a_bound_above_the_configured_length_stops_the_start",
    ],
    "medusa_tree_config.paths": [
        "tests/e2e/test_medusa.py::"
        "test_tree_steps_keep_greedy_output_and_accept_more_than_the_chain",
        "tests/e2e/test_npu_target.py::"
        "test_medusa_tree_steps_on_npu_keep_greedy_tokens_and_logprobs",
    ],
    "medusa_tree_config.auto": [
        "tests/e2e/test_medusa.py::test_the_trainers_tree_serves_its_estimate_and_beats_the_chain",
    ],
    "enable_cpu_binding": [
        "tests/e2e/test_npu_target.py::test_tensor_parallel_2_over_hccl_equals_tp_1",
    ],
    "weight_nz_mode": [
        "packages/ascend-core/tests/test_weight_format.py::"
        "test_each_mode_casts_its_weights_and_outputs_stay",
        "tests/e2e/test_npu_target.py::test_weight_nz_mode_2_casts_every_float_linear_weight",
        "tests/e2e/test_npu_target.py::test_w8a8_checkpoint_on_npu_equals_the_host_target",
    ],
}


def test_every_key_has_a_behaviour_test_and_no_entry_is_stale():
    keys = {key.path for key in AscendConfig.describe()}
    untested = sorted(keys - set(BEHAVIOUR_TESTS))
    assert not untested, f"additional_config keys without a behaviour test: {untested}"
    assert not set(BEHAVIOUR_TESTS) - keys, "entries for keys the schema no longer has"


@pytest.mark.parametrize("key", sorted(BEHAVIOUR_TESTS))
def test_the_named_tests_exist(key):
    for where in BEHAVIOUR_TESTS[key]:
        path, _, function = where.partition("::")
        source = ROOT / path
        assert source.is_file(), f"{key}: {path} does not exist"
        assert f"def {function}(" in source.read_text(), f"{key}: no {function} in {path}"
