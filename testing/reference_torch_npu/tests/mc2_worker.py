"""One rank of the MC2 dispatch / combine test (``test_ops_moe_distribute.py``).

argv: rank, world size, store file, reference path. Every rank draws every rank's batch from
one seed, so each can build what its experts must receive and what its tokens must get back
without asking the others. Prints one JSON line of facts.
"""

from __future__ import annotations

import datetime
import json
import sys

RANK, WORLD, STORE, REFERENCE = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
sys.path.insert(0, REFERENCE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_npu  # noqa: E402, F401

HIDDEN, TOP_K, EXPERTS = 1024, 3, 8
LOCAL = EXPERTS // WORLD


def batch(rank: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K]
                       for _ in range(tokens)]).to(torch.int32)
    scales = torch.rand(tokens, TOP_K, generator=generator)
    return x, ids, scales


def expected_rows(sizes: list[int], seed: int, active: list[int]) -> list[torch.Tensor]:
    """The rows this rank's local experts must receive: per expert, source rank after source
    rank, tokens in order."""
    per_expert = []
    for local in range(LOCAL):
        expert = RANK * LOCAL + local
        rows = []
        for source, tokens in enumerate(sizes):
            x, ids, _ = batch(source, tokens, seed)
            for token in range(active[source]):
                if expert in ids[token].tolist():
                    rows.append(x[token])
        per_expert.append(torch.stack(rows) if rows else torch.empty(0, HIDDEN))
    return per_expert


def round_trip(group: str, sizes: list[int], seed: int, active: list[int] | None = None,
               global_bs: int = 0) -> dict:
    active = active or sizes
    x, ids, scales = batch(RANK, sizes[RANK], seed)
    device = torch.device("npu", 0)
    mask = None
    if active != sizes:
        mask = (torch.arange(sizes[RANK]) < active[RANK]).to(device)
    out = torch_npu.npu_moe_distribute_dispatch_v2(
        x.to(device), ids.to(device), group, WORLD, RANK, EXPERTS, x_active_mask=mask,
        global_bs=global_bs, expert_token_nums_type=1)
    expand_x, _, assist, counts, recv_counts, _, expand_scales = out
    want = expected_rows(sizes, seed, active)
    valid = int(counts.sum())
    got = list(torch.split(expand_x[:valid].cpu(), counts.tolist()))
    layout = all(torch.equal(g, w.to(torch.bfloat16)) for g, w in zip(got, want, strict=True))
    # The experts: expert e multiplies its rows by (e + 1).
    factors = torch.repeat_interleave(
        torch.arange(RANK * LOCAL, RANK * LOCAL + LOCAL) + 1.0, counts.cpu())
    outputs = expand_x.clone()
    outputs[:valid] = (expand_x[:valid].cpu().float() * factors[:, None]).to(torch.bfloat16).to(device)
    combined = torch_npu.npu_moe_distribute_combine_v2(
        outputs, ids.to(device), assist, recv_counts, scales.to(device), group, WORLD, RANK,
        EXPERTS, x_active_mask=mask, global_bs=global_bs).cpu()
    rows = (x.float() * 1.0)[:, None, :] * (ids.float() + 1.0)[:, :, None]
    reference = (rows.to(torch.bfloat16).float() * scales[:, :, None]).sum(1)
    reference[active[RANK]:] = 0
    return {"device": expand_x.device.type, "rows": list(expand_x.shape),
            "counts": counts.tolist(), "layout": layout, "expand_scales": expand_scales,
            "recv_counts_dtype": str(recv_counts.dtype), "count_total": int(recv_counts[-1]),
            "combine_error": float((combined.float() - reference).abs().max()
                                   / reference.abs().max().clamp(min=1e-6)),
            "combine_dtype": str(combined.dtype)}


def error_of(call) -> str:
    try:
        call()
    except (RuntimeError, NotImplementedError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def main() -> None:
    dist.init_process_group("hccl", init_method=f"file://{STORE}", rank=RANK,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    torch.npu.set_device(0)
    group = dist.group.WORLD._get_backend(torch.device("npu")).get_hccl_comm_name(RANK)
    facts = {"rank": RANK,
             "even": round_trip(group, [6] * WORLD, seed=1),
             "uneven": round_trip(group, [4, 9][:WORLD], seed=2, global_bs=9 * WORLD),
             "masked": round_trip(group, [5] * WORLD, seed=3, active=[5, 2][:WORLD])}
    x, ids, scales = batch(RANK, 4 + RANK, 4)
    facts["errors"] = {
        "bs_differs": error_of(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
            x, ids, group, WORLD, RANK, EXPERTS)),
        "unknown_group": error_of(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
            x, ids, "no such group", WORLD, RANK, EXPERTS)),
        "quant_mode": error_of(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
            x, ids, group, WORLD, RANK, EXPERTS, quant_mode=2)),
        "small_hidden": error_of(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
            x[:, :512].contiguous(), ids, group, WORLD, RANK, EXPERTS)),
        "repeated_expert": error_of(lambda: torch_npu.npu_moe_distribute_dispatch_v2(
            x[:1], torch.tensor([[1, 1, 2]], dtype=torch.int32), group, WORLD, RANK, EXPERTS)),
    }
    del scales
    print(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
