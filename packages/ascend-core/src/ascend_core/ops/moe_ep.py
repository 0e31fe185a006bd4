"""Expert parallelism for the npu target's unquantized MoE, as a vLLM MoE kernel.

vLLM 0.32 runs an MoE layer through a ``FusedMoEKernel``: a prepare/finalize object (the
token dispatch before the experts and the combine after them) and an experts object. Its
MoE runner asks the kernel's prepare/finalize whether the output is already summed over the
ranks (``output_is_reduced``) and all-reduces it otherwise. Without such a kernel, vLLM's
tensor parallel + expert parallel (``enable_expert_parallel=True``) has no dispatch at all
(every rank runs its own experts on the whole batch and the runner all-reduces), and with
data parallelism its runner gathers every DP rank's tokens to every rank first (its
"naive" dispatch over the EP group's all-gather / reduce-scatter manager).

Here the npu method builds such a kernel (monolithic, as the method is), which vLLM then
hands each DP rank's own tokens (``supports_internal_mk``), whose

- prepare (:class:`AscendMoECommPrepareFinalize`) routes the batch (ascend-kernels'
  ``topk_softmax`` / ``grouped_topk``) and dispatches it through
  ``MoECommunication.dispatch_shared`` of the EP group's ``NPUCommunicator``: the
  tensor-parallel ranks of a DP rank (its token group) each take a share of its tokens, and
  the shares travel by MC2 (torch_npu's ``npu_moe_distribute_dispatch_v2``, where its limits
  admit the batch), all-to-all or all-gather, chosen per batch from the DP ranks' token
  counts in vLLM's data-parallel metadata (the largest against
  ``VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS``);
- experts (:class:`AscendDispatchedExperts`) run the dispatched rows, one local expert each,
  through ascend-kernels' ``moe_experts`` (npu_grouped_matmul, npu_swiglu);
- finalize combines them (``combine_shared``), every rank ending with its DP rank's whole
  batch, so ``output_is_reduced`` is true and the runner adds no all-reduce.

Under FULL decode graphs only MC2 can be captured (the other paths size tensors on the
host): a layer MC2 cannot serve keeps vLLM's way there.

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
    MC2_MAX_TOKENS_PER_RANK,
    MOE_COMM_METHODS,
    DispatchedTokens,
    ExpertPlacement,
    MoECommunication,
    TokenGroup,
)

logger = init_logger(__name__)


def placement_from_vllm(num_experts: int, ep_size: int, ep_rank: int, strategy: str,
                        expert_map: torch.Tensor | None) -> ExpertPlacement:
    """Every rank's experts as vLLM places them (``determine_expert_map`` for each rank of
    the EP group), checked against this rank's ``expert_map``."""
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    if num_experts < ep_size:
        raise ValueError(f"expert parallelism over {ep_size} ranks (data parallel x tensor "
                         f"parallel) needs at least one expert per rank, but the layer has "
                         f"{num_experts} experts; use an expert-parallel size of at most "
                         f"{num_experts}.")
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
                 layer_name: str = "", token_group: TokenGroup | None = None,
                 dp_rank: int = 0, sequence_chunks: int = 1) -> None:
        super().__init__()
        self.comm = comm
        self.router = router
        self.layer_name = layer_name
        # The TP ranks of this DP rank (None: every EP rank holds the whole batch).
        self.token_group = token_group
        self.dp_rank = dp_rank
        # vLLM's sequence-parallel MoE: each DP rank's tokens come as this many equal
        # (zero-padded) chunks, one per TP rank; 1 otherwise.
        self.sequence_chunks = sequence_chunks
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
        num_tokens = a1.shape[0]
        if self.token_group is None:
            dispatched = self.comm.dispatch_replicated(a1, topk_weights, topk_ids)
        else:
            dispatched = self.comm.dispatch_shared(
                a1, topk_weights, topk_ids, token_group=self.token_group,
                tokens_per_group=self._tokens_per_dp_rank(num_tokens))
        seen = self.batches[dispatched.method]
        seen[num_tokens] = seen.get(num_tokens, 0) + 1
        logger.debug("MoE layer %s: %d tokens through %s (%d rows here)", self.layer_name,
                     num_tokens, dispatched.method, dispatched.hidden_states.shape[0])
        self.pending = dispatched
        return dispatched.hidden_states, None, router_logits

    def _tokens_per_dp_rank(self, num_tokens: int) -> list[int]:
        """Every DP rank's token count in this forward (vLLM's data-parallel metadata)."""
        from vllm.forward_context import get_forward_context, is_forward_context_available

        metadata = (get_forward_context().dp_metadata if is_forward_context_available()
                    else None)
        if metadata is None:
            raise RuntimeError(f"MoE layer {self.layer_name!r}: data parallel without vLLM's "
                               f"data-parallel metadata in the forward context (each DP "
                               f"rank's token count); run the model inside the model "
                               f"runner's forward context.")
        counts = [int(n) for n in metadata.num_tokens_across_dp_cpu.tolist()]
        chunks = self.sequence_chunks
        if chunks > 1:  # every TP rank's chunk: ceil(tokens / TP), in EP rank order
            counts = [-(-n // chunks) for n in counts for _ in range(chunks)]
        if counts[self.dp_rank * chunks] != num_tokens:
            raise RuntimeError(f"MoE layer {self.layer_name!r}: DP rank {self.dp_rank} has "
                               f"{num_tokens} tokens here but the data-parallel metadata "
                               f"says {counts}.")
        return counts

    def finalize(self, fused_expert_output: torch.Tensor) -> torch.Tensor:
        dispatched, self.pending = self.pending, None
        if dispatched is None:
            raise RuntimeError(f"MoE layer {self.layer_name!r}: finalize without prepare.")
        # The experts ran with unit weights: the routing weights are applied here, in float32.
        return self.comm.combine_shared(fused_expert_output, dispatched)


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
        # Sequence-parallel MoE only as vLLM makes it: data parallel over TP ranks.
        return (moe_parallel_config.use_ep and moe_parallel_config.pcp_size == 1
                and (not moe_parallel_config.is_sequence_parallel
                     or moe_parallel_config.dp_size > 1))

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
    per-batch MoE communication: expert parallelism over more than one rank, and vLLM's
    runner left to skip its all-reduce (a model that reduces the MoE output itself,
    ``skip_final_all_reduce``, keeps vLLM's way)."""
    parallel = moe_config.moe_parallel_config
    return (parallel.use_ep and parallel.ep_size > 1
            and AscendDispatchedExperts._supports_parallel_config(parallel)
            and not moe_config.skip_final_all_reduce)


def make_moe_comm_kernel(layer, moe_config, quant_config,
                         router: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                         full_graphs: bool = False) -> mk.FusedMoEKernel | None:
    """The kernel for ``layer`` (a vLLM ``RoutedExperts``) over the EP group; None where
    ``full_graphs`` (FULL decode graphs configured) and MC2 cannot serve the layer."""
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
    if full_graphs:
        why = comm.mc2_why_not(moe_config.hidden_dim, moe_config.in_dtype, layer.top_k)
        if why is not None:
            logger.info("MoE layer %s: FULL decode graphs capture the expert-parallel token "
                        "exchange only through MC2, which cannot serve it (%s); vLLM's MoE "
                        "path serves this layer.", layer.layer_name, why)
            return None
    token_group, tp_size = None, parallel.ep_size
    if parallel.dp_size > 1:
        token_group = _tp_token_group(layer.layer_name, parallel)
        tp_size = token_group.size
        if parallel.is_sequence_parallel:
            # vLLM's sequence-parallel MoE (DP > 1 and TP > 1): the model hands each TP rank
            # its own chunk of the DP rank's tokens, so every rank's tokens are its own.
            token_group = TokenGroup(None, 0, 1)
    logger.info_once("npu MoE: expert-parallel token exchange chosen per batch over %d EP "
                     "ranks (DP %d x TP %d%s); MC2: %s", parallel.ep_size, parallel.dp_size,
                     tp_size, ", sequence-parallel chunks" if parallel.is_sequence_parallel
                     else "", comm.mc2_why_not(moe_config.hidden_dim, moe_config.in_dtype,
                                               layer.top_k)
                     or f"serves batches of up to {MC2_MAX_TOKENS_PER_RANK} tokens per rank")
    prepare_finalize = AscendMoECommPrepareFinalize(
        comm, router, layer.layer_name, token_group, parallel.dp_rank,
        tp_size if parallel.is_sequence_parallel else 1)
    experts = AscendDispatchedExperts(moe_config, quant_config, prepare_finalize)
    return mk.FusedMoEKernel(prepare_finalize, experts)


def _tp_token_group(layer_name: str, parallel) -> TokenGroup:
    """This DP rank's tensor-parallel ranks, which hold its batch alike: consecutive ranks of
    the EP group (vLLM orders it DP rank by DP rank, TP ranks within)."""
    from vllm.distributed import get_tp_group

    tp = get_tp_group()
    expected = parallel.dp_rank * tp.world_size + tp.rank_in_group
    if parallel.ep_size != parallel.dp_size * tp.world_size or parallel.ep_rank != expected:
        raise ValueError(f"MoE layer {layer_name!r}: EP rank {parallel.ep_rank} of "
                         f"{parallel.ep_size} is not DP rank {parallel.dp_rank} x TP rank "
                         f"{tp.rank_in_group} of {parallel.dp_size} x {tp.world_size} "
                         f"(expected EP rank {expected}).")
    return TokenGroup(tp.device_group if tp.world_size > 1 else None, tp.rank_in_group,
                      tp.world_size)


__all__ = ["AscendDispatchedExperts", "AscendMoECommPrepareFinalize",
           "make_moe_comm_kernel", "placement_from_vllm", "uses_moe_comm"]
