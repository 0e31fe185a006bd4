"""The one error type for checkpoints this package cannot serve exactly as described."""

from __future__ import annotations


class QuantConfigError(ValueError):
    """A quantized checkpoint the plugin refuses to serve rather than serve differently.

    Raised at start-up (config parsing, weight creation, weight loading or the
    post-load checks) for: a scheme no implementation exists for, the shards of one
    fused module described with different schemes, a scale that is missing or has the
    wrong shape, and a description that does not match the weights. Nothing falls back
    to float silently: a layer is either served by the scheme its checkpoint names or
    start-up fails with this error.
    """
