"""The npu gated delta-net core (``ascend_core.ops.gdn.gdn_core``) against vLLM's CPU core
(``_cpu_gdn_attention_nonspec``: its torch conv and its CPU delta-rule kernels) on the same
layer weights, state caches and GDN metadata: a batch of decodes and prefills (some with an
earlier state), bfloat16 as vLLM's CPU path takes, then a decode step on the states each
left; and under speculative decoding, verification steps against vLLM's CPU spec path. vLLM's CPU conv uses packed weights on AVX-512-BF16 machines; the test takes its torch
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


def _assert_as_vllm(got, want, ours, theirs) -> None:
    """Outputs to bfloat16 rounding, conv states exactly, recurrent states to rounding."""
    torch.testing.assert_close(got.float(), want.float(), atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(ours.kv_cache[0], theirs.kv_cache[0], atol=0, rtol=0)
    torch.testing.assert_close(_as_vllm_cpu_holds_it(ours.kv_cache[1]).float(),
                               theirs.kv_cache[1].float(), atol=2e-2, rtol=2e-2)


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
        _assert_as_vllm(got, want, ours, theirs)


DRAFTS = 2


def _spec_metadata(rows, lens, accepted, prefill_lens=(), prefill_slots=()):
    """Spec sequences (state ``rows``, ``lens`` tokens, ``accepted`` last step) first, then
    fresh prefills; both index sets, as vLLM's builder makes them."""
    spec, plain = len(rows), len(prefill_lens)
    spec_tokens, plain_tokens = sum(lens), sum(prefill_lens)

    def starts(lengths):
        return torch.tensor([0, *torch.tensor(list(lengths) or [0]).cumsum(0).tolist()][
            :len(lengths) + 1], dtype=torch.int32)

    plain_starts = starts(prefill_lens) if plain else None
    slots = torch.tensor(list(prefill_slots), dtype=torch.int32) if plain else None
    fresh = torch.zeros(plain, dtype=torch.bool) if plain else None
    return GDNAttentionMetadata(
        num_prefills=plain, num_prefill_tokens=plain_tokens, num_decodes=0,
        num_decode_tokens=0, num_spec_decodes=spec, num_spec_decode_tokens=spec_tokens,
        num_actual_tokens=spec_tokens + plain_tokens,
        has_initial_state=fresh, spec_query_start_loc=starts(lens),
        non_spec_query_start_loc=plain_starts,
        spec_state_indices_tensor=torch.tensor(rows, dtype=torch.int32),
        non_spec_state_indices_tensor=slots,
        spec_sequence_masks=torch.tensor([True] * spec + [False] * plain),
        # (an argsort's indices in a mixed batch, as vLLM's builder makes them)
        spec_token_indx=torch.arange(spec_tokens),
        non_spec_token_indx=torch.arange(spec_tokens, spec_tokens + plain_tokens),
        num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
        prefill_query_start_loc=plain_starts, prefill_state_indices=slots,
        prefill_has_initial_state=fresh)


def test_npu_core_verifies_drafts_as_vllms_cpu_core(monkeypatch):
    """Speculative decoding (2 drafts): conv states widened to W - 1 + 2 columns, three
    recurrent slots per request. Prompts prefill, two verification steps follow (the second
    after 2 and 3 accepted tokens, beside a fresh prompt), against vLLM's CPU spec path (its
    torch rolling-buffer conv and its CPU spec delta-rule kernel)."""
    pytest.importorskip("vllm._C", reason="vLLM's CPU kernels")
    from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(gdn_attention, "is_arm_bf16", lambda: False)
    ours, theirs = _layer(), _layer()
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(SLOTS + 2, WIDTH - 1 + DRAFTS, CONV_DIM, generator=gen).bfloat16()
    recurrent = (torch.randn(SLOTS + 2, VALUE_HEADS, HEAD_DIM, HEAD_DIM, generator=gen)
                 * 0.1).bfloat16()
    ours.kv_cache = (wide.clone(), recurrent.clone())
    theirs.kv_cache = (wide.clone(), _as_vllm_cpu_holds_it(recurrent))
    rows = [[1, 2, 3], [4, 5, 6]]
    steps = [
        _metadata([], [5, 7], [1, 4], [False, False]),
        _spec_metadata(rows, [3, 3], [1, 1]),
        _spec_metadata(rows, [3, 3], [2, 3], prefill_lens=[4], prefill_slots=[9]),
    ]
    for seed, meta in enumerate(steps):
        mixed, b, a = _inputs(meta.num_actual_tokens, seed)
        want = torch.zeros(mixed.shape[0], VALUE_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        gdn_attention._cpu_gdn_attention_spec_aware(theirs, meta, mixed, b, a, want, WIDTH,
                                                    WIDTH - 1 + DRAFTS)
        got = torch.zeros_like(want)
        gdn_core(ours, meta, mixed, b, a, got)
        _assert_as_vllm(got, want, ours, theirs)


def test_the_layer_replaces_vllms_by_name():
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import (
        QwenGatedDeltaNetAttention,
    )

    from ascend_core.ops.gdn import REPLACES

    assert REPLACES == QwenGatedDeltaNetAttention.__name__
    assert issubclass(AscendQwenGatedDeltaNetAttention, QwenGatedDeltaNetAttention)
