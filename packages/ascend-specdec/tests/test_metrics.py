"""acceptance_summary from vLLM's metric objects, from a mapping and from /metrics text."""

from dataclasses import dataclass

import pytest

from ascend_specdec.metrics import (
    MetricsError,
    acceptance_summary,
    parse_prometheus_text,
    spec_decode_counters,
)


@dataclass
class Counter:  # the shape of vllm.v1.metrics.reader.Counter / Vector
    name: str
    labels: dict
    value: int


@dataclass
class Vector:
    name: str
    labels: dict
    values: list


def engine_metrics(engine, drafts, draft_tokens, accepted_per_pos):
    labels = {"engine": str(engine)}
    return [
        Counter("vllm:num_requests_running", labels, 3),
        Counter("vllm:spec_decode_num_drafts", labels, drafts),
        Counter("vllm:spec_decode_num_draft_tokens", labels, draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", labels, sum(accepted_per_pos)),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", labels, accepted_per_pos),
    ]


def test_summary_of_get_metrics_sums_engines():
    metrics = engine_metrics(0, 10, 30, [8, 5, 2]) + engine_metrics(1, 10, 25, [6, 3, 1])
    summary = acceptance_summary(metrics)
    assert summary["num_drafts"] == 20
    assert summary["num_accepted_tokens_per_pos"] == [14, 8, 3]
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 25 / 20)
    assert summary["per_position_rate"] == pytest.approx([0.7, 0.4, 0.15])
    assert summary["draft_acceptance_rate"] == pytest.approx(25 / 55)


def test_summary_before_the_first_draft_and_without_speculation():
    summary = acceptance_summary(engine_metrics(0, 0, 0, [0, 0]))
    assert summary["mean_acceptance_length"] is None and summary["per_position_rate"] is None
    with pytest.raises(MetricsError, match="no vllm:spec_decode_num_drafts"):
        acceptance_summary([Counter("vllm:num_requests_running", {}, 1)])
    with pytest.raises(MetricsError, match="expected vLLM metric objects"):
        acceptance_summary([("vllm:spec_decode_num_drafts", 3)])


def test_inconsistent_counters_are_refused():
    metrics = engine_metrics(0, 4, 12, [2, 1])
    metrics[3].value = 7
    with pytest.raises(MetricsError, match=r"\[2, 1\] do not add up to .*=7"):
        acceptance_summary(metrics)


PROMETHEUS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 12.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7e9
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 36.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 5.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 9.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 1.0
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_summary_of_the_servers_metrics_page():
    counters = parse_prometheus_text(PROMETHEUS)
    assert counters == {"vllm:spec_decode_num_drafts": 12,
                        "vllm:spec_decode_num_draft_tokens": 36,
                        "vllm:spec_decode_num_accepted_tokens": 15,
                        "vllm:spec_decode_num_accepted_tokens_per_pos": [9, 5, 1]}
    summary = acceptance_summary(counters)
    assert summary["mean_acceptance_length"] == pytest.approx(1 + 15 / 12)
    assert summary["per_position_rate"] == pytest.approx([9 / 12, 5 / 12, 1 / 12])
    assert spec_decode_counters(counters) == counters


def test_a_steps_draft_lengths_from_vllms_per_position_counts():
    from ascend_specdec.metrics import step_draft_lengths

    # Requests with 3, 3, 1 and 2 drafts: 4 reached position 0, 3 position 1, 2 position 2;
    # two more running requests had none.
    assert step_draft_lengths([4, 3, 2], num_drafts=4, num_running=6) == {3: 2, 2: 1, 1: 1,
                                                                         0: 2}
    assert step_draft_lengths([], num_drafts=0, num_running=5) == {0: 5}
    assert step_draft_lengths([0, 0, 0], num_drafts=0, num_running=0) == {}
