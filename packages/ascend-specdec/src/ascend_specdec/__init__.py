"""ascend-specdec: see the package README for what it provides."""

from ascend_specdec.__about__ import __version__

__all__ = ["__version__", "register"]


def register() -> None:
    """Register this package's implementations in ascend-core's registries.

    Idempotent. Nothing is registered yet: vLLM's own implementations serve
    until this package provides its own (docs/FEATURES.md tracks which).
    """
