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
without data parallelism the method runs a vLLM MoE kernel instead whose dispatch/combine
picks all-gather or all-to-all per batch (``ascend_core.ops.moe_ep``). On any other platform (the
host target is a CPU platform for vLLM) every call goes to vLLM's own method.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)

import ascend_kernels

SERVED_ACTIVATIONS = ("silu",)


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
              expert_map: torch.Tensor | None = None, **routing) -> torch.Tensor:
    """Route, then run the experts. ``w13`` ``[E, H, 2I]``, ``w2`` ``[E, I, H]``;
    ``expert_map`` (expert parallelism) maps global expert ids to local ones (-1 elsewhere).
    """
    weights, ids = route(router_logits, top_k=top_k, renormalize=renormalize, **routing)
    if expert_map is not None:
        ids = expert_map[ids.long()]
    return ascend_kernels.moe_experts(x, w13, w2, weights, ids)


def _activation_name(activation) -> str:
    return str(getattr(activation, "value", activation)).lower()


class AscendUnquantizedFusedMoEMethod(UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method, monolithic on the npu platform."""

    @property
    def _ours(self) -> bool:
        return self.unquantized_backend == UnquantizedMoeBackend.OOT

    @property
    def is_monolithic(self) -> bool:
        return True if self._ours else super().is_monolithic

    @property
    def supports_eplb(self) -> bool:
        # The monolithic path routes to logical experts; EPLB needs vLLM's router.
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
                lambda router_logits: route(
                    router_logits, top_k=layer.top_k, renormalize=layer.renormalize,
                    use_grouped_topk=layer.use_grouped_topk,
                    num_expert_group=layer.num_expert_group, topk_group=layer.topk_group,
                    scoring_func=layer.scoring_func,
                    e_score_correction_bias=layer.e_score_correction_bias,
                    routed_scaling_factor=layer.routed_scaling_factor))

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
        return fused_moe(
            x, router_logits, layer.w13_weight, layer.w2_weight, top_k=layer.top_k,
            renormalize=layer.renormalize, expert_map=layer.expert_map,
            use_grouped_topk=layer.use_grouped_topk, num_expert_group=layer.num_expert_group,
            topk_group=layer.topk_group, scoring_func=layer.scoring_func,
            e_score_correction_bias=layer.e_score_correction_bias,
            routed_scaling_factor=layer.routed_scaling_factor)


__all__ = ["AscendUnquantizedFusedMoEMethod", "fused_moe", "route"]
