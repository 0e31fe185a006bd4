"""The npu form of the schemes: which runtime form a layer gets, and the torch_npu calls.

A scheme picks its form once, when its weights are processed after loading: weights on an
``npu`` device take the npu form when torch_npu imports, anything else the host form; a
scheme built with ``backend="npu"`` (or ``"reference"``) forces it, which is how tests run
the npu form on the reference torch_npu with CPU tensors. The npu form keeps the layouts
torch_npu's ops read (int4 packed by ``npu_convert_weight_to_int4pack``, per-channel
scales as the ops want them), and ``apply`` calls the ops, nothing else.

torch_npu ops used (Ascend/op-plugin ``docs/context/torch_npu-<op>.md``):

- ``npu_quantize``: static per-tensor int8 activations, and the per-token int4 values of
  W4A4 (int8 output, per-row scales);
- ``npu_dynamic_quant`` / ``npu_quant_matmul`` (through ascend-kernels' ops);
- ``npu_weight_quant_batchmatmul``: int8 or packed int4 weights with float activations;
- ``npu_convert_weight_to_int4pack``: int4 weights at load;
- ``npu_grouped_matmul``: int8 experts with per-token scales.
"""

from __future__ import annotations

import torch

from ascend_kernels.dispatch import NPU, REFERENCE, resolve_backend, torch_npu_module

HALF = (torch.float16, torch.bfloat16)
#: npu_weight_quant_batchmatmul: antiquant_group_size is a multiple of 32 in [32, K - 1]
GROUP_MULTIPLE = 32
MAX_INNER = 65535


def use_npu(op: str, tensor: torch.Tensor, backend: str | None) -> bool:
    """True when the npu form serves: forced with ``backend="npu"`` (torch_npu must
    import), or automatically for tensors on an npu device with torch_npu present."""
    return resolve_backend(op, tensor, (REFERENCE, NPU), backend) == NPU


def require_half(what: str, x: torch.Tensor) -> None:
    if x.dtype not in HALF:
        raise TypeError(f"{what}: the npu path takes float16 or bfloat16 activations, got "
                        f"{x.dtype}")


def check_weight_only_group(fail, k: int, groups: int) -> int:
    """``antiquant_group_size`` for ``groups`` scales over ``k`` inputs (0: per channel)."""
    if groups == 1:
        return 0
    size = k // groups
    if size % GROUP_MULTIPLE or not GROUP_MULTIPLE <= size <= k - 1:
        raise fail(f"torch_npu's npu_weight_quant_batchmatmul takes groups of a multiple of "
                   f"{GROUP_MULTIPLE} inputs in [{GROUP_MULTIPLE}, K-1]; this layer has "
                   f"groups of {size} (K={k})")
    return size


def check_inner(fail, k: int, n: int) -> None:
    if not (1 <= k <= MAX_INNER and 1 <= n <= MAX_INNER):
        raise fail(f"torch_npu's quantized matmuls take K and N in [1, {MAX_INNER}]; this "
                   f"layer has K={k}, N={n}")


def int4pack(q_kn: torch.Tensor, fail) -> torch.Tensor:
    """int8 ``[K, N]`` int4 values -> int32 ``[K, N / 8]`` packed by torch_npu."""
    if q_kn.shape[1] % 8:
        raise fail(f"torch_npu packs int4 weights 8 per int32 along N: N={q_kn.shape[1]} "
                   "must be a multiple of 8")
    return torch_npu_module().npu_convert_weight_to_int4pack(q_kn.to(torch.int32).contiguous())


def unpack_int4pack(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[K, N / 8]`` from ``npu_convert_weight_to_int4pack`` -> int8 ``[K, N]``:
    value ``8w + j`` sits in bits ``4j..4j+3`` of word ``w`` (two per byte, the first in
    the low nibble, as CANN's aclnnConvertWeightToINT4Pack stores them)."""
    shifts = torch.arange(8, dtype=torch.int32, device=words.device) * 4
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF
    signed = torch.where(nibbles >= 8, nibbles - 16, nibbles)
    return signed.reshape(words.shape[0], -1).to(torch.int8)


def quantize_static(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None
                    ) -> torch.Tensor:
    """``round(x / scale + zero)`` in int8: ``npu_quantize`` with ``div_mode=True``, one
    float32 scale and an int32 zero point."""
    return torch_npu_module().npu_quantize(x, scale, zero, torch.qint8, -1, True)


def quantize_rows(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``round(x / scale[row])`` in int8 (per-row float32 ``scale``, none zero):
    ``npu_quantize`` along dim 0."""
    return torch_npu_module().npu_quantize(x, scale, None, torch.qint8, 0, True)


def weight_quant_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        offset: torch.Tensor | None, bias: torch.Tensor | None,
                        group_size: int) -> torch.Tensor:
    """``x @ ((weight + offset) * scale) + bias``; ``scale``/``offset`` float32 ``[G, N]``
    are cast to ``x``'s dtype (the op wants them so), ``bias`` to float32 (bfloat16 ``x``)
    or float16 (float16 ``x``)."""
    per_channel = scale.shape[0] == 1
    antiquant_scale = (scale[0] if per_channel else scale).to(x.dtype)
    antiquant_offset = None
    if offset is not None:
        antiquant_offset = (offset[0] if per_channel else offset).to(x.dtype)
    if bias is not None:
        bias = bias.to(torch.float32 if x.dtype == torch.bfloat16 else torch.float16)
        bias = bias.contiguous()
    return torch_npu_module().npu_weight_quant_batchmatmul(
        x, weight, antiquant_scale, antiquant_offset, bias=bias,
        antiquant_group_size=group_size)


def grouped_int8_matmul(xq: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                        token_scale: torch.Tensor, counts: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """Rows of ``xq`` (int8, sorted by group, ``counts`` per group) times int8 ``weight``
    ``[E, K, N]``: ``(x @ w) * scale[e] * token_scale``. ``scale`` (float32 ``[E, N]``)
    goes in as bfloat16 for bfloat16 output and float32 for float16 output, as the op's
    per-token rows require."""
    scale_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float32
    (out,) = torch_npu_module().npu_grouped_matmul(
        [xq], [weight], scale=[scale.to(scale_dtype)], per_token_scale=[token_scale],
        group_list=counts, split_item=2, group_type=0, group_list_type=1,
        output_dtype=out_dtype)
    return out


__all__ = ["check_inner", "check_weight_only_group", "grouped_int8_matmul", "int4pack",
           "quantize_rows", "quantize_static", "require_half", "unpack_int4pack", "use_npu",
           "weight_quant_matmul"]
