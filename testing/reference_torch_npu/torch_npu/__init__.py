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

The "npu" device is modelled honestly as the CPU: torch cannot hold tensors on a
PrivateUse1 device without a compiled backend, so creating one raises
``NotImplementedError`` saying so, and the reference's functions take CPU tensors.
Device count, names, properties and memory numbers come from a modelled machine
configured by environment variables, read at each call:

=====================================  ===========================================
``TORCH_NPU_REFERENCE_DEVICE_COUNT``   physical NPUs in the machine (1)
``ASCEND_RT_VISIBLE_DEVICES``          physical ids this process sees (all)
``TORCH_NPU_REFERENCE_TOTAL_MEMORY``   bytes per NPU (64 GiB)
``TORCH_NPU_REFERENCE_DEVICE_NAME``    device name ("Ascend910B-reference")
=====================================  ===========================================

Memory is accounted by a modelled caching allocator that tests drive through
``torch_npu._reference`` (``simulate_allocation`` / ``simulate_free``), which also has
``reset_state()`` and ``uninstall()``.

Modelled: ``torch.npu`` device selection, properties, memory statistics, streams, events
and seeding; ``torch_npu.npu_rms_norm`` and ``torch_npu.npu_swiglu``; the norm, quant and
rotary ops of ``_ops_norm_quant``, the routing ops of ``_ops_routing`` and the weight
quantization and grouped-matmul ops of ``_ops_quant``; the paged KV-cache write and fused
inference attention of ``_ops_attention``. Not modelled: tensors
on the npu device, NPU graphs, profiling, formats (``npu_format_cast``), every other fused
op; those names are absent, so their use fails. The exception is a name that libraries
import eagerly when torch_npu is importable (transformers imports ``npu_fusion_attention``):
it exists and raises ``NotImplementedError`` when called (``torch_npu._unmodelled``).
"""

from torch_npu import _reference, npu  # noqa: F401 - _reference: test controls
from torch_npu._ops import npu_rms_norm, npu_swiglu
from torch_npu._ops_attention import npu_fused_infer_attention_score, npu_scatter_pa_kv_cache
from torch_npu._ops_norm_quant import (
    npu_add_rms_norm,
    npu_add_rms_norm_dynamic_quant,
    npu_add_rms_norm_quant,
    npu_apply_rotary_pos_emb,
    npu_dynamic_quant,
    npu_quant_matmul,
    npu_rotary_mul,
)
from torch_npu._ops_quant import (
    npu_convert_weight_to_int4pack,
    npu_grouped_matmul,
    npu_quantize,
    npu_weight_quant_batchmatmul,
)
from torch_npu._ops_routing import (
    npu_moe_gating_top_k,
    npu_moe_gating_top_k_softmax,
    npu_top_k_top_p,
)
from torch_npu._registration import install as _install
from torch_npu._unmodelled import npu_fusion_attention

__version__ = "2.13.0+reference"

_install(npu)

__all__ = ["npu", "npu_fusion_attention", "npu_rms_norm", "npu_swiglu",
           "npu_add_rms_norm", "npu_add_rms_norm_dynamic_quant", "npu_add_rms_norm_quant",
           "npu_apply_rotary_pos_emb", "npu_dynamic_quant", "npu_quant_matmul", "npu_rotary_mul",
           "npu_moe_gating_top_k", "npu_moe_gating_top_k_softmax", "npu_top_k_top_p",
           "npu_convert_weight_to_int4pack", "npu_grouped_matmul", "npu_quantize",
           "npu_weight_quant_batchmatmul", "npu_fused_infer_attention_score",
           "npu_scatter_pa_kv_cache"]
