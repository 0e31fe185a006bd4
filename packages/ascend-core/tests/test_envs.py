"""The VLLM_ASCEND_* registry: lazy reads, strict parsing, removed and unknown variables."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from ascend_core import envs


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """No VLLM_ASCEND_* (or removed) variable leaks in from the machine running the tests."""
    for name in list(os.environ):
        if name.startswith("VLLM_ASCEND_") or name in envs.REMOVED:
            monkeypatch.delenv(name)
    monkeypatch.setattr(envs, "_already_warned", set())


# --- defaults and lazy reading -----------------------------------------------------------


def test_defaults_when_unset():
    assert envs.VLLM_ASCEND_TARGET == "auto"
    assert envs.VLLM_ASCEND_ROPE_UB_SIZE_KB == 0
    assert envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS == 64


def test_value_is_read_at_access_time_not_import_time(monkeypatch):
    assert envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS == 64
    monkeypatch.setenv("VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS", "2")
    assert envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS == 2
    monkeypatch.setenv("VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS", "0")
    assert envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS == 0
    monkeypatch.delenv("VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS")
    assert envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS == 64


def test_from_import_style_access(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "host")
    from ascend_core import envs as fresh

    assert fresh.VLLM_ASCEND_TARGET == "host"


def test_get_by_name_and_explicit_environ(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ROPE_UB_SIZE_KB", "256")
    assert envs.get("VLLM_ASCEND_ROPE_UB_SIZE_KB") == 256
    # An explicit mapping is read instead of os.environ.
    assert envs.get("VLLM_ASCEND_ROPE_UB_SIZE_KB", {"VLLM_ASCEND_ROPE_UB_SIZE_KB": "64"}) == 64
    assert envs.get("VLLM_ASCEND_ROPE_UB_SIZE_KB", {}) == 0


def test_empty_value_counts_as_unset(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ROPE_UB_SIZE_KB", "")
    assert envs.VLLM_ASCEND_ROPE_UB_SIZE_KB == 0
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "  ")
    assert envs.VLLM_ASCEND_TARGET == "auto"


def test_importing_envs_imports_no_third_party_package():
    code = (
        "import sys; import ascend_core.envs, ascend_core.config; "
        "bad = [m for m in ('torch', 'vllm', 'numpy', 'pydantic') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- VLLM_ASCEND_TARGET ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("auto", "auto"), ("npu", "npu"), ("host", "host"), ("NPU", "npu"), (" Host ", "host")],
)
def test_target_accepts_allowed_values_case_insensitively(monkeypatch, raw, expected):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", raw)
    assert envs.VLLM_ASCEND_TARGET == expected


def test_target_rejects_other_values_naming_value_and_allowed_set(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "cuda")
    with pytest.raises(ValueError) as info:
        _ = envs.VLLM_ASCEND_TARGET
    message = str(info.value)
    assert "VLLM_ASCEND_TARGET" in message
    assert "'cuda'" in message
    for allowed in ("auto", "npu", "host"):
        assert allowed in message
    assert isinstance(info.value, envs.EnvVarError)


def test_target_typo_gets_a_suggestion(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "hots")
    with pytest.raises(ValueError, match="Did you mean 'host'"):
        _ = envs.VLLM_ASCEND_TARGET


# --- bools (no registered switch is a bool now; the parser stays for the next one) ----------

SWITCH = envs.EnvVar("VLLM_ASCEND_SOME_SWITCH", "bool", True, "a switch")


@pytest.mark.parametrize("raw", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_bool_true_spellings(raw):
    assert SWITCH.read({SWITCH.name: raw}) is True


@pytest.mark.parametrize("raw", ["0", "false", "False", "NO", "off"])
def test_bool_false_spellings(raw):
    assert SWITCH.read({SWITCH.name: raw}) is False


@pytest.mark.parametrize("raw", ["2", "enabled", "y", "tru", "-1"])
def test_bool_rejects_anything_else(raw):
    with pytest.raises(ValueError) as info:
        SWITCH.read({SWITCH.name: raw})
    message = str(info.value)
    assert SWITCH.name in message
    assert repr(raw) in message
    assert "true/false" in message and "on/off" in message


# --- ints --------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["3", "-1"])
def test_int_choices_are_enforced(raw):
    mode = envs.EnvVar("VLLM_ASCEND_SOME_MODE", "int", 1, "a mode", choices=(0, 1, 2))
    with pytest.raises(ValueError) as info:
        mode.read({mode.name: raw})
    assert f"VLLM_ASCEND_SOME_MODE={raw!r}" in str(info.value)
    assert "0 | 1 | 2" in str(info.value)


def test_int_rejects_non_integers(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ROPE_UB_SIZE_KB", "192KB")
    with pytest.raises(ValueError, match=r"VLLM_ASCEND_ROPE_UB_SIZE_KB='192KB' is not an integer"):
        _ = envs.VLLM_ASCEND_ROPE_UB_SIZE_KB
    monkeypatch.setenv("VLLM_ASCEND_ROPE_UB_SIZE_KB", "1.5")
    with pytest.raises(ValueError, match="is not an integer"):
        _ = envs.VLLM_ASCEND_ROPE_UB_SIZE_KB


def test_rope_ub_size_must_not_be_negative(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ROPE_UB_SIZE_KB", "-8")
    with pytest.raises(ValueError) as info:
        _ = envs.VLLM_ASCEND_ROPE_UB_SIZE_KB
    assert "'-8'" in str(info.value) and ">= 0" in str(info.value)


def test_rope_ub_size_positive_override(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ROPE_UB_SIZE_KB", "256")
    assert envs.VLLM_ASCEND_ROPE_UB_SIZE_KB == 256


# --- unknown names -----------------------------------------------------------------------


def test_unknown_attribute_suggests_closest_registered_name():
    with pytest.raises(AttributeError) as info:
        _ = envs.VLLM_ASCEND_TARGE
    message = str(info.value)
    assert "VLLM_ASCEND_TARGE" in message
    assert "Did you mean 'VLLM_ASCEND_TARGET'?" in message


def test_get_unknown_name_suggests_closest():
    with pytest.raises(AttributeError, match="Did you mean 'VLLM_ASCEND_TARGET'"):
        envs.get("VLLM_ASCEND_TARGT")


def test_unrelated_missing_attribute_is_a_plain_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'not_there'"):
        _ = envs.not_there
    assert not hasattr(envs, "__wrapped__")


def test_removed_variable_attribute_says_what_replaces_it():
    with pytest.raises(AttributeError, match="VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE.*always on"):
        _ = envs.VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE


def test_dir_lists_registered_variables():
    listed = dir(envs)
    for name in envs.VARIABLES:
        assert name in listed


def test_unknown_variables_lists_set_unregistered_names(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_MLAP0", "1")
    monkeypatch.setenv("VLLM_ASCEND_TARGET", "host")  # registered
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE", "1")  # removed: warned elsewhere
    monkeypatch.setenv("VLLM_USE_V1", "1")  # not ours
    assert envs.unknown_variables() == ["VLLM_ASCEND_ENABLE_MLAP0"]
    assert envs.unknown_variables({"VLLM_ASCEND_B": "", "VLLM_ASCEND_A": "x"}) == [
        "VLLM_ASCEND_A",
        "VLLM_ASCEND_B",
    ]


# --- removed variables -------------------------------------------------------------------


def test_warn_removed_warns_once_per_set_variable_with_replacement(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", "/tmp/traces")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE", "1")
    with caplog.at_level(logging.WARNING, logger="ascend_core.envs"):
        messages = envs.warn_removed()
    assert len(messages) == 2
    assert [record.getMessage() for record in caplog.records] == messages
    profiler = next(m for m in messages if m.startswith("VLLM_TORCH_PROFILER_DIR"))
    assert "--profiler-config" in profiler
    assert '"torch_profiler_dir": "/tmp/traces"' in profiler
    dense = next(m for m in messages if m.startswith("VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE"))
    assert "always on" in dense


def test_warn_removed_is_idempotent(monkeypatch, caplog):
    monkeypatch.setenv("VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY", "1")
    with caplog.at_level(logging.WARNING, logger="ascend_core.envs"):
        first = envs.warn_removed()
        second = envs.warn_removed()
    assert len(first) == 1
    assert "torch_profiler_with_memory" in first[0]
    assert second == []
    assert len(caplog.records) == 1


def test_warn_removed_new_variable_later_still_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="ascend_core.envs"):
        assert envs.warn_removed({"VLLM_TORCH_PROFILER_DIR": "/a"}) != []
        later = envs.warn_removed(
            {"VLLM_TORCH_PROFILER_DIR": "/a", "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": "0"}
        )
    assert len(later) == 1 and later[0].startswith("VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE")
    assert len(caplog.records) == 2


def test_warn_removed_silent_when_nothing_removed_is_set(caplog):
    with caplog.at_level(logging.WARNING, logger="ascend_core.envs"):
        assert envs.warn_removed({"VLLM_ASCEND_TARGET": "host"}) == []
    assert caplog.records == []


# --- describe ----------------------------------------------------------------------------


def test_describe_lists_typed_documented_specs():
    specs = {spec.name: spec for spec in envs.describe()}
    assert set(specs) == set(envs.VARIABLES)
    assert specs["VLLM_ASCEND_TARGET"].type == "str"
    assert specs["VLLM_ASCEND_TARGET"].choices == ("auto", "npu", "host")
    assert specs["VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS"].type == "int"
    assert specs["VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS"].default == 64
    assert "192" in specs["VLLM_ASCEND_ROPE_UB_SIZE_KB"].doc
    for spec in specs.values():
        assert spec.doc.strip(), spec.name
        # Each default is what an unset variable reads as.
        assert spec.read({}) == spec.default


NEVER_IMPLEMENTED = ["VLLM_ASCEND_ENABLE_MLAPO", "VLLM_ASCEND_ENABLE_PREFETCH_MLP", "VLLM_ASCEND_ENABLE_FLASHCOMM1",
                     "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE"]


@pytest.mark.parametrize("name", NEVER_IMPLEMENTED)
def test_switches_that_changed_nothing_are_removed_and_warned_about(name, caplog):
    """Registered once though nothing read them (issue 18): set, they are warned about."""
    assert name not in envs.VARIABLES
    with caplog.at_level(logging.WARNING, logger="ascend_core.envs"):
        (message,) = envs.warn_removed({name: "1"})
    assert message.startswith(f"{name} is set but no longer has any effect: ")
    assert "not implemented here" in message and message.endswith(f"Unset {name}.")
    with pytest.raises(AttributeError, match="not implemented here"):
        getattr(envs, name)
