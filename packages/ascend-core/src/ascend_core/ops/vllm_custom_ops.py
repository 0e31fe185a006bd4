"""Replacements for vLLM's CustomOp layers, backed by ascend-kernels.

vLLM instantiates an out-of-tree class in place of its own layer when one is
registered under the layer's class name (``CustomOp.register_oot``). The same
classes serve both targets. ``forward_oot`` runs on the npu platform, on
ascend-kernels (the kernels' dispatcher picks the backend from the tensor's
device). The host platform stays a CPU platform for vLLM, which calls
``forward_cpu``: there the classes keep vLLM's own CPU implementations (but for
a layout vLLM's rotary kernel gets wrong, see ``AscendRotaryEmbedding``), because
ascend-kernels has no CPU kernel but its reference, and the host stack must not
be slower than stock vLLM (the reference rotary embedding, many small torch ops
against vLLM's one C++ kernel, made it so: ``benchmarks/results/host_stack.md``).
ascend-kernels' CPU path is what ``forward_oot`` runs on CPU tensors, as the unit
tests call it.
"""

from __future__ import annotations

import torch
from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

import ascend_kernels
from ascend_core import envs
from ascend_core.ops import traced_ops
from ascend_core.registry import CUSTOM_OPS


def _traced_on_npu(x: torch.Tensor) -> bool:
    """Whether Dynamo is tracing a forward on the npu device (vLLM's PIECEWISE compilation):
    the kernels then go in as opaque ``torch.ops.ascend`` nodes (``traced_ops``). The host
    target's compilation keeps tracing through ``ascend_kernels``."""
    return torch.compiler.is_compiling() and x.device.type == "npu"


class AscendRMSNorm(RMSNorm):
    def forward_oot(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.variance_size_override is not None:
            # Norm over a prefix of the hidden size: not an op of ours yet.
            return self.forward_native(x, residual)
        if not x.is_contiguous():
            # torch_npu's norms take dense tensors; Qwen3's q/k norms get strided head views.
            x = x.contiguous()
        if _traced_on_npu(x):  # one opaque node of vLLM's traced graph
            if residual is None:
                return traced_ops.rms_norm(x, self.weight, self.variance_epsilon)
            return traced_ops.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if residual is None:
            return ascend_kernels.rms_norm(x, self.weight.data, self.variance_epsilon)
        return ascend_kernels.add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)


class AscendRotaryEmbedding(RotaryEmbedding):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Sizes the Triton launch on npu; read once, not per forward.
        self.ub_size_kb = envs.VLLM_ASCEND_ROPE_UB_SIZE_KB

    def forward_oot(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor | None = None):
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        if _traced_on_npu(query):
            traced_ops.rotary_embedding_(positions, query, key, cos_sin_cache, self.head_size,
                                         self.is_neox_style, self.ub_size_kb)
            return query, key
        # In place, as vLLM's own device implementations are.
        return ascend_kernels.rotary_embedding(
            positions, query, key, cos_sin_cache, self.head_size, self.is_neox_style,
            inplace=True, ub_size_kb=self.ub_size_kb)

    def forward_cpu(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor | None = None):
        # vLLM's C++ CPU kernel reads query and key as [tokens, heads * head_size] (any row
        # stride): it rotates a 3-D [tokens, heads, head_size] view, as MLA passes its q_pe,
        # wrongly (vLLM 0.32: one head per token, the others left as they were). Those go
        # through ascend-kernels, right for every layout.
        if query.dim() == 2 and (key is None or key.dim() == 2):
            return super().forward_cpu(positions, query, key)
        return self.forward_oot(positions, query, key)


class AscendMRotaryEmbedding(MRotaryEmbedding):
    """Multimodal RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``[3, T]`` positions through
    ascend-kernels' ``mrope`` (torch_npu ``npu_mrope`` where it serves, else Triton), text
    positions ``[T]`` through ``rotary_embedding``, both in place; the host keeps vLLM's
    ``forward_cpu``."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ub_size_kb = envs.VLLM_ASCEND_ROPE_UB_SIZE_KB

    def forward_oot(self, positions: torch.Tensor, query: torch.Tensor,
                    key: torch.Tensor | None = None, offsets: torch.Tensor | None = None):
        if offsets is not None:  # vLLM's native path does not take them either
            raise NotImplementedError("AscendMRotaryEmbedding: position offsets are not "
                                      "served.")
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        if positions.dim() == 1:
            if _traced_on_npu(query):
                traced_ops.rotary_embedding_(positions, query, key, cos_sin_cache,
                                             self.head_size, self.is_neox_style,
                                             self.ub_size_kb)
                return query, key
            return ascend_kernels.rotary_embedding(
                positions, query, key, cos_sin_cache, self.head_size, self.is_neox_style,
                inplace=True, ub_size_kb=self.ub_size_kb)
        section = list(self.mrope_section)
        if _traced_on_npu(query):
            traced_ops.mrope_(positions, query, key, cos_sin_cache, self.head_size, section,
                              self.is_neox_style, self.mrope_interleaved, self.ub_size_kb)
            return query, key
        return ascend_kernels.mrope(positions, query, key, cos_sin_cache, self.head_size,
                                    section, self.is_neox_style, self.mrope_interleaved,
                                    inplace=True, ub_size_kb=self.ub_size_kb)


class AscendSiluAndMul(SiluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        if _traced_on_npu(x):
            return traced_ops.silu_and_mul(x)
        return ascend_kernels.silu_and_mul(x)


def register() -> None:
    """Put the replacements in core's custom-op registry (no vLLM side effect)."""
    CUSTOM_OPS.register("RMSNorm", AscendRMSNorm)
    CUSTOM_OPS.register("RotaryEmbedding", AscendRotaryEmbedding)
    CUSTOM_OPS.register("MRotaryEmbedding", AscendMRotaryEmbedding)
    CUSTOM_OPS.register("SiluAndMul", AscendSiluAndMul)
    # vLLM builds its unquantized MoE method through CustomOp too; ours serves the npu
    # platform, for which vLLM 0.32 has no unquantized experts kernel.
    from ascend_core.ops.moe import AscendUnquantizedFusedMoEMethod

    CUSTOM_OPS.register("UnquantizedFusedMoEMethod", AscendUnquantizedFusedMoEMethod)
    # A pluggable layer (same registry): vLLM's gated delta-net layer with its core on
    # ascend-kernels, which the npu platform reaches (the host keeps vLLM's CPU path).
    from ascend_core.ops.gdn import REPLACES, AscendQwenGatedDeltaNetAttention

    CUSTOM_OPS.register(REPLACES, AscendQwenGatedDeltaNetAttention)


def register_with_vllm() -> list[str]:
    """Register every op of ``CUSTOM_OPS`` with vLLM, once per process.

    Returns the names newly registered. Only called when an Ascend platform is
    active: on stock vLLM the plugin must leave the model's layers alone.
    """
    register()
    added = []
    for name in CUSTOM_OPS:
        op_cls = CUSTOM_OPS.get(name)
        current = op_registry_oot.get(name)
        if current is op_cls:
            continue
        if current is not None:
            raise RuntimeError(
                f"vLLM custom op {name!r} is already replaced by {current.__module__}."
                f"{current.__qualname__}; the Ascend plugin cannot also replace it with "
                f"{op_cls.__qualname__}. Disable the other plugin (VLLM_PLUGINS)."
            )
        CustomOp.register_oot(op_cls, name=name)
        added.append(name)
    return added


def enable_in_compilation_config(compilation_config) -> None:
    """Keep our ops on when vLLM's default would turn custom ops off (Inductor).

    An op the user disabled explicitly (``-RMSNorm``) stays disabled.
    """
    custom_ops = compilation_config.custom_ops
    for name in CUSTOM_OPS:
        if f"-{name}" not in custom_ops and f"+{name}" not in custom_ops:
            custom_ops.append(f"+{name}")
