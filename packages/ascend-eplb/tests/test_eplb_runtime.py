"""EplbRuntime on a toy MoE: outputs equal a dense reference before, during and after
rearrangements; bad replans leave the placement and the weights in service alone."""

from __future__ import annotations

import logging
import re

import pytest
import torch
import torch.distributed as dist

import ascend_eplb.runtime as runtime_module
from ascend_core.registry import EPLB_POLICIES
from ascend_eplb.expert_map import load_expert_map, save_expert_map
from ascend_eplb.runtime import EplbRuntime, EplbSettings, default_phy2log
from ascend_eplb.validation import UnknownEplbPolicyError

from eplb_dist import run_ranks

HIDDEN = 4
LAYERS = 2
EXPERTS = 6
TOP_K = 2


def expert_params(layer: int, expert: int) -> list[torch.Tensor]:
    """The toy expert: y = x @ W + b, W [H, H] and b [H], fixed per (layer, expert)."""
    g = torch.Generator().manual_seed(1000 * layer + expert)
    return [torch.randn(HIDDEN, HIDDEN, generator=g, dtype=torch.float64),
            torch.randn(HIDDEN, generator=g, dtype=torch.float64)]


def loaded_layout(num_ranks: int) -> torch.Tensor:
    """vLLM's layout: experts / ranks per rank, in order, no replicas."""
    return torch.arange(EXPERTS).expand(LAYERS, -1).clone()


def loaded_weights(rank: int, num_ranks: int) -> list[list[torch.Tensor]]:
    k = EXPERTS // num_ranks
    return [
        [torch.stack([expert_params(layer, e)[p] for e in range(rank * k, (rank + 1) * k)])
         for p in range(2)]
        for layer in range(LAYERS)
    ]


def make_runtime(rank=0, num_ranks=1, **settings) -> EplbRuntime:
    settings = {"num_experts": EXPERTS, "num_redundant_experts": 2, "dynamic": True,
                "heat_collection_interval": 2, "execution_delay": 1, **settings}
    runtime = EplbRuntime(
        EplbSettings(**settings), num_layers=LAYERS, num_ranks=num_ranks, rank=rank,
        expert_bytes=8 * (HIDDEN * HIDDEN + HIDDEN),
    )
    runtime.start(loaded_weights(rank, num_ranks), loaded_layout(num_ranks))
    return runtime


def batch(step: int, tokens: int = 16):
    """Tokens routed mostly to experts 0 and 1, the hot set shifting with the step."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(tokens, HIDDEN, generator=g, dtype=torch.float64)
    hot = torch.tensor([8.0, 4.0, 1.0, 1.0, 0.5, 0.5]).roll(step // 4)
    ids = torch.stack([torch.multinomial(hot, TOP_K, generator=g) for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g, dtype=torch.float64)
    return x, ids, weights


def moe_forward(runtime: EplbRuntime, layer: int, x, ids, weights) -> torch.Tensor:
    """This rank's part of the MoE output, read from the runtime's slot buffers."""
    local, is_local = runtime.route(layer, ids)
    slot = torch.where(is_local, local, 0)
    w_mat, w_bias = runtime.weights[layer]
    y = torch.einsum("th,tkhj->tkj", x, w_mat[slot]) + w_bias[slot]
    return (y * (weights * is_local).unsqueeze(-1)).sum(1)


def dense_forward(layer: int, x, ids, weights) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        for k in range(TOP_K):
            w_mat, w_bias = expert_params(layer, int(ids[t, k]))
            out[t] += weights[t, k] * (x[t] @ w_mat + w_bias)
    return out


def serve(runtime: EplbRuntime, steps: range, num_ranks: int = 1) -> None:
    for step in steps:
        runtime.on_step_boundary()
        for layer in range(LAYERS):
            x, ids, weights = batch(step * LAYERS + layer)
            runtime.record(layer, ids)
            out = moe_forward(runtime, layer, x, ids, weights)
            if num_ranks > 1:
                dist.all_reduce(out)
            torch.testing.assert_close(out, dense_forward(layer, x, ids, weights),
                                       rtol=1e-12, atol=1e-12)


def weights_snapshot(runtime):
    return [[t.clone() for t in params] for params in runtime.weights]


def assert_same_weights(runtime, snapshot):
    for params, saved in zip(runtime.weights, snapshot, strict=True):
        for tensor, before in zip(params, saved, strict=True):
            assert torch.equal(tensor, before)


# ---------------------------------------------------------------------- one rank


def test_start_serves_the_initial_placement_with_redundant_experts():
    runtime = make_runtime(dynamic=False)
    assert runtime.placement.phy2log.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]] * LAYERS
    assert runtime.weights[0][0].shape == (8, HIDDEN, HIDDEN)
    # The replicas of expert 0 (slots 0 and 6) hold the same weights.
    assert torch.equal(runtime.weights[1][0][6], expert_params(1, 0)[0])
    serve(runtime, range(3))
    assert runtime.summary()["rearrangements"] == 0


def test_tokens_are_spread_over_replicas():
    runtime = make_runtime()
    local, is_local = runtime.route(0, torch.zeros(4, 1, dtype=torch.int64))
    assert is_local.all()
    assert local.view(-1).tolist() == [0, 6, 0, 6]  # expert 0 lives in slots 0 and 6


def test_rearrangements_keep_outputs_exact(caplog):
    runtime = make_runtime(policy="flashlb")
    with caplog.at_level(logging.INFO, logger="ascend_eplb.runtime"):
        serve(runtime, range(14))
    summary = runtime.summary()
    # Replans start every 2 steps and are applied one step later.
    assert summary["rearrangements"] == 6
    assert [entry["step"] for entry in summary["history"]] == [3, 5, 7, 9, 11, 13]
    assert summary["experts_moved"] > 0
    assert summary["bytes_moved"] == summary["experts_moved"] * runtime.expert_bytes
    # The hot experts got the redundant slots.
    assert any(line.startswith("EPLB rearrangement") for line in caplog.messages)
    logcnt = runtime.placement.logcnt
    assert (logcnt.sum(-1) == 8).all()


def test_execution_delay_and_interval():
    runtime = make_runtime(heat_collection_interval=3, execution_delay=2)
    serve(runtime, range(12))
    # Triggers after 3, 6, 9 completed steps; each applied two steps later.
    assert [e["step"] for e in runtime.summary()["history"]] == [5, 8, 11]
    assert [e["planned_at"] for e in runtime.summary()["history"]] == [3, 6, 9]


def test_a_policy_error_keeps_the_placement_in_service(caplog):
    def broken(weight, num_replicas, num_groups, num_nodes, num_gpus, *, previous=None):
        raise RuntimeError("solver diverged")

    EPLB_POLICIES.register("test-broken", broken)
    try:
        runtime = make_runtime(policy="test-broken")
        placement, snapshot = runtime.placement, weights_snapshot(runtime)
        with caplog.at_level(logging.ERROR, logger="ascend_eplb.runtime"):
            serve(runtime, range(6))
    finally:
        EPLB_POLICIES.unregister("test-broken")
    assert runtime.placement is placement
    assert_same_weights(runtime, snapshot)
    summary = runtime.summary()
    assert summary["rearrangements"] == 0 and summary["failed_replans"] == 2
    assert "keeping the placement in service" in caplog.text
    assert "policy 'test-broken' raised RuntimeError: solver diverged" in caplog.text


@pytest.mark.parametrize("bad_placement, message", [
    (lambda shape: torch.zeros(shape, dtype=torch.int64), "gives no replica to"),
    (lambda shape: torch.full(shape, 9, dtype=torch.int64), r"in \[0, 6\)"),
    (lambda shape: torch.zeros(shape[0], shape[1] + 1, dtype=torch.int64), "shaped"),
])
def test_an_inconsistent_plan_is_never_applied(caplog, bad_placement, message):
    def inconsistent(weight, num_replicas, num_groups, num_nodes, num_gpus, *, previous=None):
        return bad_placement(previous.shape), None, None

    EPLB_POLICIES.register("test-inconsistent", inconsistent)
    try:
        runtime = make_runtime(policy="test-inconsistent")
        placement, snapshot = runtime.placement, weights_snapshot(runtime)
        with caplog.at_level(logging.ERROR, logger="ascend_eplb.runtime"):
            serve(runtime, range(4))
    finally:
        EPLB_POLICIES.unregister("test-inconsistent")
    assert runtime.placement is placement
    assert_same_weights(runtime, snapshot)
    assert runtime.summary()["failed_replans"] == 1
    assert "inconsistent plan" in caplog.text
    assert any(re.search(message, line) for line in caplog.messages)


def test_a_window_without_load_is_skipped():
    runtime = make_runtime(phase="prefill")  # serve() gives no prefill mask: nothing counts
    serve(runtime, range(4))
    summary = runtime.summary()
    assert summary["skipped_replans"] == 1 and summary["rearrangements"] == 0


def test_expert_map_files_in_and_out(tmp_path):
    start_map = tmp_path / "start.json"
    record = tmp_path / "record.json"
    initial = torch.tensor([[5, 4, 3, 2, 1, 0, 5, 5], [0, 0, 1, 2, 3, 4, 5, 1]])
    save_expert_map(start_map, initial, 1, num_experts=EXPERTS)
    runtime = EplbRuntime(
        EplbSettings(num_experts=EXPERTS, num_redundant_experts=2, dynamic=True,
                     heat_collection_interval=2, execution_delay=1, record_path=str(record)),
        num_layers=LAYERS, expert_bytes=1,
    )
    runtime.start(loaded_weights(0, 1), loaded_layout(1),
                  runtime.initial_phy2log(load_expert_map(start_map)))
    assert torch.equal(runtime.placement.phy2log, initial)
    assert torch.equal(runtime.weights[0][0][6], expert_params(0, 5)[0])
    assert not record.exists()
    serve(runtime, range(4))
    recorded = load_expert_map(record)
    assert torch.equal(recorded.phy2log, runtime.placement.phy2log)
    assert recorded.metadata["rearrangement"] == 1 and recorded.metadata["policy"] == "default"


def test_expert_map_that_does_not_fit_the_model(tmp_path):
    path = tmp_path / "map.json"
    save_expert_map(path, torch.arange(8).view(1, 8) % 7, 2, num_experts=7)
    runtime = EplbRuntime(EplbSettings(num_experts=EXPERTS, num_redundant_experts=4),
                          num_layers=LAYERS, num_ranks=1)
    with pytest.raises(ValueError) as info:
        runtime.initial_phy2log(load_expert_map(path))
    text = str(info.value)
    assert "1 MoE layers, the model has 2" in text
    assert "7 experts per layer, the model has 6" in text
    assert "2 ranks, this deployment has 1" in text
    assert "set num_redundant_experts to 2" in text


def test_bad_settings():
    with pytest.raises(UnknownEplbPolicyError, match="unknown EPLB policy 'fastest'"):
        EplbRuntime(EplbSettings(num_experts=6, policy="fastest"), num_layers=1)
    with pytest.raises(ValueError, match="6 \\+ 1 = 7 slots cannot be spread evenly over 2"):
        EplbRuntime(EplbSettings(num_experts=6, num_redundant_experts=1), num_layers=1,
                    num_ranks=2, rank=1)
    with pytest.raises(ValueError, match="phase must be one of"):
        EplbSettings(num_experts=6, phase="both")
    with pytest.raises(RuntimeError, match="start must be called before serving"):
        EplbRuntime(EplbSettings(num_experts=6), num_layers=1).on_step_boundary()


def test_default_phy2log_repeats_the_first_experts():
    assert default_phy2log(1, 4, 6).tolist() == [[0, 1, 2, 3, 0, 1]]


# ---------------------------------------------------------------------- two ranks


def _serve_rank(rank, world_size):
    runtime = make_runtime(rank, world_size, policy="flashlb")
    serve(runtime, range(10), world_size)
    summary = runtime.summary()
    assert summary["rearrangements"] == 4
    assert summary["bytes_between_ranks"] > 0
    moved = [e["rows_sent"] + e["rows_received"] for e in summary["history"]]
    assert sum(moved) > 0
    # Every rank serves the same placement.
    everyone = [None] * world_size
    dist.all_gather_object(everyone, summary["phy2log"])
    assert everyone[0] == everyone[1]


def test_two_ranks_rearrange_over_gloo_and_stay_exact():
    run_ranks(_serve_rank, 2)


def _failing_rank(rank, world_size):
    runtime = make_runtime(rank, world_size, policy="flashlb")
    serve(runtime, range(4), world_size)  # one rearrangement applied at step 3
    assert runtime.summary()["rearrangements"] == 1
    placement, snapshot = runtime.placement, weights_snapshot(runtime)
    if rank == 1:
        real_stage = runtime_module.stage_expert_weights

        def stage_then_fail(*args, **kwargs):
            real_stage(*args, **kwargs)  # the messages flow, then this rank fails
            raise MemoryError("no room for staging")

        runtime_module.stage_expert_weights = stage_then_fail
    try:
        serve(runtime, range(4, 6), world_size)  # the next replan is applied at step 5
    finally:
        if rank == 1:
            runtime_module.stage_expert_weights = real_stage
    summary = runtime.summary()
    assert summary["failed_replans"] == 1 and summary["rearrangements"] == 1
    assert runtime.placement is placement
    assert_same_weights(runtime, snapshot)
    reason = summary["history"][-1]["reason"]
    expected = "rank 1 could not stage" if rank == 1 else "another rank could not stage"
    assert expected in reason
    # Serving continues, and later replans apply again on both ranks.
    serve(runtime, range(6, 8), world_size)
    assert runtime.summary()["rearrangements"] == 2


def test_a_rank_that_fails_to_stage_leaves_every_rank_on_the_old_placement():
    run_ranks(_failing_rank, 2)
