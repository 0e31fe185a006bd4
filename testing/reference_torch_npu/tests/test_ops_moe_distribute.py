"""The MC2 token exchange (``npu_moe_distribute_dispatch_v2`` / ``_combine_v2``) across two
ranks of the reference ``hccl``: what each rank's experts receive, in the documented layout,
and what each token gets back, against a computation every rank makes of the whole batch
(``mc2_worker.py``); the errors for what the ops' page rules out or the reference does not
model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
REFERENCE_PATH = str(TESTS.parent)


@pytest.fixture(scope="module")
def facts(tmp_path_factory) -> list[dict]:
    subprocess.run([sys.executable, "-c", "import torch_npu"], check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": REFERENCE_PATH})  # build once, not racing
    store = tmp_path_factory.mktemp("mc2") / "store"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for name in ("TORCH_NPU_REFERENCE_DEVICE_COUNT", "ASCEND_RT_VISIBLE_DEVICES"):
        env.pop(name, None)
    ranks = [subprocess.Popen([sys.executable, str(TESTS / "mc2_worker.py"), str(rank), "2",
                               str(store), REFERENCE_PATH], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in range(2)]
    outputs = [process.communicate(timeout=300) for process in ranks]
    for rank, (process, (_, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank}:\n{err[-3000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.mark.parametrize("case", ["even", "uneven", "masked"])
def test_experts_receive_their_rows_and_tokens_get_the_weighted_sum(facts, case):
    tokens = {"even": [6, 6], "uneven": [4, 9], "masked": [5, 2]}[case]
    global_bs = {"even": 12, "uneven": 18, "masked": 10}[case]
    received = 0
    for rank, fact in enumerate(facts):
        result = fact[case]
        assert result["device"] == "npu"
        # A = global_bs * min(local experts, K) rows; the valid ones grouped by local expert,
        # by source rank within an expert, by token within a source.
        assert result["rows"] == [global_bs * min(4, 3), 1024]
        assert result["layout"], (rank, case)
        assert result["count_total"] == sum(result["counts"])
        assert result["recv_counts_dtype"] == "torch.int32"
        assert result["expand_scales"] is None
        # bf16 rows times float32 scales, summed in float32, cast to bf16 once (relative to
        # the largest output).
        assert result["combine_error"] < 1e-2, (rank, case, result["combine_error"])
        assert result["combine_dtype"] == "torch.bfloat16"
        received += sum(result["counts"])
    assert received == sum(tokens) * 3  # every active (token, choice) on exactly one rank


def test_what_the_page_rules_out_or_the_reference_does_not_model_is_refused(facts):
    for fact in facts:
        errors = fact["errors"]
        assert "global_bs=0 needs the same BS on every rank" in errors["bs_differs"]
        assert "[4, 5]" in errors["bs_differs"]
        assert "names no HCCL communicator" in errors["unknown_group"]
        assert errors["quant_mode"].startswith("NotImplementedError")
        assert "quant_mode=2" in errors["quant_mode"]
        assert "hidden size 512" in errors["small_hidden"]
        assert "names one expert twice" in errors["repeated_expert"]
