"""AscendConfig: strict parsing of additional_config, migrations, host target, round trips."""

from __future__ import annotations

import dataclasses
import json
import logging
import os

import pytest

from ascend_core import config as config_module
from ascend_core.config import (
    EPLB_KEY_MIGRATION,
    REMOVED_KEYS,
    AscendConfig,
    AscendConfigError,
    DraftLengthConfig,
    EplbConfig,
    RejectionSamplerConfig,
    get_ascend_config,
    init_ascend_config,
    reset_ascend_config,
)


@pytest.fixture(autouse=True)
def clean_state(monkeypatch):
    for name in list(os.environ):
        if name.startswith("VLLM_ASCEND_"):
            monkeypatch.delenv(name)
    reset_ascend_config()
    yield
    reset_ascend_config()


def parse_error(additional_config, target="npu") -> AscendConfigError:
    with pytest.raises(AscendConfigError) as info:
        AscendConfig.from_dict(additional_config, target=target)
    return info.value


FULL = {
    "eplb_config": {
        "dynamic_eplb": True,
        "expert_map_path": "/maps/initial.json",
        "expert_heat_collection_interval": 200,
        "algorithm_execution_interval": 10,
        "expert_map_record_path": "/maps/record.json",
        "num_redundant_experts": 16,
        "policy": "swift",
        "heat_collection_phase": "decode",
    },
    "rejection_sampler_config": {"backend": "triton"},
    "draft_length_config": {"dynamic": True, "min_num_speculative_tokens": 1,
                            "max_num_speculative_tokens": 2},
    "medusa_tree_config": {"paths": [[0], [1], [0, 0]], "auto": False},
    "enable_cpu_binding": True,
    "weight_nz_mode": 2,
}


# --- defaults, shape, round trip ---------------------------------------------------------


def test_defaults():
    config = AscendConfig.from_dict(None)
    assert config == AscendConfig.from_dict({}) == AscendConfig()
    eplb = config.eplb_config
    assert eplb.dynamic_eplb is False
    assert eplb.expert_map_path is None
    assert eplb.expert_heat_collection_interval == 400
    assert eplb.algorithm_execution_interval == 30
    assert eplb.expert_map_record_path is None
    assert eplb.num_redundant_experts == 0
    assert eplb.policy == "default"
    assert eplb.heat_collection_phase == "all"
    assert config.rejection_sampler_config.backend == "auto"
    assert config.enable_cpu_binding is False


def test_full_config_parses_into_typed_sections():
    config = AscendConfig.from_dict(FULL)
    assert isinstance(config.eplb_config, EplbConfig)
    assert isinstance(config.rejection_sampler_config, RejectionSamplerConfig)
    assert config.eplb_config.num_redundant_experts == 16
    assert config.eplb_config.heat_collection_phase == "decode"
    assert config.rejection_sampler_config.backend == "triton"
    assert config.enable_cpu_binding is True


def test_partial_section_keeps_other_defaults():
    config = AscendConfig.from_dict({"eplb_config": {"num_redundant_experts": 2}})
    assert config.eplb_config == EplbConfig(num_redundant_experts=2)


def test_config_is_frozen():
    config = AscendConfig.from_dict(FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.enable_cpu_binding = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.eplb_config.policy = "other"  # type: ignore[misc]


def test_to_dict_round_trips_and_is_json():
    config = AscendConfig.from_dict(FULL)
    as_dict = config.to_dict()
    assert as_dict == FULL
    assert AscendConfig.from_dict(json.loads(json.dumps(as_dict))) == config
    default = AscendConfig.from_dict(None)
    assert AscendConfig.from_dict(default.to_dict()) == default


def test_valid_keys_per_level():
    assert AscendConfig.valid_keys() == tuple(FULL)
    assert EplbConfig.valid_keys() == tuple(FULL["eplb_config"])
    assert RejectionSamplerConfig.valid_keys() == ("backend",)
    assert DraftLengthConfig.valid_keys() == tuple(FULL["draft_length_config"])


def test_describe_lists_nested_keys_with_docs_and_npu_only_flags():
    keys = {key.path: key for key in AscendConfig.describe()}
    assert "eplb_config.heat_collection_phase" in keys
    assert keys["eplb_config.heat_collection_phase"].choices == ("all", "prefill", "decode")
    assert keys["eplb_config.expert_heat_collection_interval"].default == 400
    assert keys["eplb_config.expert_map_path"].type == "str | None"
    assert keys["rejection_sampler_config.backend"].choices == ("auto", "reference", "triton")
    assert keys["enable_cpu_binding"].npu_only is True
    assert keys["eplb_config.dynamic_eplb"].npu_only is False
    assert keys["rejection_sampler_config.backend"].npu_only is False
    assert all(key.doc for key in keys.values())


def test_error_is_a_value_error():
    assert issubclass(AscendConfigError, ValueError)


# --- unknown keys ------------------------------------------------------------------------


def test_unknown_top_level_key_lists_valid_keys_and_suggests():
    error = parse_error({"enable_cpu_bindng": True})
    message = str(error)
    assert "'enable_cpu_bindng'" in message
    assert "Did you mean 'enable_cpu_binding'?" in message
    for key in AscendConfig.valid_keys():
        assert key in message


@pytest.mark.parametrize(
    ("section", "typo", "meant"),
    [
        ("eplb_config", "num_redundant_expert", "num_redundant_experts"),
        ("eplb_config", "dynamic_eplp", "dynamic_eplb"),
        ("rejection_sampler_config", "backnd", "backend"),
    ],
)
def test_unknown_nested_key_names_path_valid_keys_and_suggestion(section, typo, meant):
    error = parse_error({section: {typo: 1}})
    message = str(error)
    assert f"'{section}.{typo}'" in message
    assert f"Did you mean '{meant}'?" in message
    section_class = type(getattr(AscendConfig(), section))
    assert ", ".join(section_class.valid_keys()) in message


def test_unknown_key_without_close_match_has_no_suggestion():
    message = str(parse_error({"zzz": 1}))
    assert "Did you mean" not in message
    assert "Valid keys in the top level" in message


# --- types: never coerced ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("additional_config", "path", "shown", "expected"),
    [
        ({"enable_cpu_binding": "true"}, "enable_cpu_binding", '"true" (str)', "boolean"),
        ({"enable_cpu_binding": 1}, "enable_cpu_binding", "1 (int)", "boolean"),
        ({"eplb_config": {"num_redundant_experts": True}}, "eplb_config.num_redundant_experts",
         "true (bool)", "integer"),
        ({"eplb_config": {"num_redundant_experts": 1.0}}, "eplb_config.num_redundant_experts",
         "1.0 (float)", "integer"),
        (
            {"eplb_config": {"num_redundant_experts": "3"}},
            "eplb_config.num_redundant_experts",
            '"3" (str)',
            "integer",
        ),
        ({"eplb_config": {"policy": 2}}, "eplb_config.policy", "2 (int)", "string"),
        ({"eplb_config": {"expert_map_path": 5}}, "eplb_config.expert_map_path", "5 (int)",
         "string or null"),
        ({"enable_cpu_binding": None}, "enable_cpu_binding", "null", "boolean"),
    ],
)
def test_wrong_type_names_path_value_and_expected_type(additional_config, path, shown, expected):
    message = str(parse_error(additional_config))
    assert f"'{path}'" in message
    assert shown in message
    assert expected in message


def test_wrong_type_hints_how_to_write_it():
    assert "without quotes: true" in str(parse_error({"enable_cpu_binding": "yes"}))
    assert "without quotes: false" in str(parse_error({"enable_cpu_binding": "off"}))
    assert "Write true, not 1" in str(parse_error({"enable_cpu_binding": 1}))
    assert "without quotes: 3" in str(parse_error({"eplb_config": {"num_redundant_experts": "3"}}))
    assert "not an integer" in str(parse_error({"eplb_config": {"num_redundant_experts": False}}))


def test_nullable_string_accepts_null():
    config = AscendConfig.from_dict({"eplb_config": {"expert_map_path": None}})
    assert config.eplb_config.expert_map_path is None


def test_section_must_be_a_mapping():
    message = str(parse_error({"eplb_config": True}))
    assert "'eplb_config'" in message and "true (bool)" in message
    assert "mapping" in message and "dynamic_eplb" in message


def test_additional_config_must_be_a_mapping():
    message = str(parse_error(["enable_cpu_binding"]))
    assert "mapping" in message and "(list)" in message


# --- allowed values and ranges -----------------------------------------------------------


def test_choice_error_lists_allowed_values_and_suggests():
    message = str(parse_error({"eplb_config": {"heat_collection_phase": "prefil"}}))
    assert "'eplb_config.heat_collection_phase'" in message
    assert '"prefil"' in message
    assert '"all", "prefill", "decode"' in message
    assert "Did you mean 'prefill'?" in message


def test_rejection_sampler_backend_choices():
    message = str(parse_error({"rejection_sampler_config": {"backend": "npu"}}))
    assert '"auto", "reference", "triton"' in message and '"npu"' in message
    for backend in ("auto", "reference", "triton"):
        config = AscendConfig.from_dict({"rejection_sampler_config": {"backend": backend}})
        assert config.rejection_sampler_config.backend == backend


@pytest.mark.parametrize(
    ("key", "value", "minimum"),
    [
        ("expert_heat_collection_interval", 0, 1),
        ("algorithm_execution_interval", -5, 1),
        ("num_redundant_experts", -1, 0),
    ],
)
def test_eplb_integer_minimums(key, value, minimum):
    message = str(parse_error({"eplb_config": {key: value}}))
    assert f"'eplb_config.{key}'" in message
    assert f">= {minimum}" in message and f"got {value}" in message


def test_expert_map_paths_must_be_json_files():
    message = str(parse_error({"eplb_config": {"expert_map_record_path": "/maps/out.txt"}}))
    assert "'eplb_config.expert_map_record_path'" in message
    assert ".json" in message and "/maps/out.txt" in message


def test_all_problems_are_reported_together():
    error = parse_error(
        {
            "enable_cpu_binding": "no",
            "eplb_config": {"dynamic_eplb": 7, "policy": 1, "typo_key": 0},
            "chunked_prefill_for_mla": True,
        }
    )
    assert len(error.problems) == 5
    message = str(error)
    assert message.startswith("5 problems in additional_config")
    for problem in error.problems:
        assert problem in message


# --- migrations from vllm-ascend's history -----------------------------------------------


# Keys this plugin once accepted although nothing implemented them (issue 18).
NEVER_IMPLEMENTED = {
    "ascend_compilation_config": ({"fuse_norm_quant": False}, "--compilation-config"),
    "enable_mlapo": (True, "unfused preprocess"),
    "mlapo_keep_prefill_weights": (True, "not implemented"),
    "dump_config_path": ("/cfg/dump.json", "PrecisionDebugger"),
    "dump_config": ({"path": "/cfg/dump.json"}, "PrecisionDebugger"),
    "mix_placement": (True, "plan_mix_placement"),
    "refresh": (True, "parses additional_config anew at every start"),
}


@pytest.mark.parametrize("key", sorted(NEVER_IMPLEMENTED))
def test_keys_that_changed_nothing_are_refused_with_a_migration_message(key):
    value, instead = NEVER_IMPLEMENTED[key]
    error = parse_error({key: value})
    assert len(error.problems) == 1
    message = str(error)
    assert f"additional_config key '{key}' was removed: " in message
    assert instead in message and message.endswith("Remove the key.")
    assert "\n" not in message
    assert key not in AscendConfig.valid_keys()


def test_mix_placement_is_refused_inside_eplb_config_too():
    message = str(parse_error({"eplb_config": {"mix_placement": True}}))
    assert "'eplb_config.mix_placement' was removed" in message
    assert "plan_mix_placement" in message and "mix_placement" not in EplbConfig.valid_keys()


def test_chunked_prefill_for_mla_was_removed():
    message = str(parse_error({"chunked_prefill_for_mla": True}))
    assert "'chunked_prefill_for_mla' was removed" in message
    assert "always on" in message


@pytest.mark.parametrize(
    ("key", "instead"),
    [("torchair_graph_config", "compilation_config"), ("ascend_scheduler_config", "scheduler")],
)
def test_removed_sections_say_what_to_use_instead(key, instead):
    message = str(parse_error({key: {"enabled": True}}))
    assert f"'{key}' was removed" in message
    assert instead in message
    assert key in REMOVED_KEYS


def test_eplb_key_migration_table():
    assert EPLB_KEY_MIGRATION["init_redundancy_expert"] == "num_redundant_experts"
    assert EPLB_KEY_MIGRATION["num_iterations_eplb_update"] == "expert_heat_collection_interval"
    assert EPLB_KEY_MIGRATION["num_wait_worker_iterations"] == "algorithm_execution_interval"
    assert EPLB_KEY_MIGRATION["eplb_policy_type"] == "policy"
    assert EPLB_KEY_MIGRATION["gate_eplb"] is None
    for key in EplbConfig.valid_keys():
        assert EPLB_KEY_MIGRATION[key] == key
    # No migrated key may collide with a real top-level key.
    assert not set(EPLB_KEY_MIGRATION) & set(AscendConfig.valid_keys())


@pytest.mark.parametrize(
    ("old", "value", "corrected"),
    [
        ("dynamic_eplb", True, {"dynamic_eplb": True}),
        ("expert_map_path", "/m.json", {"expert_map_path": "/m.json"}),
        ("expert_map_record_path", "/r.json", {"expert_map_record_path": "/r.json"}),
        ("init_redundancy_expert", 16, {"num_redundant_experts": 16}),
        ("num_iterations_eplb_update", 400, {"expert_heat_collection_interval": 400}),
        ("num_wait_worker_iterations", 30, {"algorithm_execution_interval": 30}),
        ("eplb_policy_type", "swift", {"policy": "swift"}),
        ("heat_collection_phase", "prefill", {"heat_collection_phase": "prefill"}),
    ],
)
def test_top_level_eplb_key_must_move_under_eplb_config(old, value, corrected):
    message = str(parse_error({old: value}))
    assert "belong under 'eplb_config'" in message
    assert f"'{old}' -> eplb_config.{next(iter(corrected))}" in message
    assert f'"eplb_config": {json.dumps(corrected)}' in message


def test_numbered_eplb_policy_type_maps_to_a_policy_name():
    message = str(parse_error({"eplb_policy_type": 2}))
    assert '"eplb_config": {"policy": "default"}' in message
    assert "not the number 2" in message


def test_gate_eplb_has_no_counterpart():
    message = str(parse_error({"gate_eplb": True, "dynamic_eplb": True}))
    assert "'gate_eplb' has no counterpart" in message
    assert '"eplb_config": {"dynamic_eplb": true}' in message


def test_misplaced_eplb_keys_merge_into_the_given_eplb_config():
    error = parse_error(
        {"eplb_config": {"dynamic_eplb": True}, "init_redundancy_expert": 8, "gate_eplb": False}
    )
    assert len(error.problems) == 1
    assert '"eplb_config": {"dynamic_eplb": true, "num_redundant_experts": 8}' in str(error)


def test_corrected_eplb_config_parses():
    """Following the message's advice gives a valid config with the same meaning."""
    message = str(parse_error({"num_iterations_eplb_update": 300, "init_redundancy_expert": 4}))
    corrected = json.loads("{" + message.split("Write instead: ", 1)[1] + "}")
    config = AscendConfig.from_dict(corrected)
    assert config.eplb_config.expert_heat_collection_interval == 300
    assert config.eplb_config.num_redundant_experts == 4


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("eplb_policy_type", "policy"),
        ("init_redundancy_expert", "num_redundant_experts"),
        ("eplb_heat_collection_stage", "heat_collection_phase"),
    ],
)
def test_old_names_inside_eplb_config_point_to_new_names(old, new):
    message = str(parse_error({"eplb_config": {old: "prefill"}}))
    assert f"'eplb_config.{old}'" in message
    assert f'"{new}"' in message


# --- targets -----------------------------------------------------------------------------


def test_npu_only_keys_are_ignored_on_host_with_one_log_line(caplog):
    given = {
        "enable_cpu_binding": True,
        "eplb_config": {"dynamic_eplb": True},
    }
    with caplog.at_level(logging.INFO, logger="ascend_core.config"):
        config = AscendConfig.from_dict(given, target="host")
    records = [r for r in caplog.records if r.name == "ascend_core.config"]
    assert len(records) == 1
    line = records[0].getMessage()
    assert "enable_cpu_binding" in line
    # Only keys that were given are listed; keys valid on host are not.
    assert "eplb_config" not in line
    # Ignored: npu-only keys keep their defaults; the rest applies.
    assert config.enable_cpu_binding is False
    assert config.eplb_config.dynamic_eplb is True


def test_host_without_npu_only_keys_logs_nothing(caplog):
    with caplog.at_level(logging.DEBUG, logger="ascend_core.config"):
        AscendConfig.from_dict({"eplb_config": {"dynamic_eplb": True}}, target="host")
    assert [r for r in caplog.records if r.name == "ascend_core.config"] == []


def test_npu_target_keeps_npu_only_keys_and_logs_nothing(caplog):
    with caplog.at_level(logging.DEBUG, logger="ascend_core.config"):
        config = AscendConfig.from_dict(FULL, target="npu")
    assert config.enable_cpu_binding is True
    assert [r for r in caplog.records if r.name == "ascend_core.config"] == []


def test_npu_only_keys_are_still_validated_on_host():
    message = str(parse_error({"enable_cpu_binding": "yes"}, target="host"))
    assert "enable_cpu_binding" in message


def test_unknown_target_is_rejected():
    with pytest.raises(ValueError, match="'auto'"):
        AscendConfig.from_dict({}, target="auto")


# --- process-wide config -----------------------------------------------------------------


def test_get_before_init_returns_defaults():
    assert get_ascend_config() == AscendConfig()


def test_init_stores_and_get_returns_it():
    stored = init_ascend_config({"eplb_config": {"dynamic_eplb": True}}, target="host")
    assert get_ascend_config() is stored
    assert get_ascend_config().eplb_config.dynamic_eplb is True
    replaced = init_ascend_config({"enable_cpu_binding": True}, target="npu")
    assert get_ascend_config() is replaced
    assert replaced.eplb_config.dynamic_eplb is False


def test_failed_init_keeps_previous_config():
    stored = init_ascend_config({"enable_cpu_binding": True})
    with pytest.raises(AscendConfigError):
        init_ascend_config({"enable_cpu_binding": 9})
    assert get_ascend_config() is stored


def test_reset_forgets_config():
    init_ascend_config({"enable_cpu_binding": True})
    reset_ascend_config()
    assert config_module._current is None
    assert get_ascend_config().enable_cpu_binding is False
