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

Under speculative decoding (Qwen3-Next's MTP) vLLM widens each conv state to ``W - 1 +
drafts`` columns (a rolling buffer) and gives each request a row of ``drafts + 1`` recurrent
state slots; a verified request (a "spec" sequence: its last token and its drafts) runs the
verification forms (``causal_conv1d_verify``, ``gated_delta_rule_verify``), which resume
after the last accepted token and keep the state after each token. The other requests
(prefills; vLLM counts a plain decode as a prefill while spec sequences exist) run as above
on the buffer's first ``W - 1`` columns, where a prefill leaves its conv state.
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


class AscendQwenGatedDeltaNetAttention(QwenGatedDeltaNetAttention):
    """vLLM's layer with its core on ascend-kernels (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's CUDA decode kernel (its fused spec-decode path with the gated norm) is not
        # ours: every batch goes through _forward_core.
        self.gdn_decode_kernel = "ascend-kernels"
        self.enable_fused_gdn_spec_decode = False

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
    conv_cache, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    conv_state = conv_cache if is_conv_state_dim_first() else conv_cache.transpose(-1, -2)
    tokens = meta.num_actual_tokens
    if meta.spec_sequence_masks is None:
        _plain(layer, meta, mixed_qkv, b, a, core_attn_out, conv_state, ssm_state)
        return
    spec_rows = meta.spec_token_indx if (meta.num_prefills or meta.num_decodes) else None

    def rows(x, index):
        return x[:tokens] if index is None else x.index_select(0, index)

    spec_out = _verify(layer, meta, rows(mixed_qkv, spec_rows), rows(b, spec_rows),
                       rows(a, spec_rows), conv_state, ssm_state)
    if spec_rows is None:
        core_attn_out[:tokens] = spec_out
        return
    core_attn_out.index_copy_(0, spec_rows, spec_out)
    other = meta.non_spec_token_indx
    other_out = torch.empty((other.numel(), *core_attn_out.shape[1:]),
                            dtype=core_attn_out.dtype, device=core_attn_out.device)
    _plain(layer, meta, mixed_qkv.index_select(0, other), b.index_select(0, other),
           a.index_select(0, other), other_out, conv_state, ssm_state)
    core_attn_out.index_copy_(0, other, other_out)


def _attend(layer, x, a, b, rule):
    q, k, v = (t.squeeze(0) for t in layer.rearrange_mixed_qkv(x))
    g, beta = gdn_gates(layer.A_log, a, b, layer.dt_bias)
    return rule(q, k, v, g, beta)


def _conv_args(layer):
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), -1)
    activation = layer.activation if layer.activation in ("silu", "swish") else None
    return weight, layer.conv1d.bias, activation


def _verify(layer, meta, mixed_qkv, b, a, conv_state, ssm_state) -> torch.Tensor:
    """The spec sequences (each request's last token and its drafts)."""
    from ascend_kernels import causal_conv1d_verify, gated_delta_rule_verify

    sequences = meta.num_spec_decodes
    rows = meta.spec_state_indices_tensor[:sequences]
    starts = meta.spec_query_start_loc[:sequences + 1]
    accepted = meta.num_accepted_tokens[:sequences]
    weight, bias, activation = _conv_args(layer)
    x = causal_conv1d_verify(mixed_qkv, weight, bias, conv_state, starts, rows[:, 0],
                             accepted, activation)
    return _attend(layer, x, a, b, lambda q, k, v, g, beta: gated_delta_rule_verify(
        q, k, v, g, beta, ssm_state, starts, rows, accepted, use_qk_l2norm=True))


def _plain(layer, meta, mixed_qkv, b, a, core_attn_out, conv_state, ssm_state) -> None:
    """Decodes (one token each) then prefills, each request with one state slot."""
    from ascend_kernels import (
        causal_conv1d,
        causal_conv1d_update,
        gated_delta_rule,
        gated_delta_rule_decode,
    )

    # Under speculative decoding the conv state is wider; a plain step uses its first W - 1
    # columns.
    conv_state = conv_state[..., :layer.conv1d.weight.size(-1) - 1]
    weight, bias, activation = _conv_args(layer)
    indices = meta.non_spec_state_indices_tensor
    starts = meta.non_spec_query_start_loc
    decodes, decode_tokens = meta.num_decodes, meta.num_decode_tokens
    prefills, prefill_tokens = meta.num_prefills, meta.num_prefill_tokens

    if decodes:
        slots = indices[:decodes]
        x = causal_conv1d_update(mixed_qkv[:decode_tokens], weight, bias, conv_state, slots,
                                 activation)
        core_attn_out[:decode_tokens] = _attend(
            layer, x, a[:decode_tokens], b[:decode_tokens],
            lambda q, k, v, g, beta: gated_delta_rule_decode(
                q, k, v, g, beta, ssm_state, slots, use_qk_l2norm=True))
    if prefills:
        end = decode_tokens + prefill_tokens
        slots = indices[decodes:decodes + prefills]
        cu = starts[decodes:decodes + prefills + 1] - decode_tokens
        has_initial = meta.has_initial_state[decodes:decodes + prefills]
        x = causal_conv1d(mixed_qkv[decode_tokens:end], weight, bias, conv_state, cu, slots,
                          has_initial, activation)
        # A sequence without an earlier state starts from zeros, not from what the
        # slot's last owner left.
        ssm_state[slots[~has_initial]] = 0
        core_attn_out[decode_tokens:end] = _attend(
            layer, x, a[decode_tokens:end], b[decode_tokens:end],
            lambda q, k, v, g, beta: gated_delta_rule(
                q, k, v, g, beta, ssm_state, cu, slots, use_qk_l2norm=True))
