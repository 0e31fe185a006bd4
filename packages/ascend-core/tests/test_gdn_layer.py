"""The npu gated delta-net core (``ascend_core.ops.gdn.gdn_core``) against vLLM's CPU core
(``_cpu_gdn_attention_nonspec``: its torch conv and its CPU delta-rule kernels) on the same
layer weights, state caches and GDN metadata: a batch of decodes and prefills (some with an
earlier state), bfloat16 as vLLM's CPU path takes, then a decode step on the states each
left. vLLM's CPU conv uses packed weights on AVX-512-BF16 machines; the test takes its torch
conv (same values)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from ascend_core.ops.gdn import AscendQwenGatedDeltaNetAttention, gdn_core

KEY_HEADS, VALUE_HEADS, HEAD_DIM, WIDTH, SLOTS = 2, 4, 128, 4, 8
CONV_DIM = 2 * KEY_HEADS * HEAD_DIM + VALUE_HEADS * HEAD_DIM


def _layer(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)

    layer = SimpleNamespace(
        conv1d=SimpleNamespace(weight=randn(CONV_DIM, 1, WIDTH, scale=0.5),
                               bias=None),
        activation="silu",
        A_log=torch.randn(VALUE_HEADS, generator=gen),
        dt_bias=randn(VALUE_HEADS),
        key_dim=KEY_HEADS * HEAD_DIM, value_dim=VALUE_HEADS * HEAD_DIM, tp_size=1,
        head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
        # vLLM's SD layout: conv state [slots, W - 1, dim]; recurrent [slots, HV, V, K].
        kv_cache=(randn(SLOTS, WIDTH - 1, CONV_DIM),
                  randn(SLOTS, VALUE_HEADS, HEAD_DIM, HEAD_DIM, scale=0.1)),
    )
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    layer.rearrange_mixed_qkv = (
        lambda x: QwenGatedDeltaNetAttention.rearrange_mixed_qkv(layer, x))
    return layer


def _metadata(decode_slots, prefill_lens, prefill_slots, has_initial):
    decodes, prefills = len(decode_slots), len(prefill_lens)
    lens = [1] * decodes + prefill_lens
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return GDNAttentionMetadata(
        num_prefills=prefills, num_prefill_tokens=sum(prefill_lens), num_decodes=decodes,
        num_decode_tokens=decodes, num_spec_decodes=0, num_spec_decode_tokens=0,
        num_actual_tokens=sum(lens),
        has_initial_state=torch.tensor([True] * decodes + has_initial),
        non_spec_query_start_loc=starts,
        non_spec_state_indices_tensor=torch.tensor(decode_slots + prefill_slots,
                                                   dtype=torch.int32))


def _inputs(tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    mixed = torch.randn(tokens, CONV_DIM, generator=gen).to(torch.bfloat16)
    b = torch.randn(tokens, VALUE_HEADS, generator=gen).to(torch.bfloat16)
    a = torch.randn(tokens, VALUE_HEADS, generator=gen).to(torch.bfloat16)
    return mixed, b, a


def _vllm_cpu_core(layer, meta, mixed, b, a, monkeypatch):
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(gdn_attention, "is_arm_bf16", lambda: False)
    out = torch.zeros(mixed.shape[0], VALUE_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    gdn_attention._cpu_gdn_attention_nonspec(layer, meta, mixed, b, a, out)
    return out


def _as_vllm_cpu_holds_it(state: torch.Tensor) -> torch.Tensor:
    """vLLM's CPU kernels read the recurrent state cache [slots, HV, V, K] as [.., K, V]
    (a view, K = V): the same states in their memory order."""
    return state.transpose(-1, -2).contiguous()


def test_npu_core_equals_vllms_cpu_core(monkeypatch):
    pytest.importorskip("vllm._C", reason="vLLM's CPU kernels")
    ours, theirs = _layer(), _layer()
    theirs.kv_cache = (theirs.kv_cache[0], _as_vllm_cpu_holds_it(ours.kv_cache[1]))
    steps = [
        # decodes of slots 3 and 6, then prefills: 5 tokens fresh, 9 on an earlier state,
        # 2 fresh (slot 0 is vLLM's null block, which no request gets)
        _metadata([3, 6], [5, 9, 2], [1, 4, 7], [False, True, False]),
        # a decode of every sequence the step before touched
        _metadata([3, 6, 1, 4, 7], [], [], []),
    ]
    for seed, meta in enumerate(steps):
        mixed, b, a = _inputs(meta.num_actual_tokens, seed)
        want = _vllm_cpu_core(theirs, meta, mixed, b, a, monkeypatch)
        got = torch.zeros_like(want)
        gdn_core(ours, meta, mixed, b, a, got)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-2)
        torch.testing.assert_close(ours.kv_cache[0], theirs.kv_cache[0], atol=0, rtol=0)
        torch.testing.assert_close(_as_vllm_cpu_holds_it(ours.kv_cache[1]).float(),
                                   theirs.kv_cache[1].float(), atol=2e-2, rtol=2e-2)


def test_speculation_is_refused_when_the_model_is_built():
    from ascend_core.ops.gdn import refuse_speculation

    refuse_speculation(None)
    refuse_speculation(SimpleNamespace(method="mtp", num_speculative_tokens=0))
    with pytest.raises(NotImplementedError,
                       match="method='mtp': gated delta-net layers .* do not verify"):
        refuse_speculation(SimpleNamespace(method="mtp", num_speculative_tokens=2))
    meta = _metadata([1], [], [], [])
    meta.spec_sequence_masks = torch.tensor([True])
    with pytest.raises(NotImplementedError, match="speculative batch"):
        gdn_core(_layer(), meta, *_inputs(1, 0), torch.zeros(1, VALUE_HEADS, HEAD_DIM))


def test_the_layer_replaces_vllms_by_name():
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from ascend_core.ops.gdn import REPLACES

    assert REPLACES == QwenGatedDeltaNetAttention.__name__
    assert issubclass(AscendQwenGatedDeltaNetAttention, QwenGatedDeltaNetAttention)
