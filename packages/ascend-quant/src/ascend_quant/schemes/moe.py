"""Quantized MoE experts: W8A8_DYNAMIC (int8 expert weights per channel, int8 activations
per token), the "W8A8-INT8" MoE path.

Checkpoints store one ``[out, in]`` matrix per expert and projection (gate, up, down),
described by the same tensors as a linear layer of the same scheme; the vLLM glue stacks
gate and up into ``w13`` ``[E, 2I, H]`` and down into ``w2`` ``[E, H, I]``, one
parameter per checkpoint tensor name (``w13_weight_scale``...).

``apply`` runs the experts a batch routes to, one expert at a time: tokens of expert e
are quantized per token, multiplied by ``w13[e]`` (exact int32 accumulation), passed
through SiLU-and-mul, quantized again and multiplied by ``w2[e]``; outputs are weighted
by the router and summed per token. Ops come from ascend-kernels
(``dynamic_per_token_quant``, ``scaled_int8_mm``, ``silu_and_mul``).

On npu (``ascend_quant.schemes.npu``) the routed rows are sorted by expert once and each
projection is one ``npu_grouped_matmul`` over all experts (int8 x int8 with per-channel
``scale`` and ``per_token_scale``, ``group_list`` the tokens per expert), with
``npu_dynamic_quant`` and ``npu_swiglu`` (ascend-kernels' npu backends) between them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import ClassVar

import torch

from ascend_kernels import dynamic_per_token_quant, scaled_int8_mm, silu_and_mul
from ascend_kernels.dispatch import NPU
from ascend_quant.errors import QuantConfigError
from ascend_quant.schemes import npu
from ascend_quant.schemes.base import COMPRESSED_TENSORS, ParamSpec, SchemeOptions
from ascend_quant.schemes.stored import weight_param_specs

W13, W2 = "w13", "w2"


class MoEScheme(ABC):
    """The math of one layer of quantized experts."""

    name: ClassVar[str]
    summary: ClassVar[str]
    activations: ClassVar[tuple[str, ...]] = ("silu",)

    def __init__(self, options: SchemeOptions, layer_name: str = "", *,
                 backend: str | None = None) -> None:
        self.options = options
        self.layer_name = layer_name
        #: None: the npu form for weights on an npu device (with torch_npu), else the host
        #: form; "npu" / "reference" force one (see ``ascend_quant.schemes.npu``).
        self.backend = backend
        self.validate_options()

    @property
    def layout(self) -> str:
        return self.options.layout

    def fail(self, message: str) -> QuantConfigError:
        where = f"layer {self.layer_name!r}: " if self.layer_name else ""
        return QuantConfigError(f"{where}{self.name} experts ({self.layout}): {message}")

    def validate_options(self) -> None:
        """Raise QuantConfigError for option combinations this scheme does not serve."""
        return None

    @abstractmethod
    def checkpoint_params(self, out_features: int, in_features: int) -> list[ParamSpec]:
        """The checkpoint tensors of one expert's [out, in] projection (WEIGHT and
        CHANNEL kinds only)."""

    @abstractmethod
    def process(self, loaded: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stacked ``w13_<name>`` / ``w2_<name>`` tensors -> runtime tensors."""

    @abstractmethod
    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """``x`` [T, H] routed to ``topk_ids`` [T, k] with ``topk_weights`` -> [T, H]."""

    @abstractmethod
    def dequantized_weights(self, weights: Mapping[str, torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        if f"npu_{W13}" in weights:
            weights = {name[len("npu_"):]: t for name, t in weights.items()}
        """float32 ``w13`` [E, 2I, H] and ``w2`` [E, H, I] (for references)."""


def route(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """Yield ``(expert, token_index, weight)`` for every expert that got tokens."""
    tokens = torch.arange(topk_ids.shape[0], device=topk_ids.device)
    tokens = tokens.repeat_interleave(topk_ids.shape[1])
    ids = topk_ids.reshape(-1).long()
    weights = topk_weights.reshape(-1)
    local = (ids >= 0) & (ids < num_experts)
    ids, tokens, weights = ids[local], tokens[local], weights[local]
    order = torch.argsort(ids, stable=True)
    ids, tokens, weights = ids[order], tokens[order], weights[order]
    counts = torch.bincount(ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            yield expert, tokens[start:start + count], weights[start:start + count]
        start += count


class MoEW8A8Dynamic(MoEScheme):
    name = "W8A8_DYNAMIC"
    summary = "int8 expert weights (per channel), int8 activations per token"

    def validate_options(self) -> None:
        o = self.options
        if o.group_size is not None or o.packed or not o.weight_symmetric \
                or o.weight_per_tensor:
            raise self.fail("only symmetric int8 expert weights with one scale per output "
                            "channel, stored unpacked, are served")

    def checkpoint_params(self, out_features: int, in_features: int) -> list[ParamSpec]:
        return weight_param_specs(self.options, 8, out_features, in_features)

    def process(self, loaded: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        runtime = {}
        for which in (W13, W2):
            q = loaded[f"{which}_weight"]
            scale = loaded[f"{which}_weight_scale"].float().squeeze(-1)
            if not bool(torch.isfinite(scale).all()):
                raise self.fail(f"{which}_weight_scale holds non-finite values")
            offset = loaded.get(f"{which}_weight_offset")
            if self.layout != COMPRESSED_TENSORS and offset is not None \
                    and bool((offset != 0).any()):
                raise self.fail(f"non-zero {which}_weight_offset values (asymmetric "
                                "weights) are not served")
            runtime[which] = q.transpose(1, 2).contiguous()
            runtime[f"{which}_scale"] = scale.contiguous()
        if npu.use_npu("MoE W8A8 dynamic", runtime[W13], self.backend):
            for which in (W13, W2):
                _, k, n = runtime[which].shape
                npu.check_inner(self.fail, k, n)
            return {f"npu_{name}": tensor for name, tensor in runtime.items()}
        return runtime

    def _apply_npu(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
                   topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        npu.require_half(f"{self.name} experts", x)
        w13, w2 = weights[f"npu_{W13}"], weights[f"npu_{W2}"]
        experts = w13.shape[0]
        tokens = torch.arange(topk_ids.shape[0], device=x.device)
        tokens = tokens.repeat_interleave(topk_ids.shape[1])
        ids = topk_ids.reshape(-1).long()
        gates = topk_weights.reshape(-1)
        local = (ids >= 0) & (ids < experts)
        ids, tokens, gates = ids[local], tokens[local], gates[local]
        order = torch.argsort(ids, stable=True)
        ids, tokens, gates = ids[order], tokens[order], gates[order]
        out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float32, device=x.device)
        if ids.numel() == 0:
            return out.to(x.dtype)
        counts = torch.bincount(ids, minlength=experts).to(torch.int64)
        xq, x_scale = dynamic_per_token_quant(x[tokens].contiguous(), backend=NPU)
        h = npu.grouped_int8_matmul(xq, w13, weights[f"npu_{W13}_scale"], x_scale, counts,
                                    x.dtype)
        a = silu_and_mul(h, backend=NPU)
        aq, a_scale = dynamic_per_token_quant(a, backend=NPU)
        y = npu.grouped_int8_matmul(aq, w2, weights[f"npu_{W2}_scale"], a_scale, counts,
                                    x.dtype)
        out.index_add_(0, tokens, y.float() * gates.float().unsqueeze(-1))
        return out.to(x.dtype)

    def apply(self, weights: Mapping[str, torch.Tensor], x: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if f"npu_{W13}" in weights:
            return self._apply_npu(weights, x, topk_weights, topk_ids)
        w13, w2 = weights[W13], weights[W2]
        out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float32, device=x.device)
        for expert, tokens, gate in route(topk_ids, topk_weights, w13.shape[0]):
            xq, x_scale = dynamic_per_token_quant(x[tokens])
            h = scaled_int8_mm(xq, w13[expert], x_scale, weights["w13_scale"][expert],
                               torch.float32)
            a = silu_and_mul(h)
            aq, a_scale = dynamic_per_token_quant(a)
            y = scaled_int8_mm(aq, w2[expert], a_scale, weights["w2_scale"][expert],
                               torch.float32)
            out.index_add_(0, tokens, y * gate.float().unsqueeze(-1))
        return out.to(x.dtype)

    def dequantized_weights(self, weights: Mapping[str, torch.Tensor]
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        if f"npu_{W13}" in weights:
            weights = {name[len("npu_"):]: t for name, t in weights.items()}
        w13 = weights[W13].transpose(1, 2).float() * weights["w13_scale"].unsqueeze(-1)
        w2 = weights[W2].transpose(1, 2).float() * weights["w2_scale"].unsqueeze(-1)
        return w13, w2


__all__ = ["MoEScheme", "MoEW8A8Dynamic", "route"]
