"""Reference torch_npu: a test double of Ascend's torch_npu on plain torch and the CPU.

For tests only; never shipped to users. Put ``testing/reference_torch_npu`` first on
``sys.path`` and ``import torch_npu`` gives this package instead of the real one, which
cannot be imported without CANN. It implements the torch_npu functions the plugin calls,
following torch_npu's documentation (argument names, shapes, dtype rules), and raises on
arguments it does not model. It stands in for the library, never for the plugin's code.

What importing it does (see ``torch_npu._registration``):

- renames torch's PrivateUse1 backend to ``npu``, so ``torch.device("npu:0")`` parses;
- registers ``torch_npu.npu`` as ``torch.npu``;
- registers the ``hccl`` distributed backend, which is gloo underneath.

Tensors live on the "npu" device in host memory: a small C++ extension
(``csrc/reference_device.cpp``, compiled on first import, see ``torch_npu._device_ext``)
gives torch's PrivateUse1 backend an allocator accounted per NPU, a device guard, the
factory/copy/resize kernels and a fallback that runs torch's CPU kernel for every other op
(custom ops registered for CPU included). The torch_npu functions take npu tensors (or CPU
ones) and return results on their device (``torch_npu._on_device``). Device count, names,
properties and memory numbers come from a modelled machine
configured by environment variables, read at each call:

=====================================  ===========================================
``TORCH_NPU_REFERENCE_DEVICE_COUNT``   physical NPUs in the machine (1)
``ASCEND_RT_VISIBLE_DEVICES``          physical ids this process sees (all)
``TORCH_NPU_REFERENCE_TOTAL_MEMORY``   bytes per NPU (64 GiB)
``TORCH_NPU_REFERENCE_DEVICE_NAME``    device name ("Ascend910B-reference")
=====================================  ===========================================

Memory is accounted by a modelled caching allocator fed by the real npu allocations; tests
may add modelled bytes through ``torch_npu._reference`` (``simulate_allocation`` /
``simulate_free``), which also has ``reset_state()`` and ``uninstall()``.

Modelled: ``torch.npu`` device selection, properties, memory statistics, streams, events,
seeding and graphs (``NPUGraph``, ``graph``; capture records, replay re-runs; task groups
and their updates, ``ExternalEvent``);
``torch_npu.npu_rms_norm`` and ``torch_npu.npu_swiglu``; the norm, quant and
rotary ops of ``_ops_norm_quant``, the routing ops of ``_ops_routing``, the MC2 token
exchange of ``_ops_moe_distribute`` (``npu_moe_distribute_dispatch_v2`` / ``_combine_v2``),
the gated delta-net ops of ``_ops_gdn`` (``npu_recurrent_gated_delta_rule``,
``npu_chunk_gated_delta_rule``)
and the weight quantization and grouped-matmul ops of ``_ops_quant``; the paged KV-cache
write and fused inference attention of ``_ops_attention`` (with the attention's ``.out``
form and its graph workspace); storage formats (``npu_format_cast``, ``get_npu_format``, ``Format``:
ND and FRACTAL_NZ, recorded per storage, see ``_formats``). Not modelled:
profiling, formats other than ND and FRACTAL_NZ, every other fused op; those names are
absent, so their use fails. The exception is a name that libraries
import eagerly when torch_npu is importable (transformers imports ``npu_fusion_attention``):
it exists and raises ``NotImplementedError`` when called (``torch_npu._unmodelled``).
"""

import torch as _torch

from torch_npu import (  # noqa: F401 - _reference: test controls
           _formats,
           _ops,
           _ops_attention,
           _ops_gdn,
           _ops_moe_distribute,
           _ops_norm_quant,
           _ops_quant,
           _ops_routing,
           _reference,
           npu,
)
from torch_npu._on_device import on_device as _on_device
from torch_npu._registration import install as _install
from torch_npu._unmodelled import npu_fusion_attention

# Each function takes npu tensors (host views underneath) or CPU tensors; see _on_device.
npu_rms_norm = _on_device(_ops.npu_rms_norm)
npu_swiglu = _on_device(_ops.npu_swiglu)
npu_fused_infer_attention_score = _on_device(_ops_attention.npu_fused_infer_attention_score)
# The out form a graph task group captures, and its workspace (an allocation, not a task).
npu_fused_infer_attention_score.out = _on_device(
    _ops_attention.npu_fused_infer_attention_score_out, "npu_fused_infer_attention_score.out")
_npu_fused_infer_attention_score_get_max_workspace = (
    _ops_attention.npu_fused_infer_attention_score_get_max_workspace)
_scatter_pa_kv_cache = _on_device(_ops_attention.npu_scatter_pa_kv_cache,
                                  "npu_scatter_pa_kv_cache", nz=("key_cache", "value_cache"))


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode="PA_NZ"):
    """The reference's ``npu_scatter_pa_kv_cache`` (``_ops_attention``): npu caches must be
    FRACTAL_NZ for ``cache_mode='PA_NZ'`` and ND otherwise, as the two scenarios are."""
    want_nz = cache_mode == "PA_NZ"
    takes = ("FRACTAL_NZ caches (npu_format_cast(cache, 29))" if want_nz
             else "caches not cast to FRACTAL_NZ")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if isinstance(cache, _torch.Tensor) and cache.device.type == "npu" and (
                (_formats.format_of(cache) == _formats.Format.FRACTAL_NZ) != want_nz):
            raise RuntimeError(f"npu_scatter_pa_kv_cache: {name} is "
                               f"{_formats.format_of(cache).name} but cache_mode={cache_mode!r} "
                               f"takes {takes}.")
    return _scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping,
                                compress_lens=compress_lens,
                                compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens,
                                cache_mode=cache_mode)
npu_add_rms_norm = _on_device(_ops_norm_quant.npu_add_rms_norm)
npu_add_rms_norm_dynamic_quant = _on_device(_ops_norm_quant.npu_add_rms_norm_dynamic_quant)
npu_add_rms_norm_quant = _on_device(_ops_norm_quant.npu_add_rms_norm_quant)
npu_apply_rotary_pos_emb = _on_device(_ops_norm_quant.npu_apply_rotary_pos_emb)
npu_mrope = _on_device(_ops_norm_quant.npu_mrope)
npu_dynamic_quant = _on_device(_ops_norm_quant.npu_dynamic_quant)
# x2 in FRACTAL_NZ: the binding calls aclnnQuantMatmulWeightNz for it (op-plugin's
# npu_quant_matmul checks is_nz_format(x2)), though the page lists ND only.
npu_quant_matmul = _on_device(_ops_norm_quant.npu_quant_matmul, nz=("x2",))
npu_rotary_mul = _on_device(_ops_norm_quant.npu_rotary_mul)
npu_convert_weight_to_int4pack = _on_device(_ops_quant.npu_convert_weight_to_int4pack)
npu_grouped_matmul = _on_device(_ops_quant.npu_grouped_matmul, nz=("weight",))
npu_quantize = _on_device(_ops_quant.npu_quantize)
npu_trans_quant_param = _on_device(_ops_quant.npu_trans_quant_param)
npu_weight_quant_batchmatmul = _on_device(_ops_quant.npu_weight_quant_batchmatmul,
                                          nz=("weight",))
# Formats act on npu tensors themselves (their storage), not on host views.
Format = _formats.Format
npu_format_cast = _formats.npu_format_cast
get_npu_format = _formats.get_npu_format
npu_moe_gating_top_k = _on_device(_ops_routing.npu_moe_gating_top_k)
npu_moe_gating_top_k_softmax = _on_device(_ops_routing.npu_moe_gating_top_k_softmax)
npu_top_k_top_p = _on_device(_ops_routing.npu_top_k_top_p)
npu_moe_distribute_dispatch_v2 = _on_device(_ops_moe_distribute.npu_moe_distribute_dispatch_v2)
npu_moe_distribute_combine_v2 = _on_device(_ops_moe_distribute.npu_moe_distribute_combine_v2)
npu_recurrent_gated_delta_rule = _on_device(_ops_gdn.npu_recurrent_gated_delta_rule)
npu_chunk_gated_delta_rule = _on_device(_ops_gdn.npu_chunk_gated_delta_rule)

__version__ = "2.13.0+reference"

_install(npu)

__all__ = ["Format", "get_npu_format", "npu_format_cast", "npu", "npu_fusion_attention",
           "npu_rms_norm", "npu_swiglu",
           "npu_add_rms_norm", "npu_add_rms_norm_dynamic_quant", "npu_add_rms_norm_quant",
           "npu_apply_rotary_pos_emb", "npu_dynamic_quant",
           "npu_mrope", "npu_quant_matmul", "npu_rotary_mul",
           "npu_moe_gating_top_k", "npu_moe_gating_top_k_softmax",
           "npu_moe_distribute_dispatch_v2", "npu_moe_distribute_combine_v2", "npu_top_k_top_p",
           "npu_recurrent_gated_delta_rule", "npu_chunk_gated_delta_rule",
           "npu_convert_weight_to_int4pack", "npu_grouped_matmul", "npu_quantize",
           "npu_trans_quant_param",
           "npu_weight_quant_batchmatmul", "npu_fused_infer_attention_score",
           "npu_scatter_pa_kv_cache"]
