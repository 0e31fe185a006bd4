"""Device ops for vLLM on Ascend, one op with several backends.

Each op has a torch reference (the specification, any device), and where it
pays a Triton implementation and a torch_npu implementation. ``backend=None``
lets the dispatcher choose by device; tests force a backend by name.

Modules: ``norm`` (rms_norm, add_rms_norm, l2norm), ``activation``
(silu_and_mul), ``rope`` (rotary_embedding, mrope, rope_launch_config), ``quant``
(dynamic_per_token_quant, add_rms_norm_quant, scaled_int8_mm), ``routing``
(topk_softmax, grouped_topk), ``sampling`` (apply_top_k_top_p, apply_penalties) and
``rejection`` (the rejection-sampling kernels of speculative decoding), ``lora``
(lora_shrink, lora_expand: multi-LoRA batches), ``gdn`` (gated_delta_rule,
gated_delta_rule_decode, gated_delta_rule_verify: the linear attention of gated delta-net
layers) and ``conv`` (causal_conv1d, causal_conv1d_update, causal_conv1d_verify: their short
convolution with its state); their Triton kernels live in ``triton_kernels`` and their
torch_npu calls in ``npu_ops``.
"""

from ascend_kernels.__about__ import __version__
from ascend_kernels.activation import silu_and_mul
from ascend_kernels.conv import causal_conv1d, causal_conv1d_update, causal_conv1d_verify
from ascend_kernels.dispatch import BACKENDS, BackendUnavailable, resolve_backend
from ascend_kernels.gdn import gated_delta_rule, gated_delta_rule_decode, gated_delta_rule_verify
from ascend_kernels.lora import lora_expand, lora_shrink
from ascend_kernels.moe import moe_experts
from ascend_kernels.norm import add_rms_norm, l2norm, rms_norm
from ascend_kernels.quant import add_rms_norm_quant, dynamic_per_token_quant, scaled_int8_mm
from ascend_kernels.rejection import (
    PLACEHOLDER_TOKEN_ID,
    generate_recovery_noise,
    generate_uniform_probs,
    rejection_greedy_sample,
    rejection_random_sample,
    sample_recovered_tokens,
)
from ascend_kernels.rope import RopeLaunchConfig, mrope, rope_launch_config, rotary_embedding
from ascend_kernels.routing import grouped_topk, topk_softmax
from ascend_kernels.sampling import apply_penalties, apply_top_k_top_p

__all__ = [
    "BACKENDS",
    "PLACEHOLDER_TOKEN_ID",
    "BackendUnavailable",
    "RopeLaunchConfig",
    "__version__",
    "add_rms_norm",
    "add_rms_norm_quant",
    "apply_penalties",
    "apply_top_k_top_p",
    "causal_conv1d",
    "causal_conv1d_update",
    "causal_conv1d_verify",
    "dynamic_per_token_quant",
    "generate_recovery_noise",
    "gated_delta_rule",
    "gated_delta_rule_decode",
    "gated_delta_rule_verify",
    "generate_uniform_probs",
    "grouped_topk",
    "l2norm",
    "lora_expand",
    "lora_shrink",
    "moe_experts",
    "mrope",
    "rejection_greedy_sample",
    "rejection_random_sample",
    "resolve_backend",
    "rms_norm",
    "rope_launch_config",
    "rotary_embedding",
    "sample_recovered_tokens",
    "scaled_int8_mm",
    "silu_and_mul",
    "topk_softmax",
]
