"""``AscendConfig``: the plugin's options, parsed from vLLM's ``additional_config``.

Users pass them as ``--additional-config '{"eplb_config": {"dynamic_eplb": true}}'`` (or
``LLM(..., additional_config={...})``). Every key is declared once, as a field of a frozen
dataclass below; the field's metadata (doc, allowed values, minimum, npu-only) drives both
validation and the docs (``AscendConfig.describe()``).

Parsing is strict, because a silently ignored key is a silently wrong deployment:

- unknown keys, at any level, are errors naming the valid keys and the closest one;
- values are never coerced: ``"yes"`` is not a bool, ``"3"`` is not an int, ``True`` is not
  an int;
- keys from vllm-ascend's history (renamed, moved under ``eplb_config``, removed) are
  errors that say what to write instead;
- all problems are reported together in one :class:`AscendConfigError`.

Keys that only mean something on an NPU are validated on the host target too (so a config
is checked wherever it is tried first), then ignored there with one log line.

This module imports nothing outside the standard library and ascend_core.
"""

from __future__ import annotations

import functools
import json
import logging
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType, UnionType
from typing import Any, ClassVar

from ascend_core.suggest import did_you_mean

logger = logging.getLogger("ascend_core.config")

TARGETS = ("npu", "host")


class AscendConfigError(ValueError):
    """``additional_config`` is invalid. ``problems`` lists every problem found."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        if len(problems) == 1:
            message = problems[0]
        else:
            items = "\n".join(f"  - {problem}" for problem in problems)
            message = f"{len(problems)} problems in additional_config:\n{items}"
        super().__init__(message)


def _meta(
    doc: str | None,
    *,
    choices: tuple[Any, ...] | None = None,
    minimum: int | None = None,
    suffix: str | None = None,
    npu_only: bool = False,
) -> dict[str, Any]:
    """The metadata of one ``additional_config`` key, which drives validation and docs."""
    return {
        "doc": doc or "",
        "choices": choices,
        "minimum": minimum,
        "suffix": suffix,
        "npu_only": npu_only,
    }


def _key(default: Any, doc: str, **checks: Any) -> Any:
    """Declare one scalar ``additional_config`` key as a dataclass field."""
    return field(default=default, metadata=_meta(doc, **checks))


@dataclass(frozen=True)
class ConfigKey:
    """One key as ``AscendConfig.describe()`` lists it for the docs."""

    path: str  # dotted, e.g. "eplb_config.dynamic_eplb"
    type: str  # e.g. "bool", "int", "str | None"
    default: Any
    doc: str
    choices: tuple[Any, ...] | None
    npu_only: bool


class _Section:
    """Behaviour shared by the top level and every nested section."""

    # Keys this section had under another name in vllm-ascend: old name -> current name.
    RENAMED: ClassVar[Mapping[str, str]] = MappingProxyType({})
    # Keys this section no longer has: key -> why, and what to do instead.
    REMOVED: ClassVar[Mapping[str, str]] = MappingProxyType({})

    @classmethod
    def valid_keys(cls) -> tuple[str, ...]:
        """The keys this section accepts, in declaration order."""
        return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        """Every key with its value, sections as nested dicts; ``from_dict`` reads it back."""
        result = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            result[f.name] = value.to_dict() if isinstance(value, _Section) else value
        return result


@dataclass(frozen=True)
class EplbConfig(_Section):
    """``eplb_config``: expert-parallel load balancing of MoE models."""

    RENAMED: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "init_redundancy_expert": "num_redundant_experts",
            "num_iterations_eplb_update": "expert_heat_collection_interval",
            "num_wait_worker_iterations": "algorithm_execution_interval",
            "eplb_policy_type": "policy",
            "eplb_heat_collection_stage": "heat_collection_phase",
        }
    )
    REMOVED: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            "mix_placement": (
                "serving keeps shared experts on every rank, as vLLM does; mixed placements "
                "are planned offline with ascend_eplb.mix_placement.plan_mix_placement"
            ),
        }
    )

    dynamic_eplb: bool = _key(
        False, "Rebalance experts while serving, from the expert load measured at run time."
    )
    expert_map_path: str | None = _key(
        None, "JSON file with the initial expert placement (static EPLB).", suffix=".json"
    )
    expert_heat_collection_interval: int = _key(
        400, "Forward steps over which expert load is collected before each rebalance.", minimum=1
    )
    algorithm_execution_interval: int = _key(
        30,
        "Forward steps the EPLB worker has to compute a new placement before it is applied.",
        minimum=1,
    )
    expert_map_record_path: str | None = _key(
        None, "Where to write the expert placement (JSON) after rebalancing.", suffix=".json"
    )
    num_redundant_experts: int = _key(
        0, "Extra expert replicas to place, beyond one per logical expert.", minimum=0
    )
    policy: str = _key(
        "default",
        "Name of the placement policy; policies are registered by ascend-eplb and the name "
        "is checked when EPLB starts.",
    )
    heat_collection_phase: str = _key(
        "all",
        "Which steps count towards the expert load: all, prefill or decode steps.",
        choices=("all", "prefill", "decode"),
    )


@dataclass(frozen=True)
class RejectionSamplerConfig(_Section):
    """``rejection_sampler_config``: how speculative-decoding drafts are verified."""

    backend: str = _key(
        "auto",
        "Kernel backend of the rejection sampler: 'reference' (torch, any device), 'triton', "
        "or 'auto' (the fastest one available on the device).",
        choices=("auto", "reference", "triton"),
    )


@dataclass(frozen=True)
class DraftLengthConfig(_Section):
    """``draft_length_config``: how many draft tokens a request gets per step when a
    speculative method is configured (ascend-specdec's controller, both targets)."""

    dynamic: bool = _key(
        False,
        "Choose the number of draft tokens every step, from min_num_speculative_tokens to "
        "max_num_speculative_tokens, from the step time per request measured at each length "
        "and the acceptance seen while serving. Off (the default until it meets its pass "
        "line in benchmarks/results/draft_length.md): every step drafts "
        "num_speculative_tokens, as vLLM does.",
    )
    min_num_speculative_tokens: int = _key(
        0, "The fewest draft tokens a decoding request gets in a step (dynamic only).",
        minimum=0,
    )
    max_num_speculative_tokens: int | None = _key(
        None,
        "The most draft tokens a request gets in a step (dynamic only); at most "
        "speculative_config's num_speculative_tokens, which it defaults to.",
        minimum=1,
    )


@dataclass(frozen=True)
class MedusaTreeConfig(_Section):
    """``medusa_tree_config``: Medusa's tree verification (speculative method "medusa")."""

    paths: list | None = _key(
        None,
        "The candidate tree each step verifies, as a list of paths: [0] is head 0's best "
        "candidate, [0, 1] head 1's second best after it; every prefix of a path must be "
        "in the list, a path at most as deep as the heads, indices 0-15. "
        "num_speculative_tokens must equal the number of paths. Unset (and auto off): one "
        "chain of every head's best candidate, as vLLM verifies.",
    )
    auto: bool = _key(
        False,
        "Verify the tree of num_speculative_tokens nodes that accepted the most tokens on the "
        "trainer's held-out prompts (medusa_paths.json, written by "
        "python -m ascend_specdec.train_medusa beside the heads); not with paths.",
    )


@dataclass(frozen=True)
class AscendConfig(_Section):
    """All plugin options from ``additional_config``; every key is optional."""

    eplb_config: EplbConfig = field(default_factory=EplbConfig, metadata=_meta(EplbConfig.__doc__))
    rejection_sampler_config: RejectionSamplerConfig = field(
        default_factory=RejectionSamplerConfig, metadata=_meta(RejectionSamplerConfig.__doc__)
    )
    draft_length_config: DraftLengthConfig = field(
        default_factory=DraftLengthConfig, metadata=_meta(DraftLengthConfig.__doc__)
    )
    medusa_tree_config: MedusaTreeConfig = field(
        default_factory=MedusaTreeConfig, metadata=_meta(MedusaTreeConfig.__doc__)
    )
    enable_cpu_binding: bool = _key(
        False,
        "Bind each NPU worker process (and the threads it starts) to its own share of the "
        "CPU cores it may use: one contiguous slice per local rank, within one NUMA node "
        "where the ranks fit.",
        npu_only=True,
    )
    weight_nz_mode: int | None = _key(
        None,
        "Cast linear weights to the FRACTAL_NZ layout at load (npu_format_cast), which "
        "Ascend matmuls read fastest: 0 never; 1 the quantized weights whose matmul takes NZ; "
        "2 those and the float linear weights. Unset: VLLM_ASCEND_ENABLE_NZ (default 1).",
        choices=(0, 1, 2),
        npu_only=True,
    )

    @classmethod
    def from_dict(
        cls, additional_config: Mapping[str, Any] | None, *, target: str = "npu"
    ) -> AscendConfig:
        """Parse and validate ``additional_config`` for ``target`` ("npu" or "host").

        Raises AscendConfigError listing every problem found.
        """
        if target not in TARGETS:
            raise ValueError(
                f"target must be one of {', '.join(TARGETS)}, got {target!r}; "
                "resolve VLLM_ASCEND_TARGET=auto to a concrete target first."
            )
        data: Mapping[str, Any] = additional_config if additional_config is not None else {}
        if not isinstance(data, Mapping):
            raise AscendConfigError(
                [f"additional_config must be a mapping (a JSON object), got {_show(data)}."]
            )
        problems = _legacy_problems(data)
        current = {key: value for key, value in data.items() if not _is_legacy(key)}
        given: list[str] = []
        values = _parse_fields(cls, current, "", problems, given)
        if problems:
            raise AscendConfigError(problems)
        if target == "host":
            _drop_npu_only(values, given)
        return cls(**values)

    @classmethod
    def describe(cls) -> list[ConfigKey]:
        """Every key, nested ones included (dotted paths), for the docs."""
        return _describe_section(cls, "", inherited_npu_only=False)


_NO_DUMPS = ("msprobe precision dumps are not built in; start msprobe's PrecisionDebugger "
             "around the model in your own script instead")

# Keys vllm-ascend had at the top level that this plugin removed: key -> what to do instead.
REMOVED_KEYS: Mapping[str, str] = MappingProxyType(
    {
        "chunked_prefill_for_mla": (
            "chunked prefill for MLA models is always on; there is nothing to set"
        ),
        "torchair_graph_config": (
            "TorchAir graph mode is gone; graph capture is set with vLLM's compilation_config "
            '(e.g. --compilation-config \'{"cudagraph_mode": "FULL_DECODE_ONLY"}\') and '
            "fusion passes with ascend_compilation_config"
        ),
        "ascend_scheduler_config": (
            "the Ascend scheduler is gone; vLLM's own scheduler runs with its defaults, tuned "
            "with vLLM's scheduler options (--max-num-batched-tokens, --enable-chunked-prefill, "
            "--max-num-seqs)"
        ),
        # Keys this plugin once accepted although nothing implemented them (issue 18).
        "ascend_compilation_config": (
            "this plugin runs no graph fusion passes of its own; vLLM's compilation passes run "
            "as --compilation-config sets them"
        ),
        "enable_mlapo": (
            "the fused MLA preprocess (MLAPO) is not implemented here; MLA models always run "
            "the unfused preprocess"
        ),
        "mlapo_keep_prefill_weights": (
            "the fused MLA preprocess (MLAPO) is not implemented here, so there are no extra "
            "weights to keep"
        ),
        "refresh": (
            "this plugin parses additional_config anew at every start, which is what refresh "
            "asked vllm-ascend to do, so there is nothing to set"
        ),
        "dump_config_path": _NO_DUMPS,
        "dump_config": _NO_DUMPS,  # vllm-ascend's older name of dump_config_path
        "mix_placement": EplbConfig.REMOVED["mix_placement"],
    }
)

# EPLB keys that vllm-ascend read at the top level of additional_config: old key -> its key
# under eplb_config (None: no counterpart). The eplb_config keys themselves are in it too.
EPLB_KEY_MIGRATION: Mapping[str, str | None] = MappingProxyType(
    {
        **{key: key for key in EplbConfig.valid_keys()},
        **EplbConfig.RENAMED,
        "gate_eplb": None,  # rebalanced only once; this plugin always keeps rebalancing
    }
)

def _is_legacy(key: Any) -> bool:
    return key in REMOVED_KEYS or key in EPLB_KEY_MIGRATION


def _legacy_problems(data: Mapping[str, Any]) -> list[str]:
    """Migration messages for keys from vllm-ascend's history, in the order given."""
    problems = [
        f"additional_config key {key!r} was removed: {REMOVED_KEYS[key]}. Remove the key."
        for key in data
        if key in REMOVED_KEYS
    ]
    misplaced = [key for key in data if key in EPLB_KEY_MIGRATION]
    if misplaced:
        problems.append(_misplaced_eplb_problem(data, misplaced))
    return problems


def _misplaced_eplb_problem(data: Mapping[str, Any], misplaced: list[str]) -> str:
    nested = data.get("eplb_config")
    corrected = dict(nested) if isinstance(nested, Mapping) else {}
    moves = []
    for old in misplaced:
        new = EPLB_KEY_MIGRATION[old]
        if new is None:
            moves.append(f"{old!r} has no counterpart (it made EPLB rebalance only once): drop it")
            continue
        corrected[new], note = _migrated_value(new, data[old])
        moves.append(f"{old!r} -> eplb_config.{new}{note}")
    return (
        "EPLB options belong under 'eplb_config', not at the top level of additional_config: "
        + "; ".join(moves)
        + f'. Write instead: "eplb_config": {json.dumps(corrected, default=repr)}'
    )


def _migrated_value(new_key: str, value: Any) -> tuple[Any, str]:
    """The value to write under ``new_key`` for an old key's ``value``, and a note on it."""
    if new_key == "policy" and not isinstance(value, str):
        # vllm-ascend numbered its policies; here policies are registered by name.
        default = EplbConfig().policy
        return default, f" (a policy name now, e.g. {default!r}, not the number {value!r})"
    return value, ""


def _parse_fields(
    cls: type[_Section],
    data: Mapping[str, Any],
    path: str,
    problems: list[str],
    given: list[str],
) -> dict[str, Any]:
    """Checked values of ``cls``'s keys present in ``data``; problems are appended.

    Nested sections are built here; the returned dict holds only keys present in ``data``.
    ``given`` collects the dotted paths of the keys that were explicitly set.
    """
    declared = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    hints = _type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in data.items():
        where = f"{path}.{key}" if path else str(key)
        spec = declared.get(key) if isinstance(key, str) else None
        if spec is None:
            problems.append(_unknown_key_problem(cls, key, value, path))
            continue
        expected, nullable = _expected_type(hints[key])
        if isinstance(expected, type) and issubclass(expected, _Section):
            if not isinstance(value, Mapping):
                problems.append(
                    f"additional_config key {where!r} must be a mapping (a JSON object) of "
                    f"{key} options, got {_show(value)}. Valid keys in it: "
                    f"{', '.join(expected.valid_keys())}."
                )
                continue
            before = len(problems)
            section_values = _parse_fields(expected, value, where, problems, given)
            if len(problems) == before:
                values[key] = expected(**section_values)
            given.append(where)
            continue
        problem = _value_problem(spec.metadata, expected, nullable, value, where)
        if problem is None:
            values[key] = value
            given.append(where)
        else:
            problems.append(problem)
    return values


def _unknown_key_problem(cls: type[_Section], key: Any, value: Any, path: str) -> str:
    valid = cls.valid_keys()
    where = f"{path}.{key}" if path else str(key)
    level = f"'{path}'" if path else "the top level of additional_config"
    if key in cls.RENAMED:
        new = cls.RENAMED[key]
        corrected, note = _migrated_value(new, value)
        return (
            f"additional_config key {where!r} is vllm-ascend's old name of '{new}'{note}. "
            f"Write instead: {json.dumps(new)}: {json.dumps(corrected, default=repr)}"
        )
    if key in cls.REMOVED:
        return f"additional_config key {where!r} was removed: {cls.REMOVED[key]}. Remove the key."
    if not isinstance(key, str):
        return f"additional_config keys must be strings, got {key!r} in {level}."
    return (
        f"Unknown additional_config key {where!r}."
        + did_you_mean(key, valid)
        + f" Valid keys in {level}: {', '.join(valid)}."
    )


def _value_problem(
    metadata: Mapping[str, Any], expected: type, nullable: bool, value: Any, where: str
) -> str | None:
    """What is wrong with ``value`` for this key, or None if it is valid."""
    if value is None:
        if nullable:
            return None
        return f"additional_config key {where!r} must be {_type_name(expected)}, got null."
    if not _is_instance(value, expected):
        wanted = _type_name(expected) + (" or null" if nullable else "")
        return (
            f"additional_config key {where!r} must be {wanted}, got {_show(value)}."
            + _type_hint(expected, value)
        )
    choices = metadata["choices"]
    if choices is not None and value not in choices:
        allowed = ", ".join(json.dumps(choice) for choice in choices)
        suggestion = did_you_mean(value, choices) if isinstance(value, str) else ""
        return (
            f"additional_config key {where!r} must be one of {allowed}, got {_show(value)}."
            + suggestion
        )
    minimum = metadata["minimum"]
    if minimum is not None and value < minimum:
        return f"additional_config key {where!r} must be an integer >= {minimum}, got {value}."
    suffix = metadata["suffix"]
    if suffix is not None and not value.endswith(suffix):
        return f"additional_config key {where!r} must name a {suffix} file, got {_show(value)}."
    return None


def _is_instance(value: Any, expected: type) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, expected)


_TYPE_NAMES = {bool: "a boolean (true or false)", int: "an integer", str: "a string"}


def _type_name(expected: type) -> str:
    return _TYPE_NAMES.get(expected, expected.__name__)


def _type_hint(expected: type, value: Any) -> str:
    """A hint on how to write ``value`` as ``expected``, for the common slips."""
    if expected is bool and isinstance(value, str):
        word = value.strip().lower()
        if word in ("true", "yes", "on", "1", "false", "no", "off", "0"):
            meant = "true" if word in ("true", "yes", "on", "1") else "false"
            return f" Write a JSON boolean without quotes: {meant}."
    if expected is bool and isinstance(value, int) and value in (0, 1):
        return f" Write {'true' if value else 'false'}, not {value}."
    if expected is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return f" Write the number without quotes: {int(value)}."
    if expected is int and isinstance(value, bool):
        return " A boolean is not an integer here."
    if expected is int and isinstance(value, float) and value.is_integer():
        return f" Write it as a whole number: {int(value)}."
    return ""


def _show(value: Any) -> str:
    """``value`` as the user wrote it, with its type."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return f"{text} ({type(value).__name__})"


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _expected_type(hint: Any) -> tuple[type, bool]:
    """(the type a key's value must have, whether null is allowed)."""
    if isinstance(hint, UnionType) or typing.get_origin(hint) is typing.Union:
        members = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return members[0], len(members) < len(typing.get_args(hint))
    return hint, False


def _npu_only_fields() -> list[str]:
    return [f.name for f in fields(AscendConfig) if f.metadata["npu_only"]]


def _drop_npu_only(values: dict[str, Any], given: list[str]) -> None:
    """On the host target npu-only keys keep their defaults; say once which were given."""
    npu_only = _npu_only_fields()
    ignored = [path for path in given if path in npu_only]
    for name in npu_only:
        values.pop(name, None)
    if ignored:
        logger.warning(
            "Ignoring additional_config keys that only apply on an NPU (target is host): %s",
            ", ".join(ignored),
        )


def _describe_section(
    cls: type[_Section], path: str, *, inherited_npu_only: bool
) -> list[ConfigKey]:
    hints = _type_hints(cls)
    defaults = cls()  # type: ignore[call-arg]
    keys = []
    for f in fields(cls):  # type: ignore[arg-type]
        where = f"{path}.{f.name}" if path else f.name
        npu_only = inherited_npu_only or f.metadata["npu_only"]
        expected, nullable = _expected_type(hints[f.name])
        if isinstance(expected, type) and issubclass(expected, _Section):
            keys.extend(_describe_section(expected, where, inherited_npu_only=npu_only))
            continue
        type_name = expected.__name__ + (" | None" if nullable else "")
        keys.append(
            ConfigKey(
                where,
                type_name,
                getattr(defaults, f.name),
                f.metadata["doc"],
                f.metadata["choices"],
                npu_only,
            )
        )
    return keys


_current: AscendConfig | None = None


def init_ascend_config(
    additional_config: Mapping[str, Any] | None, target: str = "npu"
) -> AscendConfig:
    """Parse ``additional_config`` for ``target`` and make it the process-wide config."""
    global _current
    _current = AscendConfig.from_dict(additional_config, target=target)
    return _current


def get_ascend_config() -> AscendConfig:
    """The config set by ``init_ascend_config``; if it was not called, the defaults."""
    if _current is not None:
        return _current
    return AscendConfig.from_dict(None)


def reset_ascend_config() -> None:
    """Forget the process-wide config (for tests and engine restarts in one process)."""
    global _current
    _current = None
