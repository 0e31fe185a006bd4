"""Acceptance figures from vLLM's own speculative-decoding counters. Imports no vLLM.

vLLM's scheduler counts, for every step that verified a draft: ``num_drafts`` (+1),
``num_draft_tokens`` (+ the draft's length), ``num_accepted_tokens`` (+ the accepted prefix's
length) and ``num_accepted_tokens_per_pos[i]`` (+1 when position ``i`` was accepted). Our model
runners return drafts and sampled tokens in vLLM's output format, so these counters cover our
proposers and rejection sampler as they cover vLLM's. They reach users as
``vllm:spec_decode_*`` metrics: ``LLM.get_metrics()`` (counters and a per-position vector, one
per engine) and the server's ``/metrics`` (Prometheus text, ``_total`` counters, the
per-position counter labelled ``position``).

- mean acceptance length = 1 + accepted / drafts (tokens gained per verifying step, the bonus
  token included, as vLLM logs it);
- per-position acceptance rate[i] = accepted at position i / drafts;
- draft acceptance rate = accepted / draft tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


class MetricsError(ValueError):
    """Metrics that are not vLLM's speculative-decoding counters."""


def spec_decode_counters(metrics: Iterable[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's speculative-decoding counters summed over engines.

    ``metrics``: what ``LLM.get_metrics()`` returns (objects with ``name`` and ``value`` or
    ``values``), or a mapping of those names to numbers / per-position lists (e.g.
    ``parse_prometheus_text``'s result).
    """
    if isinstance(metrics, Mapping):
        items = list(metrics.items())
    else:
        items = []
        for metric in metrics:
            name = getattr(metric, "name", None)
            if name is None:
                raise MetricsError(f"expected vLLM metric objects (name, value), got {metric!r}")
            items.append((name, getattr(metric, "values", getattr(metric, "value", None))))
    totals: dict[str, Any] = {}
    for name, value in items:
        if not name.startswith("vllm:spec_decode"):
            continue
        if isinstance(value, (list, tuple)):
            old, value = list(totals.get(name, [])), list(value)
            width = max(len(old), len(value))
            old += [0] * (width - len(old))
            value += [0] * (width - len(value))
            totals[name] = [a + b for a, b in zip(old, value, strict=True)]
        else:
            totals[name] = totals.get(name, 0) + value
    return totals


def acceptance_summary(metrics: Iterable[Any] | Mapping[str, Any]) -> dict[str, Any]:
    """{mean_acceptance_length, per_position_rate, draft_acceptance_rate, num_drafts,
    num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos} from vLLM's counters.

    Without speculative decoding (no counters) this is a ``MetricsError``; before the first
    draft the rates are None.
    """
    counters = spec_decode_counters(metrics)
    if DRAFTS not in counters:
        raise MetricsError(
            f"no {DRAFTS} among the metrics: speculative decoding is off, or stats are "
            "(LLM(..., disable_log_stats=False) turns them on for LLM.get_metrics())")
    drafts = int(counters[DRAFTS])
    draft_tokens = int(counters.get(DRAFT_TOKENS, 0))
    accepted = int(counters.get(ACCEPTED, 0))
    per_pos = [int(v) for v in counters.get(ACCEPTED_PER_POS, [])]
    if sum(per_pos) != accepted and per_pos:
        raise MetricsError(f"accepted tokens per position {per_pos} do not add up to "
                           f"{ACCEPTED}={accepted}")
    return {
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens": accepted,
        "num_accepted_tokens_per_pos": per_pos,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "per_position_rate": [count / drafts for count in per_pos] if drafts else None,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
    }


_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_prometheus_text(text: str) -> dict[str, Any]:
    """The ``vllm:spec_decode_*`` counters of a ``/metrics`` page, in ``get_metrics()`` names.

    ``_total`` suffixes are dropped, samples of several engines are summed, and the
    per-position counter becomes a list indexed by its ``position`` label.
    """
    counters: dict[str, Any] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match is None or not match["name"].startswith("vllm:spec_decode"):
            continue
        name = match["name"]
        if name.endswith("_created"):
            continue
        name = name.removesuffix("_total")
        value = float(match["value"])
        labels = dict(_LABEL.findall(match["labels"] or ""))
        if name == ACCEPTED_PER_POS:
            if "position" not in labels:
                raise MetricsError(f"{ACCEPTED_PER_POS} sample without a position label: {line}")
            position = int(labels["position"])
            vector = counters.setdefault(name, [])
            vector.extend([0] * (position + 1 - len(vector)))
            vector[position] += int(value)
        else:
            counters[name] = counters.get(name, 0) + int(value)
    return counters


# The histogram of draft lengths requests were verified with, one observation per request per
# step (the plugin's stat logger exposes it on /metrics beside vLLM's counters).
DRAFT_LENGTH = "ascend:spec_decode_draft_length"


def step_draft_lengths(num_draft_tokens_per_pos: list[int], num_drafts: int,
                       num_running: int) -> dict[int, int]:
    """``{draft length: requests}`` in one step, from vLLM's per-step ``SpecDecodingStats``
    (``num_draft_tokens_per_pos[i]``: requests whose drafts reached position ``i``) and the
    running requests; those without drafts (the controller chose none, the proposer found
    none, or still in prefill) count at length 0."""
    counts: dict[int, int] = {}
    reached = [*num_draft_tokens_per_pos, 0]
    for length in range(1, len(reached)):
        exactly = reached[length - 1] - reached[length]
        if exactly:
            counts[length] = exactly
    without = num_running - num_drafts
    if without > 0:
        counts[0] = without
    return counts
