"""The MoE layer of the host target with EPLB: vLLM's ``RoutedExperts`` serving a
placement with redundant experts from ``ascend_eplb.runtime``.

vLLM 0.32's own EPLB machinery does not run on its CPU backend: ``enable_eplb`` is
refused at configuration time on anything but CUDA, ROCm and XPU; the CPU model runner
never builds an ``EplbState``; the router's logical -> physical mapping and load
recording are a Triton kernel that is a no-op elsewhere; and the CPU MoE kernels ignore
``expert_map`` (with ``enable_expert_parallel`` the grouped GEMM indexes global ids
into the rank's local weights and the worker dies). So this layer keeps vLLM's
routing (top-k over logical experts), weight loading and MoE kernel (its modular
``moe_kernel``, whatever CPU ISA it picked), and replaces what lies in between:

- the logical top-k ids go to ``EplbRuntime.route``, which picks one replica of each
  expert and says which (token, choice) pairs this rank serves and from which local
  slot; the others get weight 0 (the runner's all-reduce adds the ranks' parts);
- the kernel reads the runtime's slot buffers (``(experts + redundant) / ranks`` rows
  of vLLM's prepacked per-expert weights), which replace the layer's parameters;
- the ids are counted for the load recorder, and the first MoE layer of each forward
  step lets the runtime apply a rearrangement before any expert runs.

On the npu target the MoE method is ascend-core's monolithic
``AscendUnquantizedFusedMoEMethod`` (routing and experts on torch_npu ops; under tensor +
expert parallelism its per-batch all-gather / all-to-all kernel). The same runtime serves
it through the method's hook ``serve_expert_slots``: the runtime's slot buffers replace the
layer's weights, and the method hands each routed batch of logical ids to ``ExpertSlots.
to_slots``, where they are counted and mapped to global physical slots
(``EplbRuntime.route_physical``); the expert-parallel kernel then sends each row to the rank
of its slot. Weights move between ranks over the EP group's device group (HCCL). Captured
NPU graphs would replay without the per-step recording and routing updates, so EPLB on npu
runs eagerly.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.platforms import current_platform

from ascend_core.config import get_ascend_config
from ascend_core.ops.moe import AscendUnquantizedFusedMoEMethod, ExpertSlots
from ascend_eplb.expert_map import ExpertMap, load_expert_map
from ascend_eplb.runtime import EplbRuntime, EplbSettings, check_policy

__all__ = ["AscendRoutedExperts", "HostEplb", "ModelEplb", "eplb_summary"]

logger = logging.getLogger(__name__)

# Expert-major parameters of an unquantized MoE layer, moved with their expert.
EXPERT_PARAMS = ("w13_weight", "w2_weight", "w13_bias", "w2_bias")


class AscendRoutedExperts(RoutedExperts):
    """vLLM's routed experts, served through ``ModelEplb`` when EPLB is configured."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.eplb_index = -1
        self.eplb_host: ModelEplb | None = ModelEplb.for_layer(self)

    def forward_monolithic(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor | None = None,
        input_ids: torch.Tensor | None = None,
    ) -> Any:
        if self.eplb_host is None:
            return super().forward_monolithic(x, router_logits, input_ids)
        return self.eplb_host.forward_monolithic(self, x, router_logits, input_ids)

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> Any:
        if self.eplb_host is None:
            return super().forward_modular(
                x=x, topk_weights=topk_weights, topk_ids=topk_ids,
                shared_experts=shared_experts, shared_experts_input=shared_experts_input,
            )
        return self.eplb_host.forward(
            self, x, topk_weights, topk_ids, shared_experts, shared_experts_input
        )


@dataclass(frozen=True)
class _StepInfo:
    real: bool  # a scheduled step (not a dummy or profiling run)
    num_tokens: int | None = None  # tokens without padding, when known
    prefill_mask: torch.Tensor | None = None  # [num_tokens] True for prefill tokens
    # A step boundary of the EPLB runtime: every real step, and under data parallelism
    # every forward (a DP rank without requests runs a dummy batch in step with the others).
    boundary: bool | None = None

    @property
    def is_boundary(self) -> bool:
        return self.real if self.boundary is None else self.boundary


_NOT_A_STEP = _StepInfo(real=False)
# An idle DP rank's dummy batch: replans stay in step with the busy ranks; nothing recorded.
_DATA_PARALLEL_DUMMY = _StepInfo(real=False, boundary=True)


HOST, NPU = "host", "npu"


def _target() -> str | None:
    """The Ascend target this process serves, or None on another platform."""
    if current_platform.is_cpu():
        return HOST
    if getattr(current_platform, "device_type", None) == NPU:
        return NPU
    return None


def _servable(layer: Any, target: str) -> bool:
    method = layer.quant_method
    if target == NPU:
        return isinstance(method, AscendUnquantizedFusedMoEMethod) and method.runs_npu_path
    return isinstance(method, UnquantizedFusedMoEMethod)


class ModelEplb:
    """The EPLB state of one model in one worker process: its MoE layers (in forward
    order) and, once the first forward has run, their ``EplbRuntime``."""

    _by_config: dict[int, ModelEplb] = {}

    def __init__(self, vllm_config: Any, eplb_config: Any, target: str = HOST) -> None:
        self.vllm_config = vllm_config
        self.eplb_config = eplb_config
        self.target = target
        self.layers: list[AscendRoutedExperts] = []
        self.runtime: EplbRuntime | None = None
        self._step = _NOT_A_STEP
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ValueError(
                f"EPLB on the {target} target does not support pipeline parallelism "
                f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size}); "
                "use tensor/expert parallelism"
            )
        graphs = vllm_config.compilation_config.cudagraph_mode
        if target == NPU and graphs is not None and graphs.name != "NONE":
            raise NotImplementedError(
                f"EPLB on the npu target runs eagerly: captured NPU graphs would replay "
                f"without its per-step load recording and routing updates, but "
                f"compilation_config.cudagraph_mode is {graphs.name}. Pass enforce_eager=True "
                "(or cudagraph_mode='NONE'), or turn eplb_config off."
            )
        check_policy(eplb_config.policy)  # an unknown policy fails at start-up
        self.expert_map: ExpertMap | None = None
        if eplb_config.expert_map_path:
            self.expert_map = load_expert_map(eplb_config.expert_map_path)
        spec = vllm_config.speculative_config
        # A request with more tokens than a decode step schedules is prefilling.
        self.decode_query_len = 1 + (getattr(spec, "num_speculative_tokens", 0) or 0)

    @classmethod
    def for_layer(cls, layer: AscendRoutedExperts) -> ModelEplb | None:
        """The model's ``ModelEplb`` with ``layer`` added, or None if EPLB is not wanted."""
        eplb = get_ascend_config().eplb_config
        wanted = bool(eplb.dynamic_eplb or eplb.expert_map_path or eplb.num_redundant_experts)
        target = _target()
        if target is None:
            if wanted:
                logger.warning("eplb_config: the EPLB runtime serves the host and npu targets; "
                               "%s runs without it on %s", layer.layer_name,
                               getattr(current_platform, "device_type", "?"))
            return None
        servable = _servable(layer, target)
        if wanted and not servable:
            what = ("the npu platform's unquantized MoE layers (AscendUnquantizedFusedMoEMethod)"
                    if target == NPU else "unquantized MoE layers")
            raise NotImplementedError(
                f"EPLB on the {target} target serves {what}; {layer.layer_name} "
                f"uses {type(layer.quant_method).__name__}. Turn eplb_config off for this model."
            )
        # vLLM's CPU MoE kernels ignore expert_map: expert parallelism needs this layer.
        ep_on_cpu = target == HOST and layer.use_ep and servable
        if not (wanted or ep_on_cpu):
            return None
        vllm_config = get_current_vllm_config()
        host = cls._by_config.get(id(vllm_config))
        if host is None or host.vllm_config is not vllm_config or host.target != target:
            host = cls(vllm_config, eplb, target)
            cls._by_config = {id(vllm_config): host}  # one model per worker process
        layer.eplb_index = len(host.layers)
        host.layers.append(layer)
        return host

    # ------------------------------------------------------------------ forward

    @torch.compiler.disable
    def forward(
        self,
        layer: AscendRoutedExperts,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> Any:
        if layer.eplb_index == 0:
            self._begin_forward()
        runtime = self.runtime
        assert runtime is not None, "the first MoE layer starts EPLB"
        self._record(layer.eplb_index, topk_ids)
        local_slot, is_local = runtime.route(layer.eplb_index, topk_ids)
        slot_ids = torch.where(is_local, local_slot, 0).to(topk_ids.dtype)
        weights = torch.where(is_local, topk_weights, torch.zeros_like(topk_weights))
        return layer.quant_method.moe_kernel.apply(
            hidden_states=x,
            w1=layer.w13_weight,
            w2=layer.w2_weight,
            topk_ids=slot_ids.contiguous(),
            topk_weights=weights.contiguous(),
            activation=layer.activation,
            global_num_experts=runtime.slots_per_rank,
            expert_map=None,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            shared_experts=shared_experts,
            shared_experts_input=shared_experts_input,
        )

    @torch.compiler.disable
    def forward_monolithic(
        self,
        layer: AscendRoutedExperts,
        x: torch.Tensor,
        router_logits: torch.Tensor | None,
        input_ids: torch.Tensor | None,
    ) -> Any:
        """The npu method routes and runs the experts; its ``ExpertSlots`` call back into
        ``_to_slots`` with the routed ids (started in ``_start``)."""
        if layer.eplb_index == 0:
            self._begin_forward()
        return layer.quant_method.apply_monolithic(
            layer=layer, x=x, router_logits=router_logits, input_ids=input_ids
        )

    def _to_slots(self, index: int, topk_ids: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s routed logical ids -> global physical slots, recorded."""
        runtime = self.runtime
        assert runtime is not None, "the first MoE layer starts EPLB"
        self._record(index, topk_ids)
        return runtime.route_physical(index, topk_ids)

    def _record(self, index: int, topk_ids: torch.Tensor) -> None:
        step = self._step
        if not step.real:
            return
        ids = topk_ids if step.num_tokens is None else topk_ids[: step.num_tokens]
        mask = step.prefill_mask
        if mask is not None and mask.numel() != ids.size(0):
            mask = None
        self.runtime.record(index, ids, mask)

    def _begin_forward(self) -> None:
        if self.runtime is None:
            self._start()
        self._step = self._step_info()
        if self._step.is_boundary:
            self.runtime.on_step_boundary()

    def _step_info(self) -> _StepInfo:
        if not is_forward_context_available():
            return _NOT_A_STEP
        context = get_forward_context()
        metadata = context.attn_metadata
        if isinstance(metadata, list):
            metadata = metadata[0] if metadata else None
        if not metadata:
            # Every DP rank runs each step's forward (the idle ones a dummy batch), so every
            # rank counts it and replans together (their weight exchange is collective).
            if getattr(context, "dp_metadata", None) is not None:
                return _DATA_PARALLEL_DUMMY
            return _NOT_A_STEP
        for per_layer in metadata.values():
            lengths = _query_lengths(per_layer)
            if lengths is not None:
                break
        else:
            return _StepInfo(real=True)
        num_tokens = int(getattr(per_layer, "num_actual_tokens", int(lengths.sum())))
        prefill = torch.repeat_interleave(lengths > self.decode_query_len, lengths)
        mask = prefill[:num_tokens] if prefill.numel() >= num_tokens else None
        return _StepInfo(real=True, num_tokens=num_tokens, prefill_mask=mask)

    # ------------------------------------------------------------------ start

    def _start(self) -> None:
        # The slot buffers become the layers' parameters: they must be normal tensors, not
        # inference tensors (the npu runner runs its forwards in inference mode).
        with torch.inference_mode(False):
            self._start_runtime()

    def _start_runtime(self) -> None:
        layers = self.layers
        first = layers[0]
        num_experts = first.global_num_experts
        for layer in layers:
            _check_servable(layer, num_experts, first.use_ep, self.target)
        names = [n for n in EXPERT_PARAMS if isinstance(getattr(first, n, None), torch.Tensor)]
        if first.use_ep:
            from vllm.distributed import get_ep_group

            group = get_ep_group()
            num_ranks, rank = group.world_size, group.rank_in_group
            control_group, weight_group = group.cpu_group, group.device_group
        else:
            num_ranks, rank, control_group, weight_group = 1, 0, None, None
        sources = [[getattr(layer, n).data for n in names] for layer in layers]
        loaded = [_loaded_experts(layer) for layer in layers]
        if num_ranks > 1:
            everyone: list[Any] = [None] * num_ranks
            dist.all_gather_object(everyone, loaded, group=control_group)
        else:
            everyone = [loaded]
        source_phy2log = torch.stack([
            torch.cat([everyone[r][i] for r in range(num_ranks)]) for i in range(len(layers))
        ])
        expert_bytes = sum(t[0].numel() * t.element_size() for t in sources[0])
        groups = first.num_expert_group or 1
        settings = EplbSettings.from_eplb_config(
            self.eplb_config, num_experts,
            num_groups=groups if groups > 1 and num_experts % groups == 0 else 1,
        )
        runtime = EplbRuntime(
            settings, num_layers=len(layers), num_ranks=num_ranks, rank=rank,
            control_group=control_group, weight_group=weight_group, expert_bytes=expert_bytes,
        )
        buffers = runtime.start(sources, source_phy2log, runtime.initial_phy2log(self.expert_map))
        for layer, params in zip(layers, buffers, strict=True):
            for name, buffer in zip(names, params, strict=True):
                # .data keeps the Parameter objects that the kernel's config refers to.
                getattr(layer, name).data = buffer
            layer.local_num_experts = runtime.slots_per_rank
        self.runtime = runtime
        if self.target == NPU:
            for layer in layers:
                slots = ExpertSlots(settings.num_slots, num_ranks,
                                    functools.partial(self._to_slots, layer.eplb_index))
                layer.quant_method.serve_expert_slots(layer, slots)
        logger.info(
            "EPLB on the %s target: %d MoE layers, %d experts + %d redundant on %d rank(s), "
            "policy %s, dynamic %s (replan every %d steps, applied %d steps later), "
            "heat collection phase %s",
            self.target, len(layers), num_experts, settings.num_redundant_experts, num_ranks,
            settings.policy, settings.dynamic, settings.heat_collection_interval,
            settings.execution_delay, settings.phase,
        )

    def summary(self) -> dict[str, Any]:
        if self.runtime is None:
            return {"started": False, "target": self.target, "layers": len(self.layers)}
        return {"started": True, "target": self.target, **self.runtime.summary()}


def _query_lengths(metadata: Any) -> torch.Tensor | None:
    """[requests] int64 query tokens of each request in a layer's attention metadata: vLLM's
    backends give ``query_start_loc``, the npu target's Ascend attention ``query_lens``."""
    starts = getattr(metadata, "query_start_loc", None)
    if isinstance(starts, torch.Tensor) and starts.numel() >= 1:
        starts = starts.to(device="cpu", dtype=torch.int64)
        return (starts[1:] - starts[:-1]).clamp(min=0)
    lengths = getattr(metadata, "query_lens", None)
    if isinstance(lengths, (list, tuple)) and all(isinstance(n, int) for n in lengths):
        return torch.tensor(lengths, dtype=torch.int64).reshape(-1)
    return None


def eplb_summary(model: torch.nn.Module) -> dict[str, Any] | None:
    """The EPLB counters of ``model`` (a vLLM model in this process), or None without EPLB."""
    for module in model.modules():
        host = getattr(module, "eplb_host", None)
        if isinstance(host, ModelEplb):
            return host.summary()
    return None


# The name this class had while it served the host target only.
HostEplb = ModelEplb


def _check_servable(layer: RoutedExperts, num_experts: int, use_ep: bool, target: str) -> None:
    method = layer.quant_method
    if target == NPU:
        if not (_servable(layer, NPU) and getattr(layer, "ascend_weights_kn", False)):
            raise NotImplementedError(
                f"EPLB on the npu target serves the npu platform's unquantized MoE method "
                f"after weight loading; {layer.layer_name} uses {type(method).__name__}"
            )
    elif (
        not isinstance(method, UnquantizedFusedMoEMethod)
        or getattr(method, "moe_kernel", None) is None
        or method.is_monolithic
    ):
        raise NotImplementedError(
            f"EPLB on the host target serves unquantized MoE layers run by a modular "
            f"kernel; {layer.layer_name} uses {type(method).__name__}"
        )
    if layer.global_num_experts != num_experts or layer.use_ep != use_ep:
        raise ValueError(
            f"every MoE layer must have the same experts and parallelism for EPLB; "
            f"{layer.layer_name} has {layer.global_num_experts} experts (use_ep={layer.use_ep}), "
            f"the first layer {num_experts} (use_ep={use_ep})"
        )


def _loaded_experts(layer: RoutedExperts) -> torch.Tensor:
    """[local experts] int64: the logical expert vLLM loaded into each local row."""
    expert_map = layer.expert_map
    if expert_map is None:
        return torch.arange(layer.local_num_experts, dtype=torch.int64)
    expert_map = expert_map.to(device="cpu", dtype=torch.int64)
    experts = torch.full((layer.local_num_experts,), -1, dtype=torch.int64)
    placed = (expert_map >= 0).nonzero(as_tuple=True)[0]
    experts[expert_map[placed]] = placed
    if (experts < 0).any():
        raise ValueError(f"{layer.layer_name}: vLLM's expert_map leaves local rows empty")
    return experts
