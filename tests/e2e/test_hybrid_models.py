"""Hybrid-attention models on the host target: a tiny Qwen3-Next (gated delta-net linear
attention layers between full-attention ones, MoE MLPs; random weights, made at test time)
through the plugin against stock vLLM, both on vLLM's CPU GDN path in bfloat16 (that path
takes bfloat16 only, and linear-attention heads of 128).

Compared up to near-ties, each checked in both runs' logprobs
(``assert_equal_up_to_near_ties``): in bfloat16 a near-tie may round apart between two runs.
"""

from __future__ import annotations

import pytest
from test_npu_target import assert_equal_up_to_near_ties, run

HOST = {"VLLM_ASCEND_TARGET": "host"}


@pytest.fixture(scope="module")
def qwen3_next() -> str:
    from ascend_plugin.tiny_models import ensure_model

    return str(ensure_model("qwen3_next", num_layers=4))


def test_qwen3_next_on_the_host_target_equals_stock_vllm(qwen3_next):
    stock = run(qwen3_next, {}, dtype="bfloat16")
    ours = run(qwen3_next, HOST, dtype="bfloat16")
    assert ours["platform"] == "ascend_core.platform.host.AscendHostPlatform"
    assert "AscendUnquantizedFusedMoEMethod" in ours["workers"][0]["layer_classes"]
    assert_equal_up_to_near_ties(ours, stock, "Qwen3-Next: host target vs stock vLLM")
