"""Helpers for error messages that say what would have been right."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate most similar to ``name``, or None if nothing is close."""
    matches = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` or an empty string, to append to a message."""
    match = closest(name, candidates)
    return f" Did you mean {match!r}?" if match else ""
