"""MoE token communication (all-gather and all-to-all dispatch/combine, chosen per batch)
and the NPU communicator's collectives.

The multi-process tests start 2 or 4 ranks of ``moe_comm_worker.py`` over gloo (CPU
tensors) or over the reference torch_npu's ``hccl`` (npu tensors, gloo underneath). Each
rank runs toy MoE layers (random SiLU MLP experts, top-k routing, experts sharded across
ranks, uneven token counts, a rank with no tokens, experts that get no tokens) through both
paths and compares its tokens' outputs with a single-process float64 computation of the
whole batch; the ranks also report facts that this file checks across ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ascend_core import envs
from ascend_core.distributed.moe_comm import (
    ALL_GATHER,
    ALL_TO_ALL,
    DEFAULT_ALL2ALL_MIN_TOKENS,
    MC2,
    AllGatherMoEComm,
    AllToAllMoEComm,
    ExpertPlacement,
    MoECommunication,
    all_gatherv,
    make_moe_comm,
    reduce_scatterv,
    select_moe_comm,
)

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "moe_comm_worker.py"
REFERENCE_PATH = str(TESTS.parents[2] / "testing" / "reference_torch_npu")


def run_ranks(suite: str, backend: str, world: int, tmp_path: Path) -> list[dict]:
    """Start ``world`` ranks of the worker; each must exit 0. Their JSON facts, by rank."""
    store = tmp_path / f"store-{suite}-{backend}-{world}"
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "VLLM_ASCEND_TARGET": "npu"}
    for name in ("TORCH_NPU_REFERENCE_DEVICE_COUNT", "ASCEND_RT_VISIBLE_DEVICES"):
        env.pop(name, None)
    ranks = [subprocess.Popen([sys.executable, str(WORKER), suite, backend, str(world),
                               str(rank), str(store), REFERENCE_PATH],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(world)]
    outputs = []
    try:
        for process in ranks:
            outputs.append(process.communicate(timeout=150))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    for rank, (process, (_out, err)) in enumerate(zip(ranks, outputs, strict=True)):
        assert process.returncode == 0, f"rank {rank} failed:\n{err[-4000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.fixture(scope="module")
def reference_built():
    """The reference torch_npu's device extension compiled once, before ranks race for it."""
    subprocess.run([sys.executable, "-c", "import torch_npu"], check=True, timeout=600,
                   env={**os.environ, "PYTHONPATH": REFERENCE_PATH})


def check_moe_facts(facts: list[dict], world: int, device: str) -> None:
    assert [f["rank"] for f in facts] == list(range(world))
    # Token groups (data parallel x tensor parallel): each size's batches through both paths
    # (the threshold 0 gives all-to-all where top_k < ranks), every rank agreeing.
    for size in sorted({1, 2, world}):
        shared = [f["shared"][f"groups_of_{size}"] for f in facts]
        top_k = 2 if world > 2 else 1
        expected = ALL_TO_ALL if top_k < world else ALL_GATHER
        assert {tuple(s["chosen"]) for s in shared} == {(expected, ALL_GATHER)}, size
    assert {f["device"] for f in facts} == {device}
    assert all(f["moe_experts"] == ["ok", "ok"] for f in facts)
    if world == 2:
        # (tokens per rank, top_k) of the worker's scenarios: every (token, choice) row is
        # computed on exactly one rank.
        scenarios = {"rank1_empty": ([7, 0], 2), "uneven": ([3, 11], 2),
                     "rank1_receives_nothing": ([5, 4], 2), "top1_round_robin": ([9, 6], 1)}
    else:
        scenarios = {"uneven_placement": ([0, 5, 1, 9], 3), "round_robin": ([4, 0, 6, 2], 2)}
    for name, (counts, top_k) in scenarios.items():
        assert [f[name]["tokens"] for f in facts] == counts
        assert sum(sum(f[name]["rows"]) for f in facts) == sum(counts) * top_k, name
        # Every rank took the same path, and the threshold decided it.
        chosen = {tuple(f[name]["chosen"]) for f in facts}
        expected = ALL_TO_ALL if top_k < world else ALL_GATHER
        assert chosen == {(expected, ALL_GATHER)}, (name, chosen)
    # The whole batch on every rank: each path chosen by the threshold alone (no exchange);
    # all-gather computes each (token, choice) pair on its expert's owner, all-to-all too,
    # from the token shares.
    for name, tokens in (("odd_tokens", 13), ("one_token", 1)):
        assert {tuple(f["replicated"][name]["chosen"]) for f in facts} == {
            (ALL_TO_ALL, ALL_GATHER)}, name
        assert sum(f["replicated"][name]["rows"][0] for f in facts) == tokens, name
        assert sum(f["replicated"][name]["rows"][1] for f in facts) == tokens, name
    if world == 2:
        # Experts 1 and 4 (local 1 on each rank) were never chosen; experts 3-5 of rank 1
        # got nothing when routing used only experts 0-2; the round-robin layer's expert 3
        # (rank 1's local 1) got nothing.
        assert facts[0]["rank1_empty"]["rows"][1] == facts[1]["rank1_empty"]["rows"][1] == 0
        assert facts[1]["rank1_receives_nothing"]["rows"] == [0, 0, 0]
        assert facts[1]["top1_round_robin"]["rows"][1] == 0
        assert facts[0]["uneven"]["rows"][0] == 0
    else:
        # Linear placement of 10 experts on 4 ranks: 3, 3, 2, 2 local experts; 2 and 7 unused.
        assert [len(f["uneven_placement"]["rows"]) for f in facts] == [3, 3, 2, 2]
        assert facts[0]["uneven_placement"]["rows"][2] == 0
        assert facts[2]["uneven_placement"]["rows"][1] == 0


# --- across processes -------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_both_paths_equal_the_single_process_moe_over_gloo(world, tmp_path):
    check_moe_facts(run_ranks("moe", "gloo", world, tmp_path), world, "cpu")


def test_both_paths_equal_the_single_process_moe_over_reference_hccl_on_npu_tensors(
        reference_built, tmp_path):
    check_moe_facts(run_ranks("moe", "hccl", 2, tmp_path), 2, "npu")


def test_npu_communicator_collectives_over_reference_hccl_on_npu_tensors(
        reference_built, tmp_path):
    # Also vLLM's data-parallel MoE dispatch/combine, on the npu platform, whose ep group's
    # communicator is ours with vLLM's all-gather/reduce-scatter manager.
    facts = run_ranks("communicator", "hccl", 2, tmp_path)
    mc2_facts = [fact.pop("mc2") for fact in facts]
    for rank, (fact, mc2) in enumerate(zip(facts, mc2_facts, strict=True)):
        assert fact == {"rank": rank, "device": "npu", "collectives": "ok",
                        "moe": [ALL_TO_ALL, ALL_GATHER], "ep_communicator": "NPUCommunicator",
                        "all2all_manager": "AgRsAll2AllManager"}
        # MC2 over a communicator of its own; every batch of the 1024-wide layer took it
        # (5 and 2 tokens on the DP ranks: both padded to 5, 5 x 2 ranks x min(4, 2) rows;
        # 6 tokens on both TP ranks: shares of 3, 3 x 2 x 2 rows).
        assert mc2["comm_name"].startswith("reference_hccl_")
        assert mc2["counts"] == {MC2: 2, ALL_GATHER: 0, ALL_TO_ALL: 0}
        assert mc2["groups_of_1"]["rows"] == 20 and mc2["groups_of_2"]["rows"] == 12
        assert mc2["small_why_not"] == "hidden size 16 is outside [1024, 7168]"
        assert "only through MC2" in mc2["capture_error"] and "hidden size 16" in mc2[
            "capture_error"]
    # Each (token, choice) pair computed on exactly one rank.
    assert sum(mc2["groups_of_1"]["valid"] for mc2 in mc2_facts) == (5 + 2) * 2
    assert sum(mc2["groups_of_2"]["valid"] for mc2 in mc2_facts) == 6 * 2


# --- the selection rule -----------------------------------------------------------------------


def test_selection_takes_all_to_all_only_for_large_batches_with_top_k_below_ep_size():
    assert select_moe_comm(256, 8, 2, 64) == ALL_TO_ALL
    assert select_moe_comm(64, 8, 2, 64) == ALL_TO_ALL  # the threshold is inclusive
    assert select_moe_comm(63, 8, 2, 64) == ALL_GATHER
    assert select_moe_comm(0, 8, 2, 0) == ALL_TO_ALL
    # top_k >= ep_size: all-to-all would send at least as many rows as gathering.
    assert select_moe_comm(10_000, 8, 8, 64) == ALL_GATHER
    assert select_moe_comm(10_000, 4, 8, 0) == ALL_GATHER
    assert select_moe_comm(10_000, 1, 1, 0) == ALL_GATHER
    assert select_moe_comm(10_000, 2, 1, 64) == ALL_TO_ALL
    assert select_moe_comm(10_000, 16, 8) == ALL_TO_ALL
    assert select_moe_comm(DEFAULT_ALL2ALL_MIN_TOKENS - 1, 16, 8) == ALL_GATHER


@pytest.mark.parametrize("arguments, name", [
    ((-1, 8, 2, 64), "num_tokens=-1"), ((10, 0, 2, 64), "ep_size=0"),
    ((10, 8, 0, 64), "top_k=0"), ((10, 8, 2, -5), "all2all_min_tokens=-5"),
    ((10.0, 8, 2, 64), "num_tokens=10.0"), ((10, True, 2, 64), "ep_size=True"),
])
def test_selection_rejects_bad_arguments(arguments, name):
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        select_moe_comm(*arguments)


def test_threshold_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS", raising=False)
    assert envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS == DEFAULT_ALL2ALL_MIN_TOKENS
    placement = ExpertPlacement.linear(4, 1)
    assert MoECommunication(None, placement).all2all_min_tokens == DEFAULT_ALL2ALL_MIN_TOKENS
    monkeypatch.setenv("VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS", "512")
    assert MoECommunication(None, placement).all2all_min_tokens == 512
    assert MoECommunication(None, placement, all2all_min_tokens=3).all2all_min_tokens == 3
    monkeypatch.setenv("VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS", "-1")
    with pytest.raises(envs.EnvVarError, match="expected an integer >= 0"):
        MoECommunication(None, placement)


# --- placement --------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts, ep_size", [(8, 2), (10, 4), (3, 3), (7, 1), (5, 8)])
def test_linear_placement_is_vllms(num_experts, ep_size):
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    placement = ExpertPlacement.linear(num_experts, ep_size)
    for rank in range(ep_size):
        local_count, expert_map, _ = determine_expert_map(ep_size, rank, num_experts)
        assert placement.num_local_experts(rank) == local_count
        if expert_map is None:
            assert placement.local_index.tolist() == list(range(num_experts))
            continue
        mine = placement.owner == rank
        expected = torch.where(mine, placement.local_index, torch.full_like(placement.owner, -1))
        assert expected.tolist() == expert_map.tolist()


def test_placement_rejects_owners_outside_the_group():
    with pytest.raises(ValueError, match=r"owners must be ranks in \[0, 2\)"):
        ExpertPlacement(torch.tensor([0, 2]), torch.tensor([0, 0]), 2)
    with pytest.raises(ValueError, match=r"must both be \[num_experts\]"):
        ExpertPlacement(torch.tensor([0, 1]), torch.tensor([0]), 2)
    with pytest.raises(ValueError, match="num_experts=0"):
        ExpertPlacement.linear(0, 2)


# --- one process: the paths' arithmetic and bad input ------------------------------------------


def _toy_layer(num_experts: int, hidden: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    weights = torch.randn(num_experts, hidden, hidden, generator=generator) / hidden ** 0.5

    def expert(index: int, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weights[index].to(x.dtype))

    return expert


@pytest.mark.parametrize("method", [ALL_GATHER, ALL_TO_ALL])
def test_one_rank_computes_every_expert_and_combines_with_the_weights(method):
    expert = _toy_layer(5, 8, seed=0)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 8, generator=generator)
    ids = torch.tensor([[4, 0], [0, 4], [2, 3], [3, 2], [0, 0], [4, 2]])
    weights = torch.rand(6, 2, generator=generator)
    comm = make_moe_comm(method, None, ExpertPlacement.linear(5, 1))
    dispatched = comm.dispatch(x, weights, ids)
    # Grouped by expert: expert 1 got nothing.
    assert dispatched.tokens_per_expert.tolist() == [4, 0, 3, 2, 3]
    assert dispatched.local_expert_ids.tolist() == [0] * 4 + [2] * 3 + [3] * 2 + [4] * 3
    outputs = torch.cat([expert(int(e), row[None]) for e, row in
                         zip(dispatched.local_expert_ids, dispatched.hidden_states, strict=True)])
    combined = comm.combine(outputs, dispatched)
    expected = torch.stack([sum(weights[t, k] * expert(int(ids[t, k]), x[t][None])[0]
                                for k in range(2)) for t in range(6)])
    torch.testing.assert_close(combined, expected)


def test_no_tokens_at_all_gives_an_empty_result():
    for method in (ALL_GATHER, ALL_TO_ALL):
        comm = make_moe_comm(method, None, ExpertPlacement.linear(4, 1))
        dispatched = comm.dispatch(torch.empty(0, 8), torch.empty(0, 2),
                                   torch.empty(0, 2, dtype=torch.int64))
        assert dispatched.tokens_per_expert.tolist() == [0, 0, 0, 0]
        assert comm.combine(torch.empty(0, 8), dispatched).shape == (0, 8)


@pytest.mark.parametrize("comm_class", [AllGatherMoEComm, AllToAllMoEComm, MoECommunication])
def test_bad_routing_is_refused_with_the_offending_value(comm_class):
    comm = comm_class(None, ExpertPlacement.linear(4, 1))
    x, w = torch.ones(2, 8), torch.full((2, 2), 0.5)
    cases = [
        ((x, w, torch.tensor([[0, 1], [2, 4]])), r"expert id 4 in topk_ids is outside the "
                                                 r"global experts \[0, 4\)"),
        ((x, w, torch.tensor([[0, -1], [2, 3]])), r"expert id -1"),
        ((torch.ones(8), w, torch.zeros(2, 2, dtype=torch.int64)),
         r"hidden_states must be \[num_tokens, hidden\], got shape \(8,\)"),
        ((x, w, torch.zeros(3, 2, dtype=torch.int64)),
         r"topk_ids must be \[num_tokens=2, top_k\], got shape \(3, 2\)"),
        ((x, torch.ones(2, 3), torch.zeros(2, 2, dtype=torch.int64)),
         r"topk_weights \(2, 3\) must have the shape of topk_ids \(2, 2\)"),
        ((x, w, torch.zeros(2, 2)), "topk_ids must be integers, got torch.float32"),
        ((x, torch.ones(2, 2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64)),
         "topk_weights must be floating point"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            comm.dispatch(*arguments)


@pytest.mark.parametrize("method", [ALL_GATHER, ALL_TO_ALL])
def test_expert_output_must_have_one_row_per_dispatched_row(method):
    comm = make_moe_comm(method, None, ExpertPlacement.linear(4, 1))
    dispatched = comm.dispatch(torch.ones(3, 8), torch.full((3, 2), 0.5),
                               torch.tensor([[0, 1], [1, 2], [2, 3]]))
    with pytest.raises(ValueError, match=r"expert_output must be \[6, hidden\].*\(5, 8\)"):
        comm.combine(torch.ones(5, 8), dispatched)


def test_placement_for_another_group_size_and_unknown_method_are_refused():
    with pytest.raises(ValueError, match="placement is for ep_size=2, but the group has 1"):
        AllToAllMoEComm(None, ExpertPlacement.linear(4, 2))
    with pytest.raises(ValueError, match="Unknown MoE communication method 'mc2'.*allgather "
                                         "or alltoall.*mc2_comm_name"):
        make_moe_comm("mc2", None, ExpertPlacement.linear(4, 1))


def test_variable_size_collectives_check_their_sizes():
    with pytest.raises(ValueError, match=r"sizes \[2, 1\] must give one row count per rank \(1\)"):
        all_gatherv(torch.ones(2, 3), [2, 1], None)
    with pytest.raises(ValueError, match=r"the input has \(4,\) rows; sizes \[3\]"):
        reduce_scatterv(torch.ones(4, 3), [3], None)
    tensor = torch.arange(6.0).reshape(3, 2)
    assert all_gatherv(tensor, [3], None) is tensor
    assert reduce_scatterv(tensor, [3], None) is tensor
