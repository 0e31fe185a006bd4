"""One rank of the multi-process tests in test_moe_comm.py (run as a script, not collected).

    python moe_comm_worker.py SUITE BACKEND WORLD RANK STORE [REFERENCE_PATH]

SUITE ``moe``: toy MoE layers through both MoE paths against a single-process reference.
SUITE ``communicator``: NPUCommunicator's collectives and its MoE pair, then vLLM's own
data-parallel MoE dispatch/combine through it (vLLM's distributed state set up for data
parallel WORLD with expert parallel, on the npu platform when BACKEND is hccl).
BACKEND ``gloo`` (CPU tensors) or ``hccl`` (the reference torch_npu's npu tensors).
Each rank checks its own results and prints one JSON line of facts for the test to compare.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

SUITE, BACKEND, WORLD, RANK, STORE = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:5]), sys.argv[5]
if BACKEND == "hccl":
    sys.path.insert(0, sys.argv[6])
    import torch_npu  # noqa: F401  (the reference: names the npu device, registers hccl)

    DEVICE = torch.device("npu", 0)
else:
    DEVICE = torch.device("cpu")

from ascend_core.distributed.moe_comm import (  # noqa: E402
    ALL_GATHER,
    ALL_TO_ALL,
    MC2,
    AllGatherMoEComm,
    AllToAllMoEComm,
    ExpertPlacement,
    MoECommunication,
    TokenGroup,
)

HIDDEN = 16


class ToyExperts(torch.nn.Module):
    """``num_experts`` small MLPs (Linear, SiLU, Linear), the same on every rank (seeded)."""

    def __init__(self, num_experts: int, seed: int) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.up = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(2 * HIDDEN, HIDDEN, generator=generator) / 4)
            for _ in range(num_experts))
        self.down = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(HIDDEN, 2 * HIDDEN, generator=generator) / 4)
            for _ in range(num_experts))

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        up = self.up[index].to(device=x.device, dtype=x.dtype)
        down = self.down[index].to(device=x.device, dtype=x.dtype)
        return torch.nn.functional.silu(x @ up.T) @ down.T

    def reference(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """sum_k weights[t, k] * expert[ids[t, k]](x[t]), token by token, in float64."""
        x64 = x.double()
        out = torch.zeros_like(x64)
        for t in range(x.shape[0]):
            for k in range(ids.shape[1]):
                expert = self.expert(int(ids[t, k]), x64[t: t + 1])[0]
                out[t] += float(weights[t, k]) * expert
        return out

    def run_local(self, dispatched, placement: ExpertPlacement, rank: int,
                  weigh_rows: bool = False) -> torch.Tensor:
        """The dispatched rows through this rank's experts, group by group as the
        ``tokens_per_expert`` split says (what a grouped matmul would do)."""
        global_of_local = {int(placement.local_index[e]): e
                           for e in range(placement.num_experts) if int(placement.owner[e]) == rank}
        outputs = []
        start = 0
        for local, count in enumerate(dispatched.tokens_per_expert.tolist()):
            rows = dispatched.hidden_states[start: start + count]
            assert (dispatched.local_expert_ids[start: start + count] == local).all()
            assert (dispatched.expert_ids[start: start + count] == global_of_local[local]).all()
            outputs.append(self.expert(global_of_local[local], rows))
            start += count
        assert start == dispatched.hidden_states.shape[0]
        out = torch.cat(outputs) if outputs else dispatched.hidden_states[:0].clone()
        if weigh_rows:
            out = out * dispatched.topk_weights.unsqueeze(1).to(out.dtype)
        return out


def make_batch(counts: list[int], num_experts: int, top_k: int, seed: int,
               unused: tuple[int, ...] = (), only: tuple[int, ...] | None = None):
    """Every rank's tokens and routing (identical on all ranks; each keeps its slice)."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(counts)
    x = torch.randn(total, HIDDEN, generator=generator)
    allowed = [e for e in range(num_experts) if e not in unused]
    if only is not None:
        allowed = list(only)
    scores = torch.rand(total, len(allowed), generator=generator)
    choice = torch.topk(scores, top_k, dim=1).indices
    ids = torch.tensor(allowed)[choice]
    weights = torch.softmax(torch.randn(total, top_k, generator=generator), dim=1)
    return x, weights, ids


def local_slice(tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
    start = sum(counts[:RANK])
    return tensor[start: start + counts[RANK]]


def check_close(actual: torch.Tensor, expected: torch.Tensor, what: str, tol: float) -> None:
    assert actual.device == DEVICE, (what, actual.device)
    torch.testing.assert_close(actual.cpu().double(), expected.double(), atol=tol, rtol=tol,
                               msg=lambda m: f"{what} (rank {RANK}): {m}")


SCENARIOS = {
    # name: (token counts per rank, experts, top_k, unused experts, only these experts, owner)
    2: [
        ("rank1_empty", [7, 0], 6, 2, (1, 4), None, None),
        ("uneven", [3, 11], 6, 2, (0,), None, None),
        ("rank1_receives_nothing", [5, 4], 6, 2, (), (0, 1, 2), None),
        ("top1_round_robin", [9, 6], 5, 1, (3,), None, [0, 1, 0, 1, 0]),
    ],
    4: [
        ("uneven_placement", [0, 5, 1, 9], 10, 3, (2, 7), None, None),
        ("round_robin", [4, 0, 6, 2], 8, 2, (5,), None, [0, 1, 2, 3, 0, 1, 2, 3]),
    ],
}


def placement_for(num_experts: int, owner: list[int] | None) -> ExpertPlacement:
    if owner is None:
        return ExpertPlacement.linear(num_experts, WORLD)
    owner_t = torch.tensor(owner)
    local = torch.zeros_like(owner_t)
    for rank in range(WORLD):
        mine = owner_t == rank
        local[mine] = torch.arange(int(mine.sum()))
    return ExpertPlacement(owner_t, local, WORLD)


def grouped_experts_check(group, dtype: torch.dtype) -> str:
    """The dispatched rows through ascend-kernels' ``moe_experts`` with this rank's slice of
    the expert weights (one local expert per row, its routing weight applied by the kernel,
    so combine only adds), against ``moe_experts`` of the whole batch on one process. On npu
    tensors in half precision ``moe_experts`` takes its torch_npu path (npu_grouped_matmul,
    npu_swiglu of the reference)."""
    import ascend_kernels

    counts, num_experts, top_k, inter = [5, 0, 7, 3][:WORLD], 4 * WORLD, 2, 8
    generator = torch.Generator().manual_seed(11)
    w13 = (torch.randn(num_experts, HIDDEN, 2 * inter, generator=generator) / 4).to(dtype)
    w2 = (torch.randn(num_experts, inter, HIDDEN, generator=generator) / 4).to(dtype)
    x_all, w_all, ids_all = make_batch(counts, num_experts, top_k, seed=12, unused=(1,))
    x_all = x_all.to(dtype)
    expected = local_slice(ascend_kernels.moe_experts(x_all, w13, w2, w_all, ids_all), counts)
    placement = ExpertPlacement.linear(num_experts, WORLD)
    mine = (placement.owner == RANK).nonzero().reshape(-1)
    local_w13, local_w2 = w13[mine].to(DEVICE), w2[mine].to(DEVICE)
    x, w, ids = (local_slice(t, counts).to(DEVICE) for t in (x_all, w_all, ids_all))
    for comm in (AllGatherMoEComm(group, placement), AllToAllMoEComm(group, placement)):
        dispatched = comm.dispatch(x, w, ids)
        rows = ascend_kernels.moe_experts(dispatched.hidden_states, local_w13, local_w2,
                                          dispatched.topk_weights.unsqueeze(1),
                                          dispatched.local_expert_ids.unsqueeze(1))
        out = comm.combine(rows, dispatched, apply_weights=False)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        check_close(out, expected.to(dtype).double(), f"moe_experts {comm.method} {dtype}", tol)
    return "ok"


def replicated_check(group) -> dict:
    """The whole batch on every rank (vLLM's TP + EP): ``dispatch_replicated`` /
    ``combine_replicated`` through both paths give every rank the whole batch's output; the
    rows this rank computes are its experts' (token, choice) pairs, of all tokens
    (all-gather) or of the pairs the ranks' token shares send here (all-to-all). Then
    ascend-kernels' ``moe_experts`` with unit weights on the dispatched rows (the npu MoE
    kernel's experts), the routing weights applied by combine."""
    import ascend_kernels

    facts = {}
    for name, tokens, num_experts, top_k in (("odd_tokens", 13, 2 * WORLD + 1, 1),
                                             ("one_token", 1, 2 * WORLD, 1)):
        experts = ToyExperts(num_experts, seed=41)
        placement = ExpertPlacement.linear(num_experts, WORLD)
        x, w, ids = make_batch([tokens], num_experts, top_k, seed=tokens)
        expected = experts.reference(x, w, ids)
        owned_pairs = int((placement.owner[ids] == RANK).sum())
        chosen, rows = [], []
        for threshold in (0, 10**6):
            moe = MoECommunication(group, placement, all2all_min_tokens=threshold)
            dispatched = moe.dispatch_replicated(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE))
            assert dispatched.shares == moe.shares(tokens) and sum(dispatched.shares) == tokens
            if dispatched.method == ALL_GATHER:
                assert dispatched.hidden_states.shape[0] == owned_pairs
            out = moe.combine_replicated(experts.run_local(dispatched, placement, RANK),
                                         dispatched)
            check_close(out, expected, f"replicated {name} {dispatched.method}", 1e-5)
            assert moe.counts == {dispatched.method: 1, ({ALL_GATHER, ALL_TO_ALL} - {
                dispatched.method}).pop(): 0, MC2: 0}, moe.counts
            try:
                moe.combine(out[:0], dispatched)
            except ValueError as error:
                assert "combine_shared" in str(error), error
            else:
                raise AssertionError("combine took rows of dispatch_replicated")
            chosen.append(dispatched.method)
            rows.append(int(dispatched.hidden_states.shape[0]))
        facts[name] = {"chosen": chosen, "rows": rows}
    # The npu kernel's arithmetic: grouped experts with unit weights, weights in combine.
    num_experts, inter, tokens = 2 * WORLD, 8, 21
    generator = torch.Generator().manual_seed(5)
    w13 = (torch.randn(num_experts, HIDDEN, 2 * inter, generator=generator) / 4).bfloat16()
    w2 = (torch.randn(num_experts, inter, HIDDEN, generator=generator) / 4).bfloat16()
    x, w, ids = make_batch([tokens], num_experts, 1, seed=6)
    x = x.bfloat16()
    expected = ascend_kernels.moe_experts(x, w13, w2, w, ids)
    placement = ExpertPlacement.linear(num_experts, WORLD)
    mine = (placement.owner == RANK).nonzero().reshape(-1)
    for threshold in (0, 10**6):
        moe = MoECommunication(group, placement, all2all_min_tokens=threshold)
        dispatched = moe.dispatch_replicated(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE))
        unit = torch.ones(dispatched.hidden_states.shape[0], 1, device=DEVICE)
        rows = ascend_kernels.moe_experts(dispatched.hidden_states, w13[mine].to(DEVICE),
                                          w2[mine].to(DEVICE), unit,
                                          dispatched.local_expert_ids.unsqueeze(1))
        out = moe.combine_replicated(rows, dispatched)
        assert out.dtype == torch.bfloat16
        check_close(out, expected.double(), f"replicated moe_experts {dispatched.method}", 3e-2)
    return facts


def token_groups(size: int) -> TokenGroup:
    """Consecutive ranks in groups of ``size`` (DP ranks of ``size`` TP ranks): this rank's,
    every rank making every group's process group, as torch.distributed asks."""
    mine = None
    for first in range(0, WORLD, size):
        ranks = list(range(first, first + size))
        group = dist.new_group(ranks) if size > 1 else None
        if RANK in ranks:
            mine = TokenGroup(group, RANK - first, size)
    return mine


def shared_check(group) -> dict:
    """Data parallel x tensor parallel: ranks in token groups (one batch per group, held
    alike by its ranks, batches of different sizes), each rank dispatching its share of its
    group's batch by all-gather or all-to-all, every rank getting its group's whole batch
    back, against the single-process reference of every group's batch."""
    facts = {}
    for size in sorted({1, 2, WORLD}):
        if WORLD % size:
            continue
        token_group = token_groups(size)
        batches = [7, 3, 0, 5][: WORLD // size] if size < WORLD else [9]
        num_experts, top_k = 2 * WORLD, 2 if WORLD > 2 else 1
        experts = ToyExperts(num_experts, seed=50 + size)
        placement = ExpertPlacement.linear(num_experts, WORLD)
        x_all, w_all, ids_all = make_batch(batches, num_experts, top_k, seed=60 + size)
        block = RANK // size
        start = sum(batches[:block])
        mine = slice(start, start + batches[block])
        expected = experts.reference(x_all, w_all, ids_all)[mine]
        chosen = []
        for threshold in (0, 10**6):
            moe = MoECommunication(group, placement, all2all_min_tokens=threshold)
            with torch.no_grad():  # (the toy experts are parameters; models run without grad)
                dispatched = moe.dispatch_shared(
                    x_all[mine].to(DEVICE), w_all[mine].to(DEVICE), ids_all[mine].to(DEVICE),
                    token_group=token_group, tokens_per_group=batches)
                out = moe.combine_shared(experts.run_local(dispatched, placement, RANK),
                                         dispatched)
            check_close(out, expected, f"shared size {size} {dispatched.method}", 1e-5)
            chosen.append(dispatched.method)
        try:
            moe.dispatch_shared(x_all[mine].to(DEVICE), w_all[mine].to(DEVICE),
                                ids_all[mine].to(DEVICE), token_group=token_group,
                                tokens_per_group=[b + 1 for b in batches])
        except ValueError as error:
            assert "one batch size per group" in str(error), error
        else:
            raise AssertionError("dispatch_shared took batch sizes that are not this group's")
        facts[f"groups_of_{size}"] = {"chosen": chosen, "batches": batches}
    return facts


def mc2_check(group) -> dict:
    """torch_npu's MC2 path (the reference's ``npu_moe_distribute_dispatch_v2`` /
    ``_combine_v2``) through the NPU communicator's ``moe_communication``: hidden size 1024,
    bfloat16, ascend-kernels' ``moe_experts`` on the dispatched rows (padding rows included),
    for token groups of one rank (data parallel) and of every rank (tensor parallel), against
    ``moe_experts`` of each batch on one process; and the MoE path refusing a graph capture
    MC2 cannot serve."""
    import ascend_kernels
    from ascend_core.distributed.npu_communicator import NPUCommunicator

    hidden, inter, num_experts = 1024, 32, 4 * WORLD
    communicator = NPUCommunicator(dist.new_group(backend="gloo"), device=DEVICE,
                                   device_group=group, unique_name="ep:mc2")
    generator = torch.Generator().manual_seed(17)
    w13 = (torch.randn(num_experts, hidden, 2 * inter, generator=generator) / 32).bfloat16()
    w2 = (torch.randn(num_experts, inter, hidden, generator=generator) / 8).bfloat16()
    placement = ExpertPlacement.linear(num_experts, WORLD)
    mine_w = (placement.owner == RANK).nonzero().reshape(-1)
    local_w13, local_w2 = w13[mine_w].to(DEVICE), w2[mine_w].to(DEVICE)
    moe = communicator.moe_communication(placement)
    assert moe.mc2 is not None and moe.mc2.comm_name == communicator.mc2_comm_name()
    facts = {"comm_name": moe.mc2.comm_name}
    for size, batches in ((1, [5, 2][:WORLD]), (WORLD, [6])):
        token_group = token_groups(size) if size > 1 else TokenGroup(None, 0, 1)
        generator = torch.Generator().manual_seed(size)
        total = sum(batches)
        x_all = torch.randn(total, hidden, generator=generator).bfloat16()
        ids_all = torch.stack([torch.randperm(num_experts, generator=generator)[:2]
                               for _ in range(total)])
        w_all = torch.softmax(torch.randn(total, 2, generator=generator), dim=1)
        block = RANK // size
        start = sum(batches[:block])
        mine = slice(start, start + batches[block])
        expected = ascend_kernels.moe_experts(x_all[mine], w13, w2, w_all[mine], ids_all[mine])
        dispatched = moe.dispatch_shared(x_all[mine].to(DEVICE), w_all[mine].to(DEVICE),
                                         ids_all[mine].to(DEVICE), token_group=token_group,
                                         tokens_per_group=batches)
        assert dispatched.method == MC2, dispatched.method
        unit = torch.ones(dispatched.hidden_states.shape[0], 1, device=DEVICE)
        rows = ascend_kernels.moe_experts(dispatched.hidden_states, local_w13, local_w2, unit,
                                          dispatched.local_expert_ids.unsqueeze(1))
        out = moe.combine_shared(rows, dispatched)
        assert out.dtype == torch.bfloat16 and out.shape == (batches[block], hidden)
        check_close(out, expected.double(), f"mc2 groups of {size}", 3e-2)
        facts[f"groups_of_{size}"] = {"rows": int(dispatched.hidden_states.shape[0]),
                                      "valid": int(dispatched.tokens_per_expert.sum())}
    facts["counts"] = dict(moe.counts)
    # A layer MC2 cannot serve (hidden 16): eager batches take the other paths, a capture fails.
    small = communicator.moe_communication(ExpertPlacement.linear(2 * WORLD, WORLD))
    facts["small_why_not"] = small.mc2_why_not(HIDDEN, torch.bfloat16, 1)
    x = torch.ones(3, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    assert small.select(3, 1, x) == ALL_GATHER
    graph = torch.npu.NPUGraph()
    try:
        with torch.npu.graph(graph):
            small.select(3, 1, x)
    except RuntimeError as error:
        facts["capture_error"] = str(error)
    communicator.destroy()
    return facts


def moe_suite(group) -> dict:
    facts = {"moe_experts": [grouped_experts_check(group, dtype)
                             for dtype in (torch.float32, torch.bfloat16)]}
    for seed, (name, counts, num_experts, top_k, unused, only, owner) in enumerate(
            SCENARIOS[WORLD]):
        experts = ToyExperts(num_experts, seed=100 + seed)
        placement = placement_for(num_experts, owner)
        x_all, w_all, ids_all = make_batch(counts, num_experts, top_k, seed, unused, only)
        expected = local_slice(experts.reference(x_all, w_all, ids_all), counts)
        x, w, ids = (local_slice(t, counts).to(DEVICE) for t in (x_all, w_all, ids_all))
        owned_pairs = int((placement.owner[ids_all] == RANK).sum())
        rows = {}
        for comm in (AllGatherMoEComm(group, placement), AllToAllMoEComm(group, placement)):
            dispatched = comm.dispatch(x, w, ids)
            assert dispatched.method == comm.method
            assert dispatched.hidden_states.shape == (owned_pairs, HIDDEN), (
                name, comm.method, dispatched.hidden_states.shape, owned_pairs)
            out = comm.combine(experts.run_local(dispatched, placement, RANK), dispatched)
            check_close(out, expected, f"{name} {comm.method}", 1e-5)
            # The expert applies the weights itself (vLLM's kernels do): combine only adds.
            dispatched = comm.dispatch(x, w, ids)
            rows_weighted = experts.run_local(dispatched, placement, RANK, weigh_rows=True)
            out = comm.combine(rows_weighted, dispatched, apply_weights=False)
            check_close(out, expected, f"{name} {comm.method} pre-weighted", 1e-5)
            rows[comm.method] = dispatched.tokens_per_expert.tolist()
        assert rows[ALL_GATHER] == rows[ALL_TO_ALL], (name, rows)
        # Per batch: the same layer takes either path, and every rank agrees on which.
        chosen = []
        for threshold in (0, 10**6):
            moe = MoECommunication(group, placement, all2all_min_tokens=threshold)
            dispatched = moe.dispatch(x, w, ids)
            out = moe.combine(experts.run_local(dispatched, placement, RANK), dispatched)
            check_close(out, expected, f"{name} per-batch {dispatched.method}", 1e-5)
            chosen.append(dispatched.method)
        # bfloat16 tokens through the all-to-all path (float32 accumulation of the choices).
        comm = AllToAllMoEComm(group, placement)
        dispatched = comm.dispatch(x.bfloat16(), w, ids)
        out = comm.combine(experts.run_local(dispatched, placement, RANK), dispatched)
        assert out.dtype == torch.bfloat16
        check_close(out, expected, f"{name} bf16", 0.1)
        facts[name] = {"rows": rows[ALL_TO_ALL], "chosen": chosen, "tokens": counts[RANK]}
    facts["replicated"] = replicated_check(group)
    facts["shared"] = shared_check(group)
    # Both ranks given a bad expert id fail before any collective, with the id in the message.
    placement = ExpertPlacement.linear(4, WORLD)
    bad = torch.tensor([[0, 4]], device=DEVICE)
    for comm in (AllGatherMoEComm(group, placement), AllToAllMoEComm(group, placement),
                 MoECommunication(group, placement)):
        try:
            comm.dispatch(torch.ones(1, HIDDEN, device=DEVICE),
                          torch.full((1, 2), 0.5, device=DEVICE), bad)
        except ValueError as error:
            assert "expert id 4" in str(error) and "[0, 4)" in str(error), error
        else:
            raise AssertionError(f"{type(comm).__name__} took expert id 4 of 4 experts")
    return facts


def communicator_suite() -> dict:
    from ascend_core.distributed.npu_communicator import NPUCommunicator

    cpu_group = dist.new_group(backend="gloo")
    comm = NPUCommunicator(cpu_group, device=DEVICE, device_group=dist.group.WORLD,
                           unique_name="ep:0")
    assert comm.world_size == WORLD and comm.rank_in_group == RANK
    facts = {}
    base = torch.arange(6.0).reshape(2, 3)
    summed = comm.all_reduce((base + RANK).to(DEVICE))
    check_close(summed, base * WORLD + sum(range(WORLD)), "all_reduce", 0)
    gathered = comm.all_gather((base + 10 * RANK).to(DEVICE), dim=1)
    check_close(gathered, torch.cat([base + 10 * r for r in range(WORLD)], dim=1),
                "all_gather dim 1", 0)
    full = torch.arange(float(4 * WORLD * 2)).reshape(4 * WORLD, 2)
    scattered = comm.reduce_scatter((full * (RANK + 1)).to(DEVICE), dim=0)
    factor = sum(r + 1 for r in range(WORLD))
    check_close(scattered, (full * factor)[4 * RANK: 4 * RANK + 4], "reduce_scatter", 0)
    # Uneven rows per rank, rank 1 with none.
    sizes = [3, 0, 2, 1][:WORLD]
    mine = torch.full((sizes[RANK], 2), float(RANK)).to(DEVICE)
    gatherv = comm.all_gatherv([mine, mine + 1], dim=0, sizes=sizes)
    expected = torch.cat([torch.full((n, 2), float(r)) for r, n in enumerate(sizes)])
    check_close(gatherv[0], expected, "all_gatherv", 0)
    check_close(gatherv[1], expected + 1, "all_gatherv second tensor", 0)
    rows = torch.arange(float(sum(sizes) * 3)).reshape(sum(sizes), 3)
    reduced = comm.reduce_scatterv((rows * (RANK + 1)).T.contiguous().to(DEVICE), dim=1,
                                   sizes=sizes)
    start = sum(sizes[:RANK])
    check_close(reduced, (rows * factor)[start: start + sizes[RANK]].T, "reduce_scatterv dim 1", 0)
    # all_to_all: rank r sends (r + d) rows to rank d, each row tagged (source, destination).
    splits = [RANK + d for d in range(WORLD)]
    payload = torch.cat([torch.tensor([[RANK, d]] * n, dtype=torch.float32)
                         for d, n in enumerate(splits)]).reshape(-1, 2)
    arrived = comm.all_to_all(payload.to(DEVICE), input_split_sizes=splits)
    expected = torch.cat([torch.tensor([[s, RANK]] * (s + RANK), dtype=torch.float32)
                          for s in range(WORLD)]).reshape(-1, 2)
    check_close(arrived, expected, "all_to_all exchanged splits", 0)
    back = comm.all_to_all(arrived, output_split_sizes=splits,
                           input_split_sizes=[s + RANK for s in range(WORLD)])
    check_close(back, payload, "all_to_all given both splits", 0)
    even = comm.all_to_all(torch.full((WORLD * 2, 1), float(RANK)).to(DEVICE))
    check_close(even, torch.arange(WORLD).repeat_interleave(2).float().unsqueeze(1),
                "all_to_all even", 0)
    facts["collectives"] = "ok"
    # The MoE pair, per batch, over the communicator's group.
    counts = [6, 0, 3, 8][:WORLD]
    experts = ToyExperts(2 * WORLD, seed=7)
    placement = ExpertPlacement.linear(2 * WORLD, WORLD)
    x_all, w_all, ids_all = make_batch(counts, 2 * WORLD, 1, seed=3)
    expected = local_slice(experts.reference(x_all, w_all, ids_all), counts)
    x, w, ids = (local_slice(t, counts).to(DEVICE) for t in (x_all, w_all, ids_all))
    methods = []
    for threshold in (0, 10**6):
        moe = comm.moe_communication(placement, all2all_min_tokens=threshold)
        dispatched = moe.dispatch(x, w, ids)
        out = moe.combine(experts.run_local(dispatched, placement, RANK), dispatched)
        check_close(out, expected, f"communicator moe {dispatched.method}", 1e-5)
        methods.append(dispatched.method)
        comm._moe_comms.clear()
    facts["moe"] = methods
    if BACKEND == "hccl":
        facts["mc2"] = mc2_check(dist.group.WORLD)
    for call, needle in (
        (lambda: comm.reduce_scatter(torch.ones(WORLD + 1, 2, device=DEVICE), dim=0),
         "not divisible"),
        (lambda: comm.all_gather(torch.ones(2, device=DEVICE), dim=3), "dim=3 is out of range"),
        (lambda: comm.all_to_all(torch.ones(3, device=DEVICE), input_split_sizes=[1] * WORLD),
         "add up to"),
        (lambda: comm.all_gatherv(torch.ones(5, device=DEVICE), sizes=[1] * WORLD),
         "one row count per rank"),
        (lambda: comm.reduce_scatterv(torch.ones(5, device=DEVICE), dim=0, sizes=[1] * WORLD),
         "adding up to it"),
    ):
        try:
            call()
        except ValueError as error:
            assert needle in str(error), (needle, error)
        else:
            raise AssertionError(f"no error for {needle!r}")
    comm.destroy()
    return facts


def vllm_data_parallel_suite() -> dict:
    """vLLM's own data-parallel MoE dispatch/combine (its all-gather/reduce-scatter manager in
    the ``ep`` group) through the NPU communicator, with uneven tokens per DP rank."""
    from vllm.config import get_current_vllm_config
    from vllm.distributed import parallel_state
    from vllm.forward_context import get_forward_context, set_forward_context

    ep = parallel_state.get_ep_group()
    communicator = ep.device_communicator
    counts = [3, 1, 0, 2][:WORLD]
    x = torch.arange(float(counts[RANK] * 4)).reshape(-1, 4) + 100 * RANK
    ids = torch.arange(counts[RANK] * 2).reshape(-1, 2) + 10 * RANK
    weights = ids.float() / 7
    config = get_current_vllm_config()
    with set_forward_context(None, config, num_tokens=counts[RANK],
                             num_tokens_across_dp=torch.tensor(counts)):
        with get_forward_context().dp_metadata.sp_local_sizes(1):
            all_x, all_w, all_ids = ep.dispatch(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE))
            expected_x = torch.cat([torch.arange(float(n * 4)).reshape(-1, 4) + 100 * r
                                    for r, n in enumerate(counts)])
            expected_ids = torch.cat([torch.arange(n * 2).reshape(-1, 2) + 10 * r
                                      for r, n in enumerate(counts)])
            check_close(all_x, expected_x, "vLLM dispatch hidden", 0)
            check_close(all_ids, expected_ids, "vLLM dispatch ids", 0)
            check_close(all_w, expected_ids.float() / 7, "vLLM dispatch weights", 0)
            # Each rank's partial result for every token; combine sums them per owner rank.
            partial = all_x * (RANK + 1)
            out = ep.combine(partial)
            start = sum(counts[:RANK])
            factor = sum(r + 1 for r in range(WORLD))
            check_close(out, expected_x[start: start + counts[RANK]] * factor, "vLLM combine", 0)
            into = torch.empty(counts[RANK], 4, device=DEVICE)
            ep.combine_into_output(partial, into)
            check_close(into, expected_x[start: start + counts[RANK]] * factor,
                        "vLLM combine_into_output", 0)
    return {"ep_communicator": type(communicator).__name__,
            "all2all_manager": type(communicator.all2all_manager).__name__}


def vllm_data_parallel_config():
    """A vLLM config of data parallel WORLD with expert parallel, launched externally."""
    import os

    from vllm.config import ParallelConfig, VllmConfig

    os.environ.update(RANK=str(RANK), WORLD_SIZE=str(WORLD), LOCAL_RANK="0")
    parallel = ParallelConfig(data_parallel_size=WORLD, data_parallel_rank=RANK,
                              enable_expert_parallel=True,
                              distributed_executor_backend="external_launcher")
    parallel.is_moe_model = True
    return VllmConfig(parallel_config=parallel)


def init_vllm_data_parallel() -> None:
    """vLLM's distributed state for the current config, on the npu platform (set here: the
    ``core`` session installs no ascend-plugin, whose entry point would pick it)."""
    import vllm.platforms
    from vllm.distributed import parallel_state

    from ascend_core.platform.npu import AscendPlatform

    vllm.platforms._current_platform = AscendPlatform()

    parallel_state.init_distributed_environment(
        world_size=WORLD, rank=RANK, local_rank=0, distributed_init_method="file://" + STORE,
        backend=BACKEND)
    parallel_state.initialize_model_parallel(1, 1)


def main() -> None:
    if SUITE == "moe":
        dist.init_process_group(BACKEND, init_method="file://" + STORE, rank=RANK,
                                world_size=WORLD)
        facts = moe_suite(dist.group.WORLD)
    else:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(vllm_data_parallel_config()):
            init_vllm_data_parallel()
            facts = {**communicator_suite(), **vllm_data_parallel_suite()}
    dist.barrier()
    print(json.dumps({"rank": RANK, "device": DEVICE.type, **facts}))


if __name__ == "__main__":
    main()
