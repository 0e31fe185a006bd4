"""Expert weights held in npu tensors, moved between two processes over the ``hccl`` backend of
the reference torch_npu (gloo underneath; testing/reference_torch_npu): the batched
point-to-point exchange (``batch_isend_irecv``) that EPLB's rearrangement runs over the EP
group's device group on the npu target. Every row must land in npu memory, on the right slot."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ascend_eplb.exchange import apply_transfer_plan
from ascend_eplb.transfer import plan_transfers

from eplb_dist import expert_rows

REFERENCE = str(Path(__file__).resolve().parents[3] / "testing" / "reference_torch_npu")
NUM_PARAMS = 2


def _rank_main(rank: int, world_size: int, init_method: str, old, new) -> None:
    sys.path.insert(0, REFERENCE)
    import torch_npu  # noqa: F401 - registers the npu device and the hccl backend

    torch.set_num_threads(1)
    dist.init_process_group("hccl", init_method=init_method, rank=rank, world_size=world_size)
    try:
        plan = plan_transfers(old, new, world_size, expert_bytes=4 * (12 + 5))
        assert plan.bytes_between_ranks > 0  # the test must cross ranks
        weights = [[expert_rows(old, layer, rank, world_size, p).to("npu")
                    for p in range(NUM_PARAMS)] for layer in range(old.size(0))]
        staged = apply_transfer_plan(plan, weights, rank, group=dist.group.WORLD)
        assert all(row.device.type == "npu" for row in staged.rows)
        assert staged.rows_received > 0 and staged.rows_sent > 0
        for layer in range(old.size(0)):
            for p in range(NUM_PARAMS):
                assert weights[layer][p].device.type == "npu"
                expected = expert_rows(plan.phy2log, layer, rank, world_size, p)
                assert torch.equal(weights[layer][p].cpu(), expected), (rank, layer, p)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_processes_exchange_npu_expert_rows_over_hccl():
    # Layer 0: the ranks swap their experts; layer 1: each rank's rows reverse, and two
    # experts change rank.
    old = torch.tensor([[0, 1, 2, 3, 4, 5], [5, 4, 3, 2, 1, 0]])
    new = torch.tensor([[3, 4, 5, 0, 1, 2], [3, 4, 1, 2, 5, 0]])
    with tempfile.TemporaryDirectory() as folder:
        init_method = "file://" + os.path.join(folder, "store")
        mp.spawn(_rank_main, args=(2, init_method, old, new), nprocs=2, join=True)
