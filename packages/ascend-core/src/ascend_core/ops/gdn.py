"""Gated delta-net attention (Qwen3-Next / Qwen3.5's linear-attention layers) on npu.

vLLM's layer (``QwenGatedDeltaNetAttention``, a pluggable layer) projects the hidden states,
calls its core through the ``vllm::qwen_gdn_attention_core`` op (a graph splitting point,
with the layer's state cache and vLLM's GDN metadata in the forward context) and applies
the gated norm and output projection. On a CUDA-like platform that core is Triton code
written for GPUs; on npu this subclass keeps everything of vLLM's layer but the core, which
runs on ascend-kernels' ops:

1. the short causal convolution over ``[q, k, v]`` with its conv state
   (``causal_conv1d_update`` for decodes, ``causal_conv1d`` for prefills and chunks of
   them);
2. the gates ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)`` (float32);
3. the gated delta rule with q / k L2-normalised, over the recurrent state cache
   (``gated_delta_rule_decode`` for decodes, ``gated_delta_rule`` for prefills); a prefill
   without an earlier state starts from zeros.

The state cache is vLLM's (its hybrid KV-cache manager gives each request a slot: conv
state ``[slots, W - 1, dim]`` or ``[slots, dim, W - 1]``, recurrent state ``[slots, HV, V,
K]`` in the model's dtype by default); decodes come first in vLLM's GDN batches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
    QwenGatedDeltaNetAttention,
)
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

# vLLM's pluggable-layer registry is keyed by the class name it replaces.
REPLACES = "QwenGatedDeltaNetAttention"


def gdn_gates(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(g, beta)`` in float32, ``[tokens, value heads]`` each: the log decay and the
    delta rule's step size."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def refuse_speculation(speculative_config) -> None:
    """Speculative verification (MTP) through gated delta-net layers is not built on npu:
    refused when the model is built, not at the first verified batch."""
    if speculative_config is not None and speculative_config.num_speculative_tokens:
        raise NotImplementedError(
            f"speculative_config method={speculative_config.method!r}: gated delta-net "
            "layers (Qwen3-Next, Qwen3.5) on the npu target do not verify speculative "
            "tokens yet; serve this model without speculative_config (the host target "
            "runs vLLM's CPU path, which does).")


class AscendQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """vLLM's layer with its core on ascend-kernels (see the module docstring)."""

    def __init__(self, config, vllm_config, *args, **kwargs) -> None:
        from vllm.platforms import current_platform

        # The host target keeps vLLM's CPU path (forward_cpu), which verifies drafts.
        if not current_platform.is_cpu():
            refuse_speculation(vllm_config.speculative_config)
        super().__init__(config, vllm_config, *args, **kwargs)

    def _forward_core(self, mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                      core_attn_out: torch.Tensor) -> None:
        metadata = get_forward_context().attn_metadata
        meta = metadata.get(self.prefix) if isinstance(metadata, dict) else None
        if meta is None:  # the profiling run: no state cache yet
            return
        assert isinstance(meta, GDNAttentionMetadata)
        gdn_core(self, meta, mixed_qkv, b, a, core_attn_out)


def gdn_core(layer: QwenGatedDeltaNetAttention, meta: GDNAttentionMetadata,
             mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
             core_attn_out: torch.Tensor) -> None:
    """Conv, gates and gated delta rule of one batch (``meta``) for ``layer``,
    written into ``core_attn_out``."""
    from ascend_kernels import (
        causal_conv1d,
        causal_conv1d_update,
        gated_delta_rule,
        gated_delta_rule_decode,
    )

    if meta.spec_sequence_masks is not None:  # refused at start-up (refuse_speculation)
        raise NotImplementedError("gated delta-net layers on npu: speculative batch")
    conv_cache, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    conv_state = conv_cache if is_conv_state_dim_first() else conv_cache.transpose(-1, -2)
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), -1)
    activation = layer.activation if layer.activation in ("silu", "swish") else None
    indices = meta.non_spec_state_indices_tensor
    starts = meta.non_spec_query_start_loc
    decodes, decode_tokens = meta.num_decodes, meta.num_decode_tokens
    prefills, prefill_tokens = meta.num_prefills, meta.num_prefill_tokens

    def attend(x, a_rows, b_rows, rule):
        q, k, v = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(x))
        g, beta = gdn_gates(layer.A_log, a_rows, b_rows, layer.dt_bias)
        return rule(q, k, v, g, beta)

    if decodes:
        slots = indices[:decodes]
        x = causal_conv1d_update(mixed_qkv[:decode_tokens], weight, layer.conv1d.bias,
                                 conv_state, slots, activation)
        core_attn_out[:decode_tokens] = attend(
            x, a[:decode_tokens], b[:decode_tokens],
            lambda q, k, v, g, beta: gated_delta_rule_decode(
                q, k, v, g, beta, ssm_state, slots, use_qk_l2norm=True))
    if prefills:
        end = decode_tokens + prefill_tokens
        slots = indices[decodes:decodes + prefills]
        cu = starts[decodes:decodes + prefills + 1] - decode_tokens
        has_initial = meta.has_initial_state[decodes:decodes + prefills]
        x = causal_conv1d(mixed_qkv[decode_tokens:end], weight, layer.conv1d.bias,
                          conv_state, cu, slots, has_initial, activation)
        # A sequence without an earlier state starts from zeros, not from what the
        # slot's last owner left.
        ssm_state[slots[~has_initial]] = 0
        core_attn_out[decode_tokens:end] = attend(
            x, a[decode_tokens:end], b[decode_tokens:end],
            lambda q, k, v, g, beta: gated_delta_rule(
                q, k, v, g, beta, ssm_state, cu, slots, use_qk_l2norm=True))
