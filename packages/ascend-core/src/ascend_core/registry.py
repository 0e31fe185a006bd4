"""Extension registries that the leaf packages fill (dependency inversion).

Core defines what can be extended; ascend-specdec, ascend-quant and ascend-eplb
register their implementations from their ``register()`` functions, which the
meta package calls from vLLM's plugin entry points. vLLM loads plugins once per
process, in several processes, so registering the same entry twice is a no-op;
registering a *different* entry under a taken name is an error, because silently
replacing one implementation with another is how wrong results hide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from ascend_core.suggest import did_you_mean

T = TypeVar("T")


class RegistryError(LookupError):
    """A name that is not registered, or a name registered twice with different entries."""


class Registry(Generic[T]):
    """A named map of implementations of one kind (``kind`` appears in errors)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if not isinstance(name, str) or not name:
            raise RegistryError(f"{self.kind} names must be non-empty strings, got {name!r}")
        existing = self._entries.get(name)
        if existing is not None and existing is not entry:
            raise RegistryError(
                f"{self.kind} {name!r} is already registered as {_describe(existing)}; "
                f"refusing to replace it with {_describe(entry)}. "
                "Unregister the first one explicitly if the replacement is intended."
            )
        self._entries[name] = entry
        return entry

    def decorator(self, name: str) -> Callable[[T], T]:
        """``@registry.decorator("name")`` registers the decorated object."""
        return lambda entry: self.register(name, entry)

    def unregister(self, name: str) -> T:
        return self._entries.pop(name)

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            known = ", ".join(sorted(self._entries)) or "none registered"
            raise RegistryError(
                f"unknown {self.kind} {name!r}; known: {known}."
                + did_you_mean(name, self._entries)
            ) from None

    def find(self, name: str) -> T | None:
        return self._entries.get(name)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"


def _describe(entry: Any) -> str:
    module = getattr(entry, "__module__", None)
    qualname = getattr(entry, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(entry)


# Speculative decoding: vLLM method name -> factory(vllm_config, device, runner) -> proposer.
# The model runners look a method up here first and use vLLM's own proposer otherwise.
SPECULATIVE_PROPOSERS: Registry[Callable[..., Any]] = Registry("speculative method")

# Rejection samplers: name -> factory(sampler, speculative_config, device) -> a drop-in for
# vLLM's RejectionSampler, or None when it cannot serve that configuration. The model runners
# use the "ascend" entry when one is registered and vLLM's own sampler otherwise.
REJECTION_SAMPLERS: Registry[Callable[..., Any]] = Registry("rejection sampler")

# Quantization: scheme name (e.g. "W8A8_DYNAMIC") -> scheme class.
QUANT_SCHEMES: Registry[Any] = Registry("quantization scheme")

# Quantization config readers: vLLM quantization method name -> config class.
QUANT_CONFIGS: Registry[Any] = Registry("quantization config")

# EPLB: policy name -> callable(weight, num_replicas, num_groups, num_nodes, num_gpus).
EPLB_POLICIES: Registry[Callable[..., Any]] = Registry("EPLB policy")

# Config hooks: name -> callable(vllm_config), run by both platforms at the start of
# check_and_update_config (e.g. ascend-quant selecting its method for an msModelSlim folder).
CONFIG_HOOKS: Registry[Callable[[Any], Any]] = Registry("vLLM config hook")

# Request checks: name -> callable(sampling_params) raising ValueError (one line: what is not
# served, and what to do) for a request the configured engine cannot serve; both platforms run
# them in vLLM's validate_request, so such a request is refused alone, at admission.
REQUEST_CHECKS: Registry[Callable[[Any], None]] = Registry("request check")

# Custom ops: vLLM CustomOp name (e.g. "RMSNorm") -> replacement class.
CUSTOM_OPS: Registry[type] = Registry("custom op")
