"""Unquantized MoE on the npu target: vLLM's ``UnquantizedFusedMoEMethod`` with an npu path.

vLLM 0.32 leaves an out-of-tree platform's unquantized experts to the platform: its
backend oracle answers ``UnquantizedMoeBackend.OOT`` with no experts kernel, so the stock
method has neither a modular kernel nor a monolithic one (``is_monolithic`` fails). The
method is a ``CustomOp``; registering this subclass under its class name
(``CustomOp.register_oot``) makes vLLM build it instead.

On the npu platform the method is monolithic: ``apply_monolithic`` gets the router logits,
routes with ascend-kernels' ``topk_softmax`` / ``grouped_topk`` (``npu_moe_gating_top_k_softmax``
/ ``npu_moe_gating_top_k`` on npu tensors) and runs the experts with ascend-kernels'
``moe_experts`` (tokens sorted by expert, ``npu_grouped_matmul``, ``npu_swiglu``,
``npu_grouped_matmul``, weighted scatter back). The expert weights are transposed once after
loading into the ``[E, K, N]`` layout the grouped matmul reads. Under expert parallelism
(with or without data parallelism) the method runs a vLLM MoE kernel instead whose
dispatch/combine picks MC2, all-to-all or all-gather per batch (``ascend_core.ops.moe_ep``).

An expert-load balancer (ascend-eplb's MoE layer) may hand the method physical expert slots
(:class:`ExpertSlots` through ``serve_expert_slots``): the routed logical ids then go through
its ``to_slots`` before the experts run, and the layer's weights hold one row per local slot.
On any other platform (the host target is a CPU platform for vLLM) every call goes to vLLM's
own method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

import ascend_kernels
from ascend_core.distributed.moe_comm import ExpertPlacement

SERVED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class ExpertSlots:
    """Physical expert slots serving a MoE layer in place of its logical experts (EPLB).

    The slots are spread evenly over the expert-parallel ranks: rank ``r`` holds slots
    ``r * k .. r * k + k - 1`` as its weight rows ``0 .. k - 1`` (``k = slots_per_rank``). An
    expert may have several slots (redundant experts); ``to_slots`` picks one per (token,
    choice): ``[tokens, top_k]`` logical ids -> ``[tokens, top_k]`` slot ids in
    ``[0, num_slots)``. It is called once per layer forward with the routed ids of the whole
    batch, so it may also count them (load recording).
    """

    num_slots: int
    num_ranks: int
    to_slots: Callable[[torch.Tensor], torch.Tensor]

    def __post_init__(self) -> None:
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ValueError(f"ExpertSlots: num_ranks must be an integer >= 1, got "
                             f"{self.num_ranks!r}.")
        if (not isinstance(self.num_slots, int) or self.num_slots < self.num_ranks
                or self.num_slots % self.num_ranks):
            raise ValueError(f"ExpertSlots: num_slots must be a positive multiple of num_ranks="
                             f"{self.num_ranks} (the same slots on every rank), got "
                             f"{self.num_slots!r}.")
        if not callable(self.to_slots):
            raise TypeError(f"ExpertSlots: to_slots must be callable, got "
                            f"{type(self.to_slots).__name__}.")

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def placement(self) -> ExpertPlacement:
        """The slots as the MoE communication's experts: slot ``s`` on rank ``s // k``."""
        slots = torch.arange(self.num_slots, dtype=torch.int64)
        return ExpertPlacement(slots // self.slots_per_rank, slots % self.slots_per_rank,
                               self.num_ranks)

    def route(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """``to_slots(topk_ids)``, checked: same shape, integer ids."""
        slot_ids = self.to_slots(topk_ids)
        if (not isinstance(slot_ids, torch.Tensor) or slot_ids.shape != topk_ids.shape
                or slot_ids.is_floating_point()):
            got = (f"{tuple(slot_ids.shape)} {slot_ids.dtype}"
                   if isinstance(slot_ids, torch.Tensor) else type(slot_ids).__name__)
            raise ValueError(f"ExpertSlots.to_slots must return integer slot ids shaped like "
                             f"the routed ids {tuple(topk_ids.shape)}, got {got}.")
        return slot_ids


def route(router_logits: torch.Tensor, *, top_k: int, renormalize: bool,
          use_grouped_topk: bool = False, num_expert_group: int | None = None,
          topk_group: int | None = None, scoring_func: str = "softmax",
          e_score_correction_bias: torch.Tensor | None = None,
          routed_scaling_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, ids [T, k] int32)`` as vLLM's routers choose them."""
    if use_grouped_topk:
        return ascend_kernels.grouped_topk(
            router_logits, top_k, renormalize, num_expert_group, topk_group,
            scoring_func=scoring_func, e_score_correction_bias=e_score_correction_bias,
            routed_scaling_factor=routed_scaling_factor)
    if scoring_func != "softmax" or e_score_correction_bias is not None:
        raise NotImplementedError(
            f"npu MoE routing takes softmax scores without a correction bias outside grouped "
            f"top-k; this layer has scoring_func={scoring_func!r} and "
            f"{'a' if e_score_correction_bias is not None else 'no'} correction bias. Serve it "
            "with VLLM_ASCEND_TARGET=host.")
    # As vLLM's FusedTopKRouter: routed_scaling_factor is not applied on this path.
    return ascend_kernels.topk_softmax(router_logits, top_k, renormalize)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, *, top_k: int, renormalize: bool,
              expert_map: torch.Tensor | None = None, slots: ExpertSlots | None = None,
              **routing) -> torch.Tensor:
    """Route, then run the experts. ``w13`` ``[E, H, 2I]``, ``w2`` ``[E, I, H]``;
    ``expert_map`` (expert parallelism) maps global expert ids to local ones (-1 elsewhere);
    ``slots`` (one rank) maps logical ids to the rows of ``w13`` / ``w2`` (EPLB's slots).
    """
    weights, ids = route(router_logits, top_k=top_k, renormalize=renormalize, **routing)
    if slots is not None:
        if expert_map is not None or slots.num_ranks != 1:
            raise ValueError("fused_moe serves expert slots on one rank only, without an "
                             f"expert_map (num_ranks={slots.num_ranks}); expert-parallel "
                             "slots go through the MoE communication kernel.")
        if w13.shape[0] != slots.num_slots:
            raise ValueError(f"fused_moe: {slots.num_slots} expert slots but w13 has "
                             f"{w13.shape[0]} rows; the weights must hold one row per slot.")
        ids = slots.route(ids)
    if expert_map is not None:
        ids = expert_map[ids.long()]
    return ascend_kernels.moe_experts(x, w13, w2, weights, ids)


def _activation_name(activation) -> str:
    return str(getattr(activation, "value", activation)).lower()


class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method, monolithic on the npu platform."""

    # Physical expert slots an expert-load balancer put in service (serve_expert_slots).
    expert_slots: ExpertSlots | None = None

    def __init__(self, moe, *args, **kwargs) -> None:
        super().__init__(moe, *args, **kwargs)
        from ascend_core.attention.npu_attention import _full_graphs_configured

        # Read while the model is built (vLLM's config is current then, not at loading).
        self.full_graphs = _full_graphs_configured()

    @property
    def _ours(self) -> bool:
        return self.unquantized_backend == UnquantizedMoeBackend.OOT

    @property
    def runs_npu_path(self) -> bool:
        """Whether this layer runs the npu path (routing and experts here), not vLLM's."""
        return self._ours

    @property
    def is_monolithic(self) -> bool:
        return True if self._ours else super().is_monolithic

    @property
    def supports_eplb(self) -> bool:
        # vLLM's own EPLB (--enable-eplb, its EplbState) needs vLLM's router; ascend-eplb
        # (additional_config eplb_config) serves this method through serve_expert_slots.
        return False if self._ours else super().supports_eplb

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        if not self._ours:
            return
        problems = []
        activation = _activation_name(layer.activation)
        if activation not in SERVED_ACTIVATIONS:
            problems.append(f"activation {activation!r} (served: {SERVED_ACTIVATIONS})")
        if self.moe.has_bias:
            problems.append("expert biases")
        if layer.apply_router_weight_on_input:
            problems.append("apply_router_weight_on_input")
        if layer.custom_routing_function is not None:
            problems.append("a custom routing function")
        if getattr(layer, "routing_sink", None) is not None:
            problems.append("a routing sink")
        if self.moe.moe_parallel_config.enable_eplb:
            problems.append("EPLB (--enable-eplb)")
        if problems:
            raise NotImplementedError(
                f"MoE layer {getattr(layer, 'layer_name', '?')!r}: the npu target's "
                f"unquantized experts do not serve {', '.join(problems)}. Serve this model "
                "with VLLM_ASCEND_TARGET=host.")
        # [E, 2I, H] / [E, H, I] -> [E, H, 2I] / [E, I, H], the grouped matmul's [E, K, N].
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data = param.data.transpose(1, 2).contiguous()
        layer.ascend_weights_kn = True
        from ascend_core.ops.moe_ep import make_moe_comm_kernel, uses_moe_comm

        if uses_moe_comm(self.moe):
            self.moe_kernel = make_moe_comm_kernel(
                layer, self.moe, self.get_fused_moe_quant_config(layer),
                lambda router_logits: self._select_experts(layer, router_logits),
                full_graphs=self.full_graphs)

    def _select_experts(self, layer, router_logits: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed ``(weights, ids)``; the ids are slots once ``expert_slots`` is set."""
        weights, ids = route(
            router_logits, top_k=layer.top_k, renormalize=layer.renormalize,
            use_grouped_topk=layer.use_grouped_topk, num_expert_group=layer.num_expert_group,
            topk_group=layer.topk_group, scoring_func=layer.scoring_func,
            e_score_correction_bias=layer.e_score_correction_bias,
            routed_scaling_factor=layer.routed_scaling_factor)
        if self.expert_slots is not None:
            ids = self.expert_slots.route(ids)
        return weights, ids

    def serve_expert_slots(self, layer, slots: ExpertSlots) -> None:
        """Serve ``layer`` from physical expert slots from now on (EPLB's hook).

        The caller has already replaced ``layer.w13_weight`` / ``w2_weight`` by tensors of
        ``slots.slots_per_rank`` rows in this method's ``[E, K, N]`` layout, and keeps their
        rows in step with ``slots.to_slots``. Under expert parallelism the slots spread over
        the EP group and the tokens travel to the rank of their slot.
        """
        name = getattr(layer, "layer_name", "?")
        if not self._ours or not getattr(layer, "ascend_weights_kn", False):
            raise NotImplementedError(
                f"MoE layer {name!r}: expert slots are served by the npu platform's "
                f"unquantized experts after weight loading; this method runs "
                f"{self.unquantized_backend} (weights processed: "
                f"{getattr(layer, 'ascend_weights_kn', False)}).")
        if not isinstance(slots, ExpertSlots):
            raise TypeError(f"MoE layer {name!r}: serve_expert_slots takes ExpertSlots, got "
                            f"{type(slots).__name__}.")
        parallel = self.moe.moe_parallel_config
        ep_size = parallel.ep_size if parallel.use_ep else 1
        if ep_size > 1 and self.moe_kernel is None:
            raise NotImplementedError(
                f"MoE layer {name!r}: expert slots over {ep_size} expert-parallel ranks need "
                f"the per-batch MoE communication, which this layer does not run "
                f"(dp_size={parallel.dp_size}, pcp_size={parallel.pcp_size}, FULL decode "
                f"graphs: {self.full_graphs}, MC2 serving it only under graphs).")
        if slots.num_ranks != ep_size:
            raise ValueError(f"MoE layer {name!r}: the slots are spread over "
                             f"{slots.num_ranks} ranks but the layer has {ep_size} "
                             f"expert-parallel rank(s).")
        for weight in ("w13_weight", "w2_weight"):
            rows = getattr(layer, weight).shape[0]
            if rows != slots.slots_per_rank:
                raise ValueError(f"MoE layer {name!r}: {weight} has {rows} expert rows but "
                                 f"{slots.slots_per_rank} slots are local to this rank; "
                                 f"replace the weights by the slot weights first.")
        if self.moe_kernel is not None:
            from vllm.distributed import get_ep_group

            communicator = get_ep_group().device_communicator
            self.moe_kernel.prepare_finalize.comm = communicator.moe_communication(
                slots.placement())
        self.expert_slots = slots

    @property
    def moe_comm_batches(self) -> dict[str, dict[int, int]] | None:
        """Under expert parallelism on npu: {method: {num_tokens: batches}} of this layer."""
        kernel = self.moe_kernel
        if kernel is None or not self._ours:
            return None
        return getattr(kernel.prepare_finalize, "batches", None)

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not self._ours:
            return super().apply_monolithic(layer, x, router_logits, input_ids)
        if self.moe_kernel is not None:
            # Expert parallel: per-batch dispatch/combine (ascend_core.ops.moe_ep).
            return self.moe_kernel.apply_monolithic(
                hidden_states=x, w1=layer.w13_weight, w2=layer.w2_weight,
                router_logits=router_logits, activation=layer.activation,
                global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
                apply_router_weight_on_input=False, routing_sink=None)
        slots = self.expert_slots
        return fused_moe(
            x, router_logits, layer.w13_weight, layer.w2_weight, top_k=layer.top_k,
            renormalize=layer.renormalize, slots=slots,
            expert_map=layer.expert_map if slots is None else None,
            use_grouped_topk=layer.use_grouped_topk, num_expert_group=layer.num_expert_group,
            topk_group=layer.topk_group, scoring_func=layer.scoring_func,
            e_score_correction_bias=layer.e_score_correction_bias,
            routed_scaling_factor=layer.routed_scaling_factor)


__all__ = ["AscendUnquantizedFusedMoEMethod", "ExpertSlots", "fused_moe", "route"]
