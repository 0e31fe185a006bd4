"""torch_npu's MC2 expert-parallel token exchange: ``npu_moe_distribute_dispatch_v2`` and
``npu_moe_distribute_combine_v2``, computed with plain torch over the reference ``hccl``.

Each rank of an expert-parallel group calls the pair in step. Dispatch sends every
(token, choice) of its batch to the rank owning the chosen expert and returns the rows this
rank's experts compute; combine sends the experts' outputs back and sums each token's
choices weighted by its routing scales. The group is named, not passed: the ops take the
HCCL communicator name that ``ProcessGroupHCCL.get_hccl_comm_name(rank)`` gives (on the
reference: :func:`torch_npu._registration.hccl_backend_named`).

Modelled from Ascend/op-plugin ``docs/context/torch_npu-npu_moe_distribute_dispatch_v2.md`` /
``..._combine_v2.md`` and the binding's allocation (``MoeDistributeDispatchV2KernelOpApi.cpp``)
for the Atlas A3 products, without tensor parallelism (``tp_world_size`` 0 or 1), shared-expert
ranks, quantisation or the zero / copy / constant experts (each refused as unmodelled):

- ``moe_expert_num`` experts split evenly, rank ``r`` holding ``r * L .. r * L + L - 1``
  (``L = moe_expert_num / ep_world_size``);
- ``expand_x`` ``[A, H]`` with ``A = global_bs * min(L, K)`` (``global_bs`` 0 means
  ``BS * ep_world_size``): rows grouped by local expert, within an expert by source rank,
  within a source by token; only the first ``sum(expert_token_nums)`` rows are valid (the
  rest are zero here, undefined on an NPU);
- ``expert_token_nums`` int64 ``[L]``: rows per local expert (``expert_token_nums_type`` 1)
  or their running sum (0);
- ``ep_recv_counts`` int32 ``[ep_world_size * L]``: running sum of rows received, in
  (local expert, source rank) order; combine takes it back as ``ep_send_counts``;
- ``assist_info_for_combine`` int32 ``[max(BS * K, A * 128)]``: the first ``BS * K`` entries
  hold each (token, choice)'s place among its rank's rows for that expert. The page says
  only combine may read it; combine here finds each row by it, so a wrong one gives wrong
  sums, as on an NPU;
- ``x_active_mask`` bool ``[BS]``, true rows first: false rows are not sent and combine gives
  them zeros;
- ``dynamic_scales`` (zeros: no quantisation), ``tp_recv_counts`` ``[tp_world_size]`` and
  ``expand_scales`` (None: A2 only) as allocated.
"""

from __future__ import annotations

import torch

from torch_npu._unmodelled import unmodelled_argument

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_MAX_BS = 512
_MAX_K = 16
_MAX_EXPERTS = 1024
_DISPATCH_H = (1024, 8192)
_COMBINE_H = (1024, 7168)
_DISPATCH_EP = (2, 768)
_COMBINE_EP = (2, 384)


def _refuse(op: str, **non_defaults) -> None:
    """The unmodelled error for the first argument given something other than its default;
    ``non_defaults`` maps the argument to ``(value, default)``."""
    for argument, (value, default) in non_defaults.items():
        if (value is not None) if default is None else (value != default):
            raise unmodelled_argument(op, argument, value)


def _backend(op: str, group_ep: str, ep_world_size: int, ep_rank_id: int, ep_range):
    from torch_npu._registration import hccl_backend_named

    if not ep_range[0] <= ep_world_size <= ep_range[1]:
        raise RuntimeError(f"{op}: ep_world_size={ep_world_size} is outside the supported "
                           f"[{ep_range[0]}, {ep_range[1]}].")
    backend = hccl_backend_named(group_ep)
    if backend is None:
        raise RuntimeError(f"{op}: group_ep={group_ep!r} names no HCCL communicator of this "
                           f"process; pass get_hccl_comm_name(rank) of the EP group's backend.")
    if backend.size() != ep_world_size or backend.rank() != ep_rank_id:
        raise RuntimeError(f"{op}: group_ep {group_ep!r} has {backend.size()} ranks and this is "
                           f"rank {backend.rank()}, but ep_world_size={ep_world_size}, "
                           f"ep_rank_id={ep_rank_id}.")
    return backend


def _check_common(op, x_name, x, expert_ids, moe_expert_num, ep_world_size, h_range,
                  x_active_mask, tp_world_size, expert_shard_type, shared_expert_rank_num):
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _HALF_DTYPES:
        raise RuntimeError(f"{op}: {x_name} must be a 2-D float16 or bfloat16 tensor, got "
                           f"{getattr(x, 'dtype', type(x).__name__)} "
                           f"{tuple(getattr(x, 'shape', ()))}.")
    if not h_range[0] <= x.shape[1] <= h_range[1]:
        raise RuntimeError(f"{op}: the hidden size {x.shape[1]} of {x_name} is outside the "
                           f"supported [{h_range[0]}, {h_range[1]}].")
    if expert_ids.dim() != 2 or expert_ids.dtype != torch.int32:
        raise RuntimeError(f"{op}: expert_ids must be a 2-D int32 tensor [BS, K], got "
                           f"{expert_ids.dtype} {tuple(expert_ids.shape)}.")
    bs, k = expert_ids.shape
    if not 0 < bs <= _MAX_BS or not 0 < k <= _MAX_K:
        raise RuntimeError(f"{op}: expert_ids is [BS={bs}, K={k}]; BS must be in [1, {_MAX_BS}] "
                           f"and K in [1, {_MAX_K}].")
    if not 1 <= moe_expert_num <= _MAX_EXPERTS or moe_expert_num % ep_world_size:
        raise RuntimeError(f"{op}: moe_expert_num={moe_expert_num} must be in [1, {_MAX_EXPERTS}] "
                           f"and divisible by ep_world_size={ep_world_size}.")
    if int(expert_ids.min()) < 0 or int(expert_ids.max()) >= moe_expert_num:
        raise RuntimeError(f"{op}: expert_ids holds ids outside [0, {moe_expert_num}).")
    ordered = torch.sort(expert_ids, dim=1).values
    if k > 1 and bool((ordered[:, 1:] == ordered[:, :-1]).any()):
        raise RuntimeError(f"{op}: a row of expert_ids names one expert twice.")
    if tp_world_size not in (0, 1):
        raise unmodelled_argument(op, "tp_world_size", tp_world_size)
    if expert_shard_type != 0:
        raise RuntimeError(f"{op}: expert_shard_type={expert_shard_type}; only 0 is supported.")
    if shared_expert_rank_num != 0:
        raise unmodelled_argument(op, "shared_expert_rank_num", shared_expert_rank_num)
    active = torch.ones(bs, dtype=torch.bool)
    if x_active_mask is not None:
        if x_active_mask.shape != (bs,) or x_active_mask.dtype != torch.bool:
            raise RuntimeError(f"{op}: x_active_mask must be bool [BS={bs}] (the 2-D form is "
                               f"not modelled), got {x_active_mask.dtype} "
                               f"{tuple(x_active_mask.shape)}.")
        active = x_active_mask.cpu()
        if bool((active[1:] & ~active[:-1]).any()):
            raise RuntimeError(f"{op}: x_active_mask must hold its true entries before its "
                               "false ones.")
    return bs, k, moe_expert_num // ep_world_size, active


def _alltoall(backend, out: torch.Tensor, data: torch.Tensor, out_splits, in_splits) -> None:
    backend.alltoall_base(out, data.contiguous(), list(out_splits), list(in_splits)).wait()


def _pairs_to_ranks(expert_ids: torch.Tensor, active: torch.Tensor, local: int, ep: int):
    """This rank's active (token, choice) pairs in send order (destination rank, local
    expert, token), with the count per (destination, local expert) and each pair's place
    in its (expert) block."""
    bs, k = expert_ids.shape
    ids = expert_ids.long().reshape(-1)
    token = torch.arange(bs).repeat_interleave(k)
    keep = active.repeat_interleave(k)
    order = torch.argsort(ids * bs + token)  # expert-major = (destination, local) major
    order = order[keep[order]]
    counts = torch.bincount(ids[order], minlength=ep * local).reshape(ep, local)
    # place of each pair among this rank's pairs of its expert
    place = torch.zeros(bs * k, dtype=torch.int64)
    starts = torch.cumsum(counts.reshape(-1), 0) - counts.reshape(-1)
    place[order] = torch.arange(order.numel()) - starts[ids[order]]
    return order, counts, place


def npu_moe_distribute_dispatch_v2(
        x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
        x_active_mask=None, expert_scales=None, elastic_info=None, group_tp="",
        tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
        shared_expert_rank_num=0, quant_mode=0, global_bs=0, expert_token_nums_type=1,
        comm_alg="", zero_expert_num=0, copy_expert_num=0, const_expert_num=0):
    """``torch_npu.npu_moe_distribute_dispatch_v2`` (see the module docstring) -> ``(expand_x,
    dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts,
    tp_recv_counts, expand_scales)``."""
    op = "npu_moe_distribute_dispatch_v2"
    _refuse(op, scales=(scales, None), elastic_info=(elastic_info, None),
            quant_mode=(quant_mode, 0), comm_alg=(comm_alg, ""),
            zero_expert_num=(zero_expert_num, 0), copy_expert_num=(copy_expert_num, 0),
            const_expert_num=(const_expert_num, 0))
    if expert_scales is not None:
        raise RuntimeError(f"{op}: expert_scales is for the A2 products' hierarchical "
                           "algorithm; the A3 products do not take it.")
    if expert_token_nums_type not in (0, 1):
        raise RuntimeError(f"{op}: expert_token_nums_type={expert_token_nums_type}; expected 0 "
                           "(running sum) or 1 (counts).")
    bs, k, local, active = _check_common(op, "x", x, expert_ids, moe_expert_num, ep_world_size,
                                         _DISPATCH_H, x_active_mask, tp_world_size,
                                         expert_shard_type, shared_expert_rank_num)
    backend = _backend(op, group_ep, ep_world_size, ep_rank_id, _DISPATCH_EP)
    ep = ep_world_size
    # every rank's BS: global_bs 0 needs the same BS everywhere, otherwise room for the most
    sizes = torch.empty(ep, dtype=torch.int64)
    _alltoall(backend, sizes, torch.full((ep,), bs, dtype=torch.int64), [1] * ep, [1] * ep)
    if global_bs == 0:
        if int(sizes.min()) != int(sizes.max()):
            raise RuntimeError(f"{op}: global_bs=0 needs the same BS on every rank, but the "
                               f"ranks hold {sizes.tolist()}; pass global_bs = max BS * "
                               f"ep_world_size.")
        global_bs = bs * ep
    elif global_bs % ep or global_bs // ep < int(sizes.max()):
        raise RuntimeError(f"{op}: global_bs={global_bs} must be the largest BS "
                           f"({int(sizes.max())}) times ep_world_size={ep}.")
    rows_out = global_bs * min(local, k)

    order, send_counts, place = _pairs_to_ranks(expert_ids.cpu(), active, local, ep)
    recv_counts = torch.empty(ep * local, dtype=torch.int64)
    _alltoall(backend, recv_counts, send_counts.reshape(-1), [local] * ep, [local] * ep)
    recv_counts = recv_counts.reshape(ep, local)  # [source, local expert]
    token = torch.div(order, k, rounding_mode="floor")
    received = x.new_empty((int(recv_counts.sum()), x.shape[1]))
    _alltoall(backend, received, x[token], recv_counts.sum(1).tolist(),
              send_counts.sum(1).tolist())
    # source-major blocks -> (local expert, source) order
    blocks = list(torch.split(received, recv_counts.reshape(-1).tolist()))
    expert_major = [blocks[source * local + expert]
                    for expert in range(local) for source in range(ep)]
    if sum(block.shape[0] for block in expert_major) > rows_out:
        raise RuntimeError(f"{op}: {int(recv_counts.sum())} rows arrived but expand_x holds "
                           f"{rows_out} (global_bs * min(local experts, K)).")
    expand_x = x.new_zeros((rows_out, x.shape[1]))
    filled = torch.cat(expert_major) if expert_major else received
    expand_x[: filled.shape[0]] = filled

    per_expert = recv_counts.sum(0)
    expert_token_nums = per_expert if expert_token_nums_type == 1 else torch.cumsum(per_expert, 0)
    ep_recv_counts = torch.cumsum(recv_counts.t().reshape(-1), 0).to(torch.int32)
    assist = torch.zeros(max(bs * k, rows_out * 128), dtype=torch.int32)
    assist[: bs * k] = place.to(torch.int32)
    tp_recv_counts = torch.full((tp_world_size,), filled.shape[0], dtype=torch.int32)
    dynamic_scales = torch.zeros(rows_out, dtype=torch.float32)
    return (expand_x, dynamic_scales, assist, expert_token_nums.to(torch.int64),
            ep_recv_counts, tp_recv_counts, None)


def npu_moe_distribute_combine_v2(
        expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
        group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
        x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
        ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
        const_expert_v=None, group_tp="", tp_world_size=0, tp_rank_id=0,
        expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0,
        comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
        const_expert_num=0):
    """``torch_npu.npu_moe_distribute_combine_v2`` (see the module docstring) -> ``[BS, H]``:
    each active token's sum over its choices of ``expert_scales`` times the expert's row
    (float32, cast to ``expand_x``'s dtype), plus ``shared_expert_x`` unweighted."""
    op = "npu_moe_distribute_combine_v2"
    _refuse(op, expand_scales=(expand_scales, None), elastic_info=(elastic_info, None),
            ori_x=(ori_x, None), const_expert_alpha_1=(const_expert_alpha_1, None),
            const_expert_alpha_2=(const_expert_alpha_2, None),
            const_expert_v=(const_expert_v, None), comm_quant_mode=(comm_quant_mode, 0),
            comm_alg=(comm_alg, ""), zero_expert_num=(zero_expert_num, 0),
            copy_expert_num=(copy_expert_num, 0), const_expert_num=(const_expert_num, 0))
    bs, k, local, active = _check_common(op, "expand_x", expand_x, expert_ids, moe_expert_num,
                                         ep_world_size, _COMBINE_H, x_active_mask,
                                         tp_world_size, expert_shard_type,
                                         shared_expert_rank_num)
    ep = ep_world_size
    if expert_scales.shape != (bs, k) or expert_scales.dtype != torch.float32:
        raise RuntimeError(f"{op}: expert_scales must be float32 [BS={bs}, K={k}], got "
                           f"{expert_scales.dtype} {tuple(expert_scales.shape)}.")
    if ep_send_counts.dtype != torch.int32 or ep_send_counts.shape != (ep * local,):
        raise RuntimeError(f"{op}: ep_send_counts must be dispatch's ep_recv_counts, int32 "
                           f"[{ep * local}], got {ep_send_counts.dtype} "
                           f"{tuple(ep_send_counts.shape)}.")
    if assist_info_for_combine.dtype != torch.int32 or assist_info_for_combine.numel() < bs * k:
        raise RuntimeError(f"{op}: assist_info_for_combine must be dispatch's int32 output "
                           f"(at least BS * K = {bs * k} entries).")
    if shared_expert_x is not None and shared_expert_x.shape != (bs, expand_x.shape[1]):
        raise RuntimeError(f"{op}: shared_expert_x must be [BS={bs}, H={expand_x.shape[1]}], "
                           f"got {tuple(shared_expert_x.shape)}.")
    backend = _backend(op, group_ep, ep_world_size, ep_rank_id, _COMBINE_EP)
    running = ep_send_counts.long()
    counts = torch.diff(running, prepend=running.new_zeros(1))  # (local expert, source)
    if bool((counts < 0).any()) or int(running[-1]) > expand_x.shape[0]:
        raise RuntimeError(f"{op}: ep_send_counts {running.tolist()} is not a running sum of "
                           f"rows within expand_x's {expand_x.shape[0]}.")
    # (local expert, source) blocks -> back to each source, local-expert-major
    blocks = list(torch.split(expand_x[: int(running[-1])], counts.tolist()))
    to_source = [blocks[expert * ep + source] for source in range(ep) for expert in range(local)]
    counts = counts.reshape(local, ep)
    order, send_counts, _ = _pairs_to_ranks(expert_ids.cpu(), active, local, ep)
    returned = expand_x.new_empty((int(send_counts.sum()), expand_x.shape[1]))
    outgoing = torch.cat(to_source) if to_source else expand_x[:0]
    _alltoall(backend, returned, outgoing, send_counts.sum(1).tolist(), counts.sum(0).tolist())
    # each pair's row: its expert's block start (in destination, local order) + its place
    ids = expert_ids.long().reshape(-1)
    block_start = torch.cumsum(send_counts.reshape(-1), 0) - send_counts.reshape(-1)
    place = assist_info_for_combine[: bs * k].long()
    keep = active.repeat_interleave(k)
    rows = block_start[ids] + place
    if bool(keep.any()) and (bool((place[keep] < 0).any())
                             or int(rows[keep].max()) >= returned.shape[0]):
        raise RuntimeError(f"{op}: assist_info_for_combine does not match this batch's "
                           "expert_ids; pass dispatch's output unchanged.")
    gathered = torch.zeros((bs * k, expand_x.shape[1]), dtype=torch.float32)
    gathered[keep] = returned[rows[keep]].float()
    weighted = gathered.view(bs, k, -1) * expert_scales.float().unsqueeze(2)
    out = weighted.sum(1)
    if shared_expert_x is not None:
        out = out + shared_expert_x.float()
    out[~active] = 0
    return out.to(expand_x.dtype)
