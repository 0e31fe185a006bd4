"""int8 quantization ops on torch_npu.

- ``npu_dynamic_quant``: per-token symmetric int8 (docs/context/torch_npu-npu_dynamic_quant.md).
- ``npu_add_rms_norm_quant``: add + RMSNorm + static int8 quantization
  (torch_npu-npu_add_rms_norm_quant.md).
- ``npu_add_rms_norm_dynamic_quant``: add + RMSNorm + per-token int8 quantization
  (torch_npu-npu_add_rms_norm_dynamic_quant.md).
- ``npu_quant_matmul``: int8 x int8 matmul with per-channel and per-token scales
  (torch_npu-npu_quant_matmul.md).
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import torch_npu_module

_HALF_DTYPES = (torch.float16, torch.bfloat16)
# npu_quant_matmul: "x1与x2最后一维的shape大小不能超过65535".
_MATMUL_MAX_LAST_DIM = 65535


def half_precision_problem(op: str, x: torch.Tensor) -> str | None:
    """The fused quant ops take float16 and bfloat16 inputs only."""
    if x.dtype not in _HALF_DTYPES:
        return f"torch_npu's {op} takes float16 or bfloat16, not {x.dtype}"
    return None


def dynamic_per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` is ``[rows, hidden]``; returns int8 ``[rows, hidden]`` and float32 ``[rows]``."""
    return torch_npu_module().npu_dynamic_quant(x)


def add_rms_norm_static_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, scale: torch.Tensor, offset: torch.Tensor | None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``(int8 out, x + residual)``.

    The page wants ``scales1`` and ``zero_points1`` shaped like gamma, as float32 / int32
    for float16 inputs and as bfloat16 for bfloat16 inputs, so the per-tensor values are
    broadcast to ``[hidden]``. ``div_mode=False`` multiplies by ``scales1``, which is
    therefore the reciprocal of the scale: ``round(y * (1 / scale) + zero_points1)``, the
    ops' definition (rounded to bfloat16 with bfloat16 inputs).
    """
    hidden = x.shape[-1]
    scale_dtype = torch.float32 if x.dtype == torch.float16 else torch.bfloat16
    offset_dtype = torch.int32 if x.dtype == torch.float16 else torch.bfloat16
    scales1 = (1.0 / scale.float()).reshape(1).to(scale_dtype).expand(hidden).contiguous()
    zero_points1 = (None if offset is None
                    else offset.reshape(1).to(offset_dtype).expand(hidden).contiguous())
    y1, _y2, added = torch_npu_module().npu_add_rms_norm_quant(
        x, residual, weight.to(x.dtype), scales1, zero_points1, epsilon=eps, div_mode=False)
    return y1, added


def add_rms_norm_dynamic_quant(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                               eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns ``(int8 out, per-row float32 scales, x + residual)``; only the first of the
    op's two quantization outputs is asked for (``output_mask=[True, False]``)."""
    y1, _y2, added, scale1, _scale2 = torch_npu_module().npu_add_rms_norm_dynamic_quant(
        x, residual, weight.to(x.dtype), epsilon=eps, output_mask=[True, False])
    return y1, scale1, added


def scaled_int8_mm_problem(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype
                           ) -> str | None:
    if out_dtype not in _HALF_DTYPES:
        return (f"torch_npu's npu_quant_matmul outputs float16 or bfloat16 (with "
                f"per-token scales), not {out_dtype}")
    if a.shape[-1] > _MATMUL_MAX_LAST_DIM or b.shape[-1] > _MATMUL_MAX_LAST_DIM:
        return (f"npu_quant_matmul limits the last dims of x1 and x2 to "
                f"{_MATMUL_MAX_LAST_DIM}; got K={a.shape[-1]}, N={b.shape[-1]}")
    return None


def scaled_int8_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                   scale_b: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None) -> torch.Tensor:
    """``a`` int8 ``[M, K]``, ``b`` int8 ``[K, N]``, ``scale_a`` float32 ``[M]`` or
    ``[1]``, ``scale_b`` float32 ``[N]`` or ``[1]``.

    ``scale`` (per channel) and ``pertoken_scale`` (per row, which must be ``(m,)``) are
    float32; a float bias is added after scaling, as the page's formula for
    bfloat16/float32 bias says, so it is passed as float32.
    """
    pertoken_scale = scale_a.float().reshape(-1).expand(a.shape[0]).contiguous()
    return torch_npu_module().npu_quant_matmul(
        a, b, scale_b.float().reshape(-1).contiguous(),
        pertoken_scale=pertoken_scale,
        bias=None if bias is None else bias.float().contiguous(),
        output_dtype=out_dtype,
    )
