"""vLLM's MoE hook for ascend-quant's expert schemes: ``AscendQuantMoEMethod``.

Each checkpoint tensor of an expert projection becomes one stacked parameter,
``w13_<name>`` ``[E, 2I, ...]`` (gate and up) or ``w2_<name>`` ``[E, H, ...]`` (down),
loaded by vLLM's RoutedExperts loader (scales per channel), after the same shape,
dtype and completeness checks as linear layers.

On the npu platform the method is monolithic, as the npu target's unquantized experts
(``ascend_core.ops.moe``): vLLM hands ``apply_monolithic`` the router logits, the routing
runs through ascend-core's ``route`` (ascend-kernels' ``topk_softmax`` / ``grouped_topk``,
torch_npu's gating ops on npu tensors; vLLM's router would call ``_moe_C``, which npu lacks)
and the experts through the scheme's npu form (``npu_grouped_matmul`` int8, ``npu_swiglu``).
Elsewhere (the host target) vLLM's router picks the experts and calls ``apply``.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from ascend_core.ops.moe import route
from ascend_quant.errors import QuantConfigError
from ascend_quant.schemes.base import Kind
from ascend_quant.schemes.moe import MoEScheme
from ascend_quant.vllm.linear import install_runtime, runtime_weights
from ascend_quant.vllm.params import LoadLedger

# vLLM's shard ids: w1 = gate, w3 = up (both in w13), w2 = down.
STACKS = {"w1": "w13", "w3": "w13", "w2": "w2"}


def npu_platform() -> bool:
    """Whether vLLM runs on the npu platform (the npu target)."""
    from vllm.platforms import current_platform

    return current_platform.device_type == "npu"


class AscendQuantMoEMethod(FusedMoEMethodBase):
    """Serves one layer of routed experts with an ascend-quant MoE scheme."""

    def __init__(self, scheme: MoEScheme, moe, projection_names: dict[str, str], *,
                 route_here: bool | None = None) -> None:
        super().__init__(moe)
        self.scheme = scheme
        self.projection_names = projection_names  # shard id -> checkpoint name
        #: Routing in this method (monolithic, ascend-kernels' routing): the npu platform's
        #: way; None decides by the platform.
        self.route_here = npu_platform() if route_here is None else bool(route_here)
        #: Forward calls routed here, and whether the experts' weights took the scheme's
        #: npu form (set after loading).
        self.monolithic_calls = 0
        self.npu_form = False
        activation = getattr(moe.activation, "value", moe.activation)
        if activation not in scheme.activations:
            raise scheme.fail(f"expert activation {activation!r} is not served; served: "
                              f"{', '.join(scheme.activations)}")
        if moe.moe_parallel_config.use_ep:
            raise scheme.fail("expert parallelism is not served by this scheme yet; serve "
                              "without --enable-expert-parallel")

    def create_weights(self, layer: torch.nn.Module, num_experts: int, hidden_size: int,
                       intermediate_size_per_partition: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        scheme = self.scheme
        inter = intermediate_size_per_partition
        vllm_loader = extra_weight_attrs["weight_loader"]
        full_inter = self.moe.intermediate_size
        specs13 = scheme.checkpoint_params(2 * inter, hidden_size)
        specs2 = scheme.checkpoint_params(hidden_size, inter)
        for spec in specs13 + specs2:
            if spec.kind not in (Kind.WEIGHT, Kind.CHANNEL):
                raise scheme.fail(f"{spec.name} ({spec.kind.value}) cannot be stacked per "
                                  "expert")
        specs = {f"w13_{s.name}": s for s in specs13} | {f"w2_{s.name}": s for s in specs2}
        layer_name = scheme.layer_name or getattr(layer, "layer_name", "experts")
        ledger = LoadLedger(layer_name, scheme.name, [], specs)
        for name, spec in specs.items():
            param = torch.nn.Parameter(torch.zeros(num_experts, *spec.shape, dtype=spec.dtype),
                                       requires_grad=False)
            param.weight_loader = self._checked_loader(name, spec, ledger, vllm_loader,
                                                       full_inter, hidden_size)
            if spec.kind == Kind.CHANNEL:
                param.quant_method = "channel"
            layer.register_parameter(name, param)
        layer.ascend_quant_ledger = ledger
        layer.ascend_quant_scheme = scheme.name
        layer.ascend_quant_logical_numel = num_experts * 3 * inter * hidden_size
        self.num_experts = num_experts

    def _checked_loader(self, name, spec, ledger, vllm_loader, full_inter: int, hidden: int):
        scheme = self.scheme

        def loader(param, loaded_weight, weight_name, shard_id, expert_id,
                   return_success=False):
            if shard_id not in STACKS or not name.startswith(STACKS[shard_id] + "_"):
                raise ledger.fail(f"{weight_name} (shard {shard_id}) does not belong in "
                                  f"{name}")
            out, inp = (hidden, full_inter) if shard_id == "w2" else (full_inter, hidden)
            expected = {s.name: s for s in scheme.checkpoint_params(out, inp)}[spec.name]
            where = f"{ledger.layer}.{expert_id}.{self.projection_names[shard_id]}.{spec.name}"
            ledger.check(spec, where, loaded_weight, expected.shape)
            done = vllm_loader(param, loaded_weight, weight_name, shard_id=shard_id,
                               expert_id=expert_id, return_success=True)
            if done:
                ledger.record(name, [(expert_id, shard_id)])
            return done if return_success else None

        return loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        ledger: LoadLedger = layer.ascend_quant_ledger
        keys = []
        for expert in range(self.num_experts):
            for shard_id, stack in STACKS.items():
                keys.append(((expert, shard_id), stack, expert, shard_id))
        lost = []
        for name, spec in ledger.specs.items():
            if not spec.required:
                continue
            got = ledger.arrived.get(name, set())
            for key, stack, expert, shard_id in keys:
                if name.startswith(stack + "_") and key not in got:
                    lost.append(f"{ledger.layer}.{expert}.{self.projection_names[shard_id]}."
                                f"{spec.name}")
        if lost:
            shown = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8
                                           else "")
            raise QuantConfigError(
                f"layer {ledger.layer!r} ({self.scheme.name} experts): the checkpoint lacks "
                f"{shown}; refusing to serve the experts with uninitialised values")
        loaded = {name: getattr(layer, name).data for name in ledger.specs
                  if name in ledger.arrived}
        runtime = self.scheme.process(loaded)
        install_runtime(layer, list(ledger.specs), runtime)
        del layer.ascend_quant_ledger
        self.npu_form = any(name.startswith("npu_") for name in runtime)
        if self.route_here:
            self._check_routing(layer)

    @property
    def is_monolithic(self) -> bool:
        return self.route_here

    @property
    def runs_npu_path(self) -> bool:
        """Routing here and experts in the scheme's npu form (known after loading)."""
        return self.route_here and self.npu_form

    def _check_routing(self, layer) -> None:
        problems = []
        if getattr(self.moe, "has_bias", False):
            problems.append("expert biases")
        if layer.apply_router_weight_on_input:
            problems.append("apply_router_weight_on_input")
        if getattr(layer, "custom_routing_function", None) is not None:
            problems.append("a custom routing function")
        if getattr(layer, "routing_sink", None) is not None:
            problems.append("a routing sink")
        if getattr(self.moe.moe_parallel_config, "enable_eplb", False):
            problems.append("EPLB (--enable-eplb)")
        if problems:
            raise self.scheme.fail(f"the npu target's routing does not serve "
                                   f"{', '.join(problems)}; serve this model with "
                                   "VLLM_ASCEND_TARGET=host")

    def get_fused_moe_quant_config(self, layer: torch.nn.Module):
        return None

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, shared_experts=None, shared_experts_input=None
              ) -> torch.Tensor:
        if layer.apply_router_weight_on_input:
            raise self.scheme.fail("apply_router_weight_on_input is not served")
        return self.scheme.apply(runtime_weights(layer), x, topk_weights, topk_ids)

    def select_experts(self, layer, router_logits: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], ids [T, k])`` through ascend-kernels' routing ops."""
        return route(router_logits, top_k=layer.top_k, renormalize=layer.renormalize,
                     use_grouped_topk=layer.use_grouped_topk,
                     num_expert_group=layer.num_expert_group, topk_group=layer.topk_group,
                     scoring_func=layer.scoring_func,
                     e_score_correction_bias=layer.e_score_correction_bias,
                     routed_scaling_factor=layer.routed_scaling_factor)

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:
        if not self.route_here:
            raise self.scheme.fail("apply_monolithic is the npu platform's path; this layer "
                                   "is routed by vLLM's router")
        self.monolithic_calls += 1
        weights, ids = self.select_experts(layer, router_logits)
        return self.scheme.apply(runtime_weights(layer), x, weights, ids)
