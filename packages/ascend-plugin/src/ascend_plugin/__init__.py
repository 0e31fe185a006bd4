"""The vLLM Ascend plugin: composes the ascend-* packages into vLLM's entry points."""

from ascend_plugin.__about__ import __version__

__all__ = ["__version__"]
