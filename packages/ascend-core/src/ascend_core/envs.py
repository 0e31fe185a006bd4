"""The ``VLLM_ASCEND_*`` environment variables: one registry, typed, defaulted, documented.

Values are read from ``os.environ`` each time they are accessed, never at import, so a
variable set after ``import ascend_core.envs`` (or by a test's monkeypatch) takes effect::

    from ascend_core import envs
    envs.VLLM_ASCEND_TARGET           # "auto", "npu" or "host"
    envs.get("VLLM_ASCEND_TARGET")     # same lookup by name

An empty value counts as unset. A value that does not parse raises :class:`EnvVarError`
naming the variable, the value and what is allowed. A misspelt ``VLLM_ASCEND_*`` attribute
raises ``AttributeError`` with the closest registered name.

This module imports nothing outside the standard library and ascend_core.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ascend_core.suggest import did_you_mean

logger = logging.getLogger("ascend_core.envs")

PREFIX = "VLLM_ASCEND_"

_TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
_FALSE_WORDS = frozenset({"0", "false", "no", "off"})


class EnvVarError(ValueError):
    """An environment variable holds a value that does not parse."""


@dataclass(frozen=True)
class EnvVar:
    """The spec of one variable, as ``describe()`` lists it for the docs."""

    name: str
    type: str  # "bool", "int" or "str": the Python type of the parsed value
    default: Any
    doc: str
    choices: tuple[Any, ...] | None = None  # the only values allowed, if restricted
    minimum: int | None = None  # for ints: the smallest value allowed

    def parse(self, raw: str) -> Any:
        """The typed value of ``raw``; raises EnvVarError if it is not allowed."""
        text = raw.strip()
        if self.type == "bool":
            return _parse_bool(self.name, raw, text)
        if self.type == "int":
            value: Any = _parse_int(self.name, raw, text)
        else:
            value = text.lower() if self.choices else text
        if self.choices is not None and value not in self.choices:
            allowed = " | ".join(str(choice) for choice in self.choices)
            hint = " (case-insensitive)" if self.type == "str" else ""
            raise EnvVarError(
                f"{self.name}={raw!r} is not allowed: expected one of {allowed}{hint}."
                + did_you_mean(str(value), [str(choice) for choice in self.choices])
            )
        if self.minimum is not None and value < self.minimum:
            raise EnvVarError(
                f"{self.name}={raw!r} is not allowed: expected an integer >= {self.minimum}."
            )
        return value

    def read(self, environ: Mapping[str, str] | None = None) -> Any:
        """The variable's current value in ``environ`` (default: ``os.environ``)."""
        raw = (os.environ if environ is None else environ).get(self.name)
        if raw is None or not raw.strip():
            return self.default
        return self.parse(raw)


def _parse_bool(name: str, raw: str, text: str) -> bool:
    word = text.lower()
    if word in _TRUE_WORDS:
        return True
    if word in _FALSE_WORDS:
        return False
    raise EnvVarError(
        f"{name}={raw!r} is not a boolean: expected one of "
        "1/0, true/false, yes/no, on/off (case-insensitive)."
    )


def _parse_int(name: str, raw: str, text: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise EnvVarError(f"{name}={raw!r} is not an integer: expected e.g. {name}=1.") from None


_REGISTRY: tuple[EnvVar, ...] = (
    EnvVar(
        "VLLM_ASCEND_TARGET",
        "str",
        "auto",
        "Which platform the plugin activates. 'npu': Ascend NPU through torch_npu. "
        "'host': the same plugin stack on vLLM's CPU platform, for machines without an NPU. "
        "'auto': npu only when torch_npu imports and an NPU is visible, otherwise the plugin "
        "leaves vLLM's platform choice alone, so installing it never hijacks another machine.",
        choices=("auto", "npu", "host"),
    ),
    EnvVar(
        "VLLM_ASCEND_ROPE_UB_SIZE_KB",
        "int",
        0,
        "Unified Buffer size in KB used to size the tiles of the Triton rotary-embedding "
        "kernels. 0: detect it from the device properties, falling back to 192 KB (safe on "
        "910B / A3); a positive value overrides detection (for debugging UB overflows).",
        minimum=0,
    ),
    EnvVar(
        "VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS",
        "int",
        64,
        "MoE token communication under expert parallelism is chosen per batch: all-to-all "
        "(each token sent only to the ranks owning its experts) once the busiest rank holds "
        "at least this many tokens and top_k < the expert-parallel size, all-gather (every "
        "token to every rank) otherwise. Small batches are latency-bound, where all-to-all's "
        "extra count exchange costs more than the rows it saves. 0: all-to-all whenever "
        "top_k allows. The default is a starting point, not measured on HCCL.",
        minimum=0,
    ),
    EnvVar(
        "VLLM_ASCEND_ENABLE_NZ",
        "int",
        1,
        "Cast linear weights to the FRACTAL_NZ layout at load, which Ascend matmuls read "
        "fastest. 0: never; 1: the quantized weights whose matmul takes NZ (the default: NZ "
        "float weights are slower for some models); 2: those and the float linear weights. "
        "additional_config 'weight_nz_mode' takes precedence. npu only.",
        choices=(0, 1, 2),
    ),
)

VARIABLES: Mapping[str, EnvVar] = MappingProxyType({var.name: var for var in _REGISTRY})

# Variables that existed once (in vllm-ascend or vLLM) and no longer do anything:
# name -> what the user should do instead.
REMOVED: Mapping[str, str] = MappingProxyType(
    {
        "VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE": (
            "it was removed (vllm-ascend #5272): the dense-model optimisations it guarded are "
            "always on and need no switch. Unset VLLM_ASCEND_ENABLE_DENSE_OPTIMIZE."
        ),
        "VLLM_TORCH_PROFILER_DIR": (
            "it was replaced by vLLM's profiler config: pass "
            '--profiler-config \'{{"profiler": "torch", "torch_profiler_dir": "{value}"}}\' '
            "(profiler_config=... in Python) and unset VLLM_TORCH_PROFILER_DIR."
        ),
        "VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY": (
            "it was replaced by vLLM's profiler config: pass "
            '--profiler-config \'{{"profiler": "torch", "torch_profiler_with_memory": true}}\' '
            "(with your torch_profiler_dir) and unset VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY."
        ),
        # Switches this plugin once registered although nothing implemented them (issue 18).
        "VLLM_ASCEND_ENABLE_MLAPO": (
            "the fused MLA preprocess (MLAPO) is not implemented here; MLA models always run "
            "the unfused preprocess. Unset VLLM_ASCEND_ENABLE_MLAPO."
        ),
        "VLLM_ASCEND_ENABLE_PREFETCH_MLP": (
            "MLP weight prefetch is not implemented here. Unset VLLM_ASCEND_ENABLE_PREFETCH_MLP."
        ),
        "VLLM_ASCEND_ENABLE_FLASHCOMM1": (
            "FlashComm v1 is not implemented here; tensor-parallel layers all-reduce. "
            "Unset VLLM_ASCEND_ENABLE_FLASHCOMM1."
        ),
        "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": (
            "the fused matmul + all-reduce is not implemented here. "
            "Unset VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE."
        ),
    }
)

_already_warned: set[str] = set()


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The current value of the registered variable ``name``.

    Reads ``environ`` (default ``os.environ``) now. Raises AttributeError for a name that
    is not registered (with the closest one), EnvVarError for a value that does not parse.
    """
    var = VARIABLES.get(name)
    if var is None:
        raise AttributeError(_unknown_message(name))
    return var.read(environ)


def describe() -> list[EnvVar]:
    """The specs of all registered variables (name, type, default, doc, ...), for docs."""
    return list(_REGISTRY)


def warn_removed(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log one warning per removed variable that is set, saying what replaces it.

    Each variable is warned about once per process: a later call does not repeat it.
    Returns the messages logged by this call.
    """
    env = os.environ if environ is None else environ
    messages = []
    for name, instead in REMOVED.items():
        if name not in env or name in _already_warned:
            continue
        _already_warned.add(name)
        message = f"{name} is set but no longer has any effect: " + instead.format(value=env[name])
        logger.warning(message)
        messages.append(message)
    return messages


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """The ``VLLM_ASCEND_*`` variables that are set but neither registered nor removed.

    Sorted. Usually a typo; ``did_you_mean(name, VARIABLES)`` gives the likely intent.
    """
    env = os.environ if environ is None else environ
    return sorted(
        name
        for name in env
        if name.startswith(PREFIX) and name not in VARIABLES and name not in REMOVED
    )


def _unknown_message(name: str) -> str:
    if name in REMOVED:
        return f"{name} is no longer supported: " + REMOVED[name].format(value="<dir>")
    return (
        f"{name!r} is not a registered {PREFIX}* environment variable."
        + did_you_mean(name, VARIABLES)
        + f" Registered: {', '.join(VARIABLES)}."
    )


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name].read()
    if name.startswith(PREFIX) or name in REMOVED:
        raise AttributeError(_unknown_message(name))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(VARIABLES))
