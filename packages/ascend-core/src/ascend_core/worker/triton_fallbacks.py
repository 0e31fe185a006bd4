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


# The KV cache allocations of this process as flat byte tensors: vLLM's mamba state copies
# come as raw device addresses, which a torch copy addresses through the allocation holding
# them (NPUModelRunner registers them once the cache is allocated).
_KV_ALLOCATIONS: dict[int, torch.Tensor] = {}


def register_kv_allocation(tensor: torch.Tensor) -> None:
    """Make the allocation behind ``tensor`` (a view of the KV cache) addressable by
    ``batch_memcpy``."""
    storage = tensor.untyped_storage()
    if storage.data_ptr() not in _KV_ALLOCATIONS:
        # The whole allocation, in the view's dtype from byte 0, then as bytes.
        elements = storage.nbytes() // tensor.element_size()
        whole = tensor.as_strided((elements,), (1,), 0)
        _KV_ALLOCATIONS[storage.data_ptr()] = whole.view(torch.uint8)


def _bytes_at(address: int, size: int) -> torch.Tensor:
    for base, flat in _KV_ALLOCATIONS.items():
        if base <= address and address + size <= base + flat.numel():
            return flat[address - base:address - base + size]
    raise RuntimeError(
        f"batch_memcpy: {size} bytes at {address:#x} lie in no KV cache allocation this "
        "process registered (register_kv_allocation); the torch fallback copies only "
        "within the KV cache, as vLLM's mamba state copies do.")


def batch_memcpy(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, sizes: torch.Tensor,
                 BLOCK_SIZE: int = 1024) -> None:  # noqa: N803 - the kernel's argument names
    """vLLM's ``batch_memcpy_kernel``: copy ``sizes[i]`` bytes from ``src_ptrs[i]`` to
    ``dst_ptrs[i]`` (mamba states moving between blocks under prefix caching), here as
    torch copies within the KV cache allocation; each source is read whole before its
    destination is written (the kernel's overlap rule)."""
    for src, dst, size in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(),
                              strict=True):
        if size:
            _bytes_at(dst, size).copy_(_bytes_at(src, size).clone())


# vLLM kernel name -> replacement, for register_kernels.
TRITON_FALLBACKS = {
    "vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel": compute_slot_mapping,
    "vllm.v1.worker.mamba_utils.batch_memcpy_kernel": batch_memcpy,
}
