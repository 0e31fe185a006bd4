"""Expert parallelism for the npu target's unquantized MoE, as a vLLM MoE kernel.

vLLM 0.32 runs an MoE layer through a ``FusedMoEKernel``: a prepare/finalize object (the
token dispatch before the experts and the combine after them) and an experts object. Its
MoE runner asks the kernel's prepare/finalize whether the output is already summed over the
ranks (``output_is_reduced``) and all-reduces it otherwise. With tensor parallel + expert
parallel and no data parallelism (``enable_expert_parallel=True``, ``data_parallel_size=1``)
vLLM has no dispatch at all: every rank holds the whole batch, runs its own experts on it
and the runner all-reduces.

Here the npu method builds such a kernel (monolithic, as the method is) whose

- prepare (:class:`AscendMoECommPrepareFinalize`) routes the batch (ascend-kernels'
  ``topk_softmax`` / ``grouped_topk``) and dispatches it through
  ``MoECommunication.dispatch_replicated`` of the EP group's ``NPUCommunicator``, which
  picks all-gather or all-to-all for this batch by its token count
  (``VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS``);
- experts (:class:`AscendDispatchedExperts`) run the dispatched rows, one local expert each,
  through ascend-kernels' ``moe_experts`` (npu_grouped_matmul, npu_swiglu);
- finalize combines them (``combine_replicated``), every rank ending with the whole batch's
  output, so ``output_is_reduced`` is true and the runner adds no all-reduce.

Every dispatch is counted per path and batch size (``batches``), and logged at debug level.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation

import ascend_kernels
from ascend_core.distributed.moe_comm import (
    MOE_COMM_METHODS,
    DispatchedTokens,
    ExpertPlacement,
    MoECommunication,
)

logger = init_logger(__name__)


def placement_from_vllm(num_experts: int, ep_size: int, ep_rank: int, strategy: str,
                        expert_map: torch.Tensor | None) -> ExpertPlacement:
    """Every rank's experts as vLLM places them (``determine_expert_map`` for each rank of
    the EP group), checked against this rank's ``expert_map``."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    if num_experts < ep_size:
        raise ValueError(f"expert parallelism over {ep_size} ranks needs at least one expert "
                         f"per rank, but the layer has {num_experts} experts; use an "
                         f"expert-parallel size of at most {num_experts}.")
    owner = torch.full((num_experts,), -1, dtype=torch.int64)
    local_index = torch.full((num_experts,), -1, dtype=torch.int64)
    for rank in range(ep_size):
        _, rank_map, _ = determine_expert_map(ep_size, rank, num_experts, strategy)
        mine = rank_map >= 0
        if (owner[mine] >= 0).any():
            raise ValueError(f"expert placement {strategy!r}: an expert of rank {rank} is "
                             f"also placed on another rank.")
        owner[mine] = rank
        local_index[mine] = rank_map[mine].long()
    if (owner < 0).any():
        missing = (owner < 0).nonzero().reshape(-1).tolist()
        raise ValueError(f"expert placement {strategy!r} over {ep_size} ranks leaves experts "
                         f"{missing} without a rank.")
    placement = ExpertPlacement(owner, local_index, ep_size)
    if expert_map is not None:
        expected = torch.where(owner == ep_rank, local_index, -1)
        if not torch.equal(expert_map.detach().cpu().long(), expected):
            raise ValueError(f"EP rank {ep_rank}: the layer's expert_map "
                             f"{expert_map.tolist()} is not vLLM's {strategy!r} placement "
                             f"{expected.tolist()} (EPLB or a changed placement?).")
    return placement


class AscendMoECommPrepareFinalize(mk.FusedMoEPrepareAndFinalizeMonolithic):
    """Route, then dispatch per batch (all-gather or all-to-all); combine after the experts.

    ``router`` maps router logits to ``(topk_weights, topk_ids)``. The dispatched batch is
    kept between ``prepare`` and ``finalize`` (one forward at a time per layer, as vLLM's
    kernels run) and read by the experts for the rows' local expert ids.
    """

    def __init__(self, comm: MoECommunication,
                 router: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                 layer_name: str = "") -> None:
        super().__init__()
        self.comm = comm
        self.router = router
        self.layer_name = layer_name
        self.pending: DispatchedTokens | None = None
        # {method: {num_tokens: batches}}: which path each batch size took.
        self.batches: dict[str, dict[int, int]] = {method: {} for method in MOE_COMM_METHODS}

    @property
    def activation_format(self) -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    def topk_indices_dtype(self) -> torch.dtype | None:
        return None

    def max_num_tokens_per_rank(self) -> int | None:
        return None

    def num_dispatchers(self) -> int:
        return self.comm.world_size

    def output_is_reduced(self) -> bool:
        return True

    def prepare(self, a1: torch.Tensor, router_logits: torch.Tensor, quant_config,
                defer_input_quant: bool = False):
        if self.pending is not None:
            raise RuntimeError(f"MoE layer {self.layer_name!r}: prepare called twice without "
                               f"finalize in between.")
        topk_weights, topk_ids = self.router(router_logits)
        dispatched = self.comm.dispatch_replicated(a1, topk_weights, topk_ids)
        num_tokens = a1.shape[0]
        seen = self.batches[dispatched.method]
        seen[num_tokens] = seen.get(num_tokens, 0) + 1
        logger.debug("MoE layer %s: %d tokens through %s (%d rows here)", self.layer_name,
                     num_tokens, dispatched.method, dispatched.hidden_states.shape[0])
        self.pending = dispatched
        return dispatched.hidden_states, None, router_logits

    def finalize(self, fused_expert_output: torch.Tensor) -> torch.Tensor:
        dispatched, self.pending = self.pending, None
        if dispatched is None:
            raise RuntimeError(f"MoE layer {self.layer_name!r}: finalize without prepare.")
        # The experts ran with unit weights: the routing weights are applied here, in float32.
        return self.comm.combine_replicated(fused_expert_output, dispatched)


class AscendDispatchedExperts(mk.FusedMoEExpertsMonolithic):
    """The dispatched rows through this rank's experts (``w13`` ``[E_local, H, 2I]``,
    ``w2`` ``[E_local, I, H]``), each row through its one local expert."""

    def __init__(self, moe_config, quant_config,
                 source: AscendMoECommPrepareFinalize) -> None:
        super().__init__(moe_config, quant_config)
        self.source = source

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        from vllm.platforms import current_platform

        return current_platform.device_type == "npu"

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_quant_scheme(weight_key, activation_key) -> bool:
        return weight_key is None and activation_key is None

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_parallel_config(moe_parallel_config) -> bool:
        return (moe_parallel_config.use_ep and moe_parallel_config.dp_size == 1
                and moe_parallel_config.pcp_size == 1
                and not moe_parallel_config.is_sequence_parallel)

    @staticmethod
    def _supports_routing_method(routing_method, weight_key, activation_key) -> bool:
        return True

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype, routing_method) -> bool:
        return True

    def apply(self, hidden_states: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
              router_logits: torch.Tensor, activation, global_num_experts: int,
              expert_map, a1q_scale, apply_router_weight_on_input: bool, **_routing):
        dispatched = self.source.pending
        if dispatched is None or dispatched.hidden_states is not hidden_states:
            raise RuntimeError("AscendDispatchedExperts runs only on rows its "
                               "prepare/finalize dispatched.")
        rows = hidden_states.shape[0]
        unit = torch.ones((rows, 1), dtype=torch.float32, device=hidden_states.device)
        return ascend_kernels.moe_experts(hidden_states, w1, w2, unit,
                                          dispatched.local_expert_ids.unsqueeze(1))


def uses_moe_comm(moe_config) -> bool:
    """Whether the npu method serves this layer (its ``FusedMoEConfig``) through the
    per-batch MoE communication: expert parallelism over more than one rank, every rank
    holding the whole batch, and vLLM's runner left to skip its all-reduce (a model that
    reduces the MoE output itself, ``skip_final_all_reduce``, keeps vLLM's way)."""
    parallel = moe_config.moe_parallel_config
    return (parallel.use_ep and parallel.ep_size > 1
            and AscendDispatchedExperts._supports_parallel_config(parallel)
            and not moe_config.skip_final_all_reduce)


def make_moe_comm_kernel(layer, moe_config, quant_config,
                         router: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                         ) -> mk.FusedMoEKernel:
    """The kernel for ``layer`` (a vLLM ``RoutedExperts``) over the EP group."""
    from vllm.distributed import get_ep_group

    parallel = moe_config.moe_parallel_config
    group = get_ep_group()
    if group.world_size != parallel.ep_size:
        raise ValueError(f"MoE layer {layer.layer_name!r}: the EP group has "
                         f"{group.world_size} ranks but the layer's ep_size is "
                         f"{parallel.ep_size}.")
    communicator = group.device_communicator
    if not hasattr(communicator, "moe_communication"):
        raise TypeError(f"MoE layer {layer.layer_name!r}: the EP group's device communicator "
                        f"is {type(communicator).__name__}, not the npu target's "
                        f"NPUCommunicator.")
    placement = placement_from_vllm(layer.global_num_experts, parallel.ep_size,
                                    parallel.ep_rank, layer.expert_placement_strategy,
                                    layer.expert_map)
    comm = communicator.moe_communication(placement)
    prepare_finalize = AscendMoECommPrepareFinalize(comm, router, layer.layer_name)
    experts = AscendDispatchedExperts(moe_config, quant_config, prepare_finalize)
    return mk.FusedMoEKernel(prepare_finalize, experts)


__all__ = ["AscendDispatchedExperts", "AscendMoECommPrepareFinalize", "make_moe_comm_kernel",
           "placement_from_vllm", "uses_moe_comm"]
