"""FRACTAL_NZ weights on the npu target: ``weight_nz_mode`` / ``VLLM_ASCEND_ENABLE_NZ``.

Ascend's matmul units read a weight fastest in the FRACTAL_NZ storage format; torch_npu
casts a tensor to it with ``npu_format_cast(tensor, 29)`` and the matmul ops that take it
read the layout from the tensor. After the model is loaded the npu runner casts, per mode:

- 0: nothing;
- 1 (the default): the quantized weights whose torch_npu matmul takes FRACTAL_NZ. A layer
  says which of its tensors those are in ``ascend_nz_weights`` (ascend-quant's schemes set
  it: the int8 weights of ``npu_quant_matmul`` and ``npu_weight_quant_batchmatmul``);
- 2: those, and the 2-D weights of float linear layers (vLLM's ``UnquantizedLinearMethod``,
  which multiplies with ``F.linear``; torch_npu's matmul takes NZ weights).

Embeddings, the LM head, norms, MoE experts and speculative drafters keep their format.
The cast replaces each parameter's data (``param.data = npu_format_cast(...)``), so a
weight costs its memory once after the cast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ascend_core import envs
from ascend_core.config import AscendConfig, get_ascend_config

logger = logging.getLogger("ascend_core.worker.weight_format")

ACL_FORMAT_FRACTAL_NZ = 29
NEVER, QUANTIZED, ALL = 0, 1, 2
#: the attribute a layer lists its FRACTAL_NZ-capable tensors in (parameter names)
NZ_WEIGHTS_ATTR = "ascend_nz_weights"


def nz_mode(config: AscendConfig | None = None) -> int:
    """``weight_nz_mode`` from additional_config, else ``VLLM_ASCEND_ENABLE_NZ``."""
    config = config if config is not None else get_ascend_config()
    if config.weight_nz_mode is not None:
        return config.weight_nz_mode
    return envs.VLLM_ASCEND_ENABLE_NZ


@dataclass
class NzCast:
    """What ``cast_weights_to_nz`` cast: parameter names, by kind."""

    quantized: list[str] = field(default_factory=list)
    float: list[str] = field(default_factory=list)


def _float_linear_weight(module: torch.nn.Module) -> str | None:
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    if isinstance(module, LinearBase) and isinstance(
            getattr(module, "quant_method", None), UnquantizedLinearMethod):
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:
            return "weight"
    return None


def cast_weights_to_nz(model: torch.nn.Module, mode: int, torch_npu) -> NzCast:
    """Cast ``model``'s weights on an npu device to FRACTAL_NZ as ``mode`` says."""
    cast = NzCast()
    if mode == NEVER:
        return cast
    for prefix, module in model.named_modules():
        names = [(name, cast.quantized) for name in getattr(module, NZ_WEIGHTS_ATTR, ())]
        if mode == ALL:
            name = _float_linear_weight(module)
            if name is not None:
                names.append((name, cast.float))
        for name, kind in names:
            param = getattr(module, name)
            if param.device.type != "npu":
                continue
            param.data = torch_npu.npu_format_cast(param.data, ACL_FORMAT_FRACTAL_NZ)
            kind.append(f"{prefix}.{name}" if prefix else name)
    logger.info("weight_nz_mode=%d: %d quantized and %d float linear weights cast to "
                "FRACTAL_NZ", mode, len(cast.quantized), len(cast.float))
    return cast
