"""The npu target's device communicator (``AscendPlatform.get_device_communicator_cls``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from vllm.distributed.device_communicators.base_device_communicator import (
    DeviceCommunicatorBase,
)
from vllm.distributed.parallel_state import GraphCaptureContext
from vllm.logger import init_logger

from ascend_core.distributed.moe_comm import (
    ExpertPlacement,
    MoECommunication,
    all_gatherv,
    reduce_scatterv,
)

logger = init_logger(__name__)


class NPUCommunicator(DeviceCommunicatorBase):
    """Collectives between NPUs over HCCL.

    All collectives run through ``torch.distributed`` on the group's ``device_group``, whose
    backend on the npu target is HCCL (``AscendPlatform.dist_backend``, registered by
    torch_npu). vLLM's base class covers all-reduce, all-gather, reduce-scatter, gather,
    send/recv and broadcast; this class adds what it leaves out:

    - ``all_gatherv`` / ``reduce_scatterv``: uneven row counts per rank, which vLLM's
      all-gather/reduce-scatter MoE manager (data-parallel MoE) calls;
    - ``all_to_all``: ``all_to_all_single`` with split sizes (exchanged first when the
      caller knows only what it sends);
    - the MoE token paths: ``moe_communication(placement)`` gives a dispatch/combine pair
      that picks MC2, all-to-all or all-gather per batch (``ascend_core.distributed.moe_comm``;
      MC2 over a second HCCL communicator of the same ranks, made once, as torch_npu's page
      says no other op may use MC2's);
      in an ``ep`` group that vLLM builds with ``use_all2all`` (data parallel > 1), vLLM's
      own ``dispatch`` / ``combine`` go through ``AgRsAll2AllManager`` over these
      collectives, as on vLLM's CPU backend.
    """

    def __init__(
        self,
        cpu_group: ProcessGroup,
        device: torch.device | None = None,
        device_group: ProcessGroup | None = None,
        unique_name: str = "",
        global_ranks: list[int] | None = None,
        global_world_size: int | None = None,
        use_all2all: bool = False,
    ) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, global_ranks,
                         global_world_size, use_all2all)
        self._moe_comms: dict[int, MoECommunication] = {}
        self._mc2_group: ProcessGroup | None = None
        self._mc2_comm_name: str | None = None
        if self.use_all2all:
            if self.all2all_backend not in (None, "naive", "allgather_reducescatter"):
                logger.warning("all2all backend %r has no NPU implementation; using "
                               "allgather_reducescatter over HCCL.", self.all2all_backend)
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)

    # --- dense collectives ------------------------------------------------------------------

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        return super().all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        self._check_dim("all_gather", input_, dim)
        return super().all_gather(input_, dim)

    def reduce_scatter(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        self._check_dim("reduce_scatter", input_, dim)
        if input_.shape[dim] % self.world_size:
            raise ValueError(f"reduce_scatter: dim {dim} of shape {tuple(input_.shape)} is not "
                             f"divisible by the group size {self.world_size}; use "
                             f"reduce_scatterv with per-rank sizes.")
        return super().reduce_scatter(input_, dim)

    def all_gatherv(
        self,
        input_: torch.Tensor | list[torch.Tensor],
        dim: int = 0,
        sizes: list[int] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        if dim != 0:
            raise ValueError(f"all_gatherv gathers along dim 0 only, got dim={dim}.")
        tensors = [input_] if isinstance(input_, torch.Tensor) else list(input_)
        if sizes is None:
            sizes = [tensors[0].shape[0]] * self.world_size
        outputs = [all_gatherv(tensor, list(sizes), self._group()) for tensor in tensors]
        return outputs[0] if isinstance(input_, torch.Tensor) else outputs

    def reduce_scatterv(
        self, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None
    ) -> torch.Tensor:
        self._check_dim("reduce_scatterv", input_, dim)
        dim = dim % input_.dim()
        rows = input_.movedim(dim, 0)
        if sizes is None:
            if rows.shape[0] % self.world_size:
                raise ValueError(f"reduce_scatterv: dim {dim} of shape {tuple(input_.shape)} "
                                 f"is not divisible by the group size {self.world_size}; "
                                 f"pass sizes.")
            sizes = [rows.shape[0] // self.world_size] * self.world_size
        return reduce_scatterv(rows, list(sizes), self._group()).movedim(0, dim).contiguous()

    def all_to_all(
        self,
        input_: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """Rows ``input_split_sizes[r]`` of ``input_`` go to rank ``r``; the result holds
        what every rank sent here, rank after rank. Without split sizes every rank sends
        ``len / world_size`` rows to each; with only ``input_split_sizes`` the counts are
        exchanged first (one ``all_to_all_single`` of ``world_size`` integers)."""
        if input_.dim() == 0:
            raise ValueError("all_to_all needs a tensor with at least one dimension.")
        if self.world_size == 1:
            return input_
        for name, splits in (("input_split_sizes", input_split_sizes),
                             ("output_split_sizes", output_split_sizes)):
            if splits is not None and (len(splits) != self.world_size
                                       or any(n < 0 for n in splits)):
                raise ValueError(f"all_to_all: {name}={list(splits)} must give one "
                                 f"non-negative row count per rank ({self.world_size}).")
        if input_split_sizes is None:
            if output_split_sizes is not None or input_.shape[0] % self.world_size:
                raise ValueError(f"all_to_all: {input_.shape[0]} rows cannot be split evenly "
                                 f"over {self.world_size} ranks without input_split_sizes.")
            input_split_sizes = [input_.shape[0] // self.world_size] * self.world_size
            output_split_sizes = input_split_sizes
        if sum(input_split_sizes) != input_.shape[0]:
            raise ValueError(f"all_to_all: input_split_sizes {list(input_split_sizes)} add up "
                             f"to {sum(input_split_sizes)}, but the input has "
                             f"{input_.shape[0]} rows.")
        if output_split_sizes is None:
            sent = torch.tensor(input_split_sizes, dtype=torch.int64, device=input_.device)
            received = torch.empty_like(sent)
            dist.all_to_all_single(received, sent, group=self._group())
            output_split_sizes = [int(n) for n in received.tolist()]
        output = input_.new_empty((sum(output_split_sizes),) + tuple(input_.shape[1:]))
        dist.all_to_all_single(output, input_.contiguous(), output_split_sizes=output_split_sizes,
                               input_split_sizes=list(input_split_sizes), group=self._group())
        return output

    # --- MoE token paths ----------------------------------------------------------------------

    def moe_communication(self, placement: ExpertPlacement, *,
                          all2all_min_tokens: int | None = None) -> MoECommunication:
        """Dispatch/combine over this group for the experts placed as ``placement``,
        choosing MC2, all-to-all or all-gather per batch (one object per placement). Every
        rank of the group must make its first call together (it may make MC2's group)."""
        key = id(placement)
        comm = self._moe_comms.get(key)
        if comm is None or comm.all_gather.placement is not placement:
            comm = MoECommunication(self._group(), placement,
                                    all2all_min_tokens=all2all_min_tokens,
                                    mc2_comm_name=self.mc2_comm_name())
            self._moe_comms[key] = comm
        return comm

    def mc2_comm_name(self) -> str | None:
        """The HCCL communicator name torch_npu's MC2 ops take for this group's ranks: a
        group of their own, made on the first call (by every rank together); None off an
        NPU, for one rank, or where torch_npu has no MC2 ops."""
        if self.device.type != "npu" or self.world_size < 2:
            return None
        import torch_npu

        if not hasattr(torch_npu, "npu_moe_distribute_dispatch_v2"):
            return None
        if self._mc2_comm_name is None:
            ranks = dist.get_process_group_ranks(self.device_group)
            group = dist.new_group(ranks, backend="hccl", use_local_synchronization=True)
            backend = group._get_backend(torch.device("npu"))
            self._mc2_group = group
            self._mc2_comm_name = backend.get_hccl_comm_name(dist.get_rank(group))
        return self._mc2_comm_name

    def dispatch_router_logits(self, hidden_states, router_logits, is_sequence_parallel=False,
                               extra_tensors=None):
        if self.all2all_manager is None:
            return super().dispatch_router_logits(hidden_states, router_logits,
                                                  is_sequence_parallel, extra_tensors)
        return self.all2all_manager.dispatch_router_logits(hidden_states, router_logits,
                                                           is_sequence_parallel, extra_tensors)

    def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False,
                 extra_tensors=None):
        if self.all2all_manager is None:
            return super().dispatch(hidden_states, topk_weights, topk_ids,
                                    is_sequence_parallel, extra_tensors)
        return self.all2all_manager.dispatch(hidden_states, topk_weights, topk_ids,
                                             is_sequence_parallel, extra_tensors=extra_tensors)

    def combine(self, hidden_states: torch.Tensor,
                is_sequence_parallel: bool = False) -> torch.Tensor:
        if self.all2all_manager is None:
            return super().combine(hidden_states, is_sequence_parallel)
        return self.all2all_manager.combine(hidden_states, is_sequence_parallel)

    def combine_into_output(self, hidden_states: torch.Tensor, output: torch.Tensor,
                            is_sequence_parallel: bool = False) -> torch.Tensor:
        if self.all2all_manager is None:
            return super().combine_into_output(hidden_states, output, is_sequence_parallel)
        return self.all2all_manager.combine_into_output(hidden_states, output,
                                                        is_sequence_parallel)

    def destroy(self) -> None:
        if self.all2all_manager is not None:
            self.all2all_manager.destroy()
            self.all2all_manager = None
        self._moe_comms.clear()
        if self._mc2_group is not None:
            dist.destroy_process_group(self._mc2_group)
            self._mc2_group = self._mc2_comm_name = None

    # --- helpers --------------------------------------------------------------------------------

    def _group(self) -> ProcessGroup | None:
        return self.device_group if self.world_size > 1 else None

    @staticmethod
    def _check_dim(name: str, input_: torch.Tensor, dim: int) -> None:
        if not -input_.dim() <= dim < input_.dim():
            raise ValueError(f"{name}: dim={dim} is out of range for a tensor of shape "
                             f"{tuple(input_.shape)}.")


# --- graph capture ---------------------------------------------------------------------------


def _check_npu_group(group) -> None:
    communicator = group.device_communicator
    if communicator is not None and not isinstance(communicator, NPUCommunicator):
        raise TypeError(
            f"Group {group.unique_name!r} has a {type(communicator).__name__}; NPU graph "
            "capture takes groups whose device communicator is NPUCommunicator "
            "(AscendPlatform.get_device_communicator_cls)."
        )


@contextlib.contextmanager
def npu_graph_capture(device: torch.device) -> Iterator[GraphCaptureContext]:
    """vLLM's ``graph_capture(device)`` for the npu target, around a model runner's capture.

    vLLM's own takes CUDA/XPU communicators only (their custom all-reduce buffers need a
    capture mode). HCCL collectives are captured into an NPU graph as they are issued, so
    the tensor, pipeline and data parallel groups' ``NPUCommunicator`` need nothing more:
    this checks that each group has one, then captures on a side stream that first waits
    for the work already issued, as vLLM does.
    """
    from vllm.distributed.parallel_state import get_dp_group, get_pp_group, get_tp_group

    for group in (get_tp_group(), get_pp_group(), get_dp_group()):
        _check_npu_group(group)
    stream = torch.npu.Stream(device=device)
    current = torch.npu.current_stream()
    if current != stream:
        stream.wait_stream(current)
    with torch.npu.stream(stream):
        yield GraphCaptureContext(stream)
