"""torch versions of the Triton kernels vLLM's V1 model runner launches itself, for an npu
target without a Triton backend (no triton-ascend, as on the reference torch_npu).

vLLM routes a kernel to a platform's replacement through
``vllm.triton_utils.dispatcher.register_kernels`` (the CPU platform does the same with C++
versions); ``AscendPlatform.register_triton_kernel_overrides`` registers these only when
vLLM finds no Triton backend. Each follows its kernel's arguments and result exactly.
"""

from __future__ import annotations

import torch


def compute_slot_mapping(
    num_tokens: int,
    max_num_tokens: int,
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    block_table: torch.Tensor,  # [max_num_reqs, block_table_stride] int32
    block_table_stride: int,
    slot_mapping: torch.Tensor,  # [max_num_tokens] int64, written
    KV_CACHE_BLOCK_SIZE: int,  # noqa: N803 - the kernel's argument names
    TOTAL_CP_WORLD_SIZE: int = 1,  # noqa: N803
    TOTAL_CP_RANK: int = 0,  # noqa: N803
    CP_KV_CACHE_INTERLEAVE_SIZE: int = 1,  # noqa: N803
    PAD_ID: int = -1,  # noqa: N803
    BLOCK_SIZE: int = 1024,  # noqa: N803
) -> None:
    """vLLM's ``ComputeSlotMappingKernel.kernel``: the KV slot of each scheduled token
    (``block_table[request, position // block_size] * block_size + position % block_size``),
    then ``PAD_ID`` up to ``max_num_tokens``."""
    if TOTAL_CP_WORLD_SIZE != 1:
        raise NotImplementedError(
            f"Slot mapping with context parallelism (TOTAL_CP_WORLD_SIZE="
            f"{TOTAL_CP_WORLD_SIZE}) has no torch fallback; the npu target runs without "
            "decode context parallelism when Triton is not available."
        )
    starts = query_start_loc.to(torch.int64)
    num_reqs = starts.shape[0] - 1
    first, last = (int(v) for v in starts[[0, -1]].tolist())
    query_lens = starts[1:] - starts[:-1]
    requests = torch.repeat_interleave(
        torch.arange(num_reqs, device=starts.device), query_lens, output_size=last - first
    )
    token_positions = positions[first:last].to(torch.int64)
    block_numbers = block_table[requests, token_positions // KV_CACHE_BLOCK_SIZE].to(torch.int64)
    slot_mapping[first:last] = block_numbers * KV_CACHE_BLOCK_SIZE + (
        token_positions % KV_CACHE_BLOCK_SIZE
    )
    slot_mapping[num_tokens:max_num_tokens] = PAD_ID


# vLLM kernel name -> replacement, for register_kernels.
TRITON_FALLBACKS = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
}
