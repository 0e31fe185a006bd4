"""vLLM stat-logger plugin (``vllm.stat_logger_plugins``): the draft lengths requests were
verified with, as a Prometheus histogram on the server's ``/metrics`` beside vLLM's
speculative-decoding counters (``ascend:spec_decode_draft_length``, one observation per
request per step, ``engine`` label). What the draft-length controller chose shows there.

vLLM loads stat-logger plugins in its serving engine (``AsyncLLM``), not in the offline
``LLM``. Nothing is registered where the plugin is inactive or no speculation is configured.
"""

from __future__ import annotations

from vllm.v1.metrics.loggers import StatLoggerBase

from ascend_specdec.metrics import DRAFT_LENGTH, step_draft_lengths

_HISTOGRAM = []  # one per process, labelled by engine (DP makes a logger per engine)


def _histogram(max_length: int):
    if not _HISTOGRAM:
        from prometheus_client import Histogram

        _HISTOGRAM.append(Histogram(
            DRAFT_LENGTH, "Draft tokens a request was verified with in a step (0: none).",
            labelnames=["engine"], buckets=[float(k) for k in range(max_length + 1)]))
    return _HISTOGRAM[0]


class DraftLengthStatLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        from ascend_plugin.entry_points import active_target

        spec = vllm_config.speculative_config
        self.engine = str(engine_index)
        self.histogram = None
        if spec is not None and spec.num_speculative_tokens and active_target() is not None:
            self.histogram = _histogram(spec.num_speculative_tokens).labels(engine=self.engine)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None,
               engine_idx: int = 0) -> None:
        if self.histogram is None or scheduler_stats is None:
            return
        spec = scheduler_stats.spec_decoding_stats
        lengths = step_draft_lengths(
            spec.num_draft_tokens_per_pos if spec else [], spec.num_drafts if spec else 0,
            scheduler_stats.num_running_reqs)
        for length, requests in lengths.items():
            for _ in range(requests):
                self.histogram.observe(length)

    def log_engine_initialized(self) -> None:
        pass
