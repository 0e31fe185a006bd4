"""The torch_npu backends, run on the reference torch_npu (testing/reference_torch_npu).

The reference raises on arguments, dtypes and shapes torch_npu's documentation rules out,
so a call that passes here also keeps the documented argument contract; results are
compared with the ops' torch references.
"""

import pytest
import torch

import ascend_kernels
from ascend_kernels import BackendUnavailable
from ascend_kernels.rope import rotary_embedding_reference

from conftest import DTYPES, assert_close, assert_int8_close

HALF_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_npu_equals_reference(reference_torch_npu, dtype):
    torch.manual_seed(0)
    x = torch.randn(7, 256, dtype=dtype)
    w = torch.rand(256, dtype=dtype) + 0.5
    npu = ascend_kernels.rms_norm(x, w, 1e-6, backend="npu")
    ref = ascend_kernels.rms_norm(x, w, 1e-6, backend="reference")
    assert_close(npu, ref, dtype)


def test_rms_norm_npu_takes_a_float32_weight_with_half_input(reference_torch_npu):
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    w = torch.rand(64) + 0.5
    assert_close(ascend_kernels.rms_norm(x, w, backend="npu"),
                 ascend_kernels.rms_norm(x, w, backend="reference"), torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_npu_equals_reference(reference_torch_npu, dtype):
    x = torch.randn(5, 2 * 64, dtype=dtype)
    npu = ascend_kernels.silu_and_mul(x, backend="npu")
    ref = ascend_kernels.silu_and_mul(x, backend="reference")
    assert npu.shape == (5, 64)
    assert_close(npu, ref, dtype, scale=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 96), (2, 3, 40), (1, 8)])
def test_add_rms_norm_npu_equals_reference(reference_torch_npu, dtype, shape):
    torch.manual_seed(1)
    x, residual = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    w = torch.rand(shape[-1]) + 0.5  # float32 weight: cast to x's dtype as the op needs
    out, new_residual = ascend_kernels.add_rms_norm(x, residual, w, 1e-5, backend="npu")
    ref_out, ref_residual = ascend_kernels.add_rms_norm(x, residual, w, 1e-5,
                                                        backend="reference")
    assert_close(out, ref_out, dtype, scale=2)
    assert_close(new_residual, ref_residual, dtype)


def test_empty_inputs_never_reach_torch_npu(reference_torch_npu):
    x = torch.randn(0, 16, dtype=torch.bfloat16)
    w = torch.ones(16, dtype=torch.bfloat16)
    assert ascend_kernels.rms_norm(x, w, backend="npu").shape == (0, 16)
    assert ascend_kernels.add_rms_norm(x, x, w, backend="npu")[0].shape == (0, 16)
    q, s = ascend_kernels.dynamic_per_token_quant(x, backend="npu")
    assert q.shape == (0, 16) and s.shape == (0,)


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("shape", [(6, 128), (2, 3, 50)])
def test_dynamic_per_token_quant_npu_equals_reference(reference_torch_npu, dtype, shape):
    torch.manual_seed(2)
    x = torch.randn(shape, dtype=dtype) * 4
    q, scales = ascend_kernels.dynamic_per_token_quant(x, backend="npu")
    ref_q, ref_scales = ascend_kernels.dynamic_per_token_quant(x, backend="reference")
    assert scales.shape == shape[:-1] and scales.dtype == torch.float32
    torch.testing.assert_close(scales, ref_scales)
    assert_int8_close(q, ref_q)


def test_npu_dynamic_quant_refuses_float32_and_auto_never_picks_it(reference_torch_npu):
    x = torch.randn(2, 8)
    with pytest.raises(BackendUnavailable, match="npu_dynamic_quant takes float16 or bfloat16"):
        ascend_kernels.dynamic_per_token_quant(x, backend="npu")
    from ascend_kernels.npu_ops.quant import half_precision_problem

    assert ascend_kernels.resolve_backend(
        "dynamic_per_token_quant", x, ("reference", "npu"), None,
        {"npu": half_precision_problem("npu_dynamic_quant", x)}) == "reference"


@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("static", [False, True])
def test_add_rms_norm_quant_npu_equals_reference(reference_torch_npu, dtype, static):
    torch.manual_seed(3)
    x, residual = torch.randn(5, 96, dtype=dtype), torch.randn(5, 96, dtype=dtype)
    w = torch.rand(96, dtype=dtype) + 0.5
    # A power of two survives the bfloat16 rounding torch_npu needs for the scale.
    kwargs = {"scale": 0.03125, "offset": 2} if static else {}
    q, scales, new_residual = ascend_kernels.add_rms_norm_quant(
        x, residual, w, 1e-6, backend="npu", **kwargs)
    ref_q, ref_scales, ref_residual = ascend_kernels.add_rms_norm_quant(
        x, residual, w, 1e-6, backend="reference", **kwargs)
    assert_int8_close(q, ref_q)
    torch.testing.assert_close(scales, ref_scales)
    assert_close(new_residual, ref_residual, dtype)


@pytest.mark.parametrize("out_dtype", HALF_DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_scaled_int8_mm_npu_equals_reference(reference_torch_npu, out_dtype, with_bias):
    torch.manual_seed(4)
    a = torch.randint(-128, 128, (9, 40), dtype=torch.int8)
    b = torch.randint(-128, 128, (40, 24), dtype=torch.int8)
    scale_a, scale_b = torch.rand(9, 1) / 100, torch.rand(24) / 100
    bias = torch.randn(24, dtype=out_dtype) if with_bias else None
    out = ascend_kernels.scaled_int8_mm(a, b, scale_a, scale_b, out_dtype, bias, backend="npu")
    ref = ascend_kernels.scaled_int8_mm(a, b, scale_a, scale_b, out_dtype, bias,
                                        backend="reference")
    assert_close(out, ref, out_dtype)


def test_scaled_int8_mm_npu_refuses_float32_output(reference_torch_npu):
    a = torch.ones(2, 4, dtype=torch.int8)
    with pytest.raises(BackendUnavailable, match="float16 or bfloat16"):
        ascend_kernels.scaled_int8_mm(a, a.t(), torch.ones(1), torch.ones(1), torch.float32,
                                      backend="npu")


def _spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


ROPE_CASES = [
    # (head_size, rotary_dim, neox, torch_npu function expected)
    (128, 128, True, "npu_apply_rotary_pos_emb"),
    (64, 64, True, "npu_apply_rotary_pos_emb"),
    (128, 64, True, "npu_rotary_mul"),
    (64, 64, False, "npu_rotary_mul"),
    (80, 40, False, "npu_rotary_mul"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size, rotary_dim, neox, function", ROPE_CASES)
def test_rotary_embedding_npu_equals_reference(reference_torch_npu, monkeypatch, dtype,
                                               head_size, rotary_dim, neox, function):
    torch.manual_seed(5)
    tokens, heads_q, heads_k = 3, 4, 2
    positions = torch.tensor([0, 7, 3])
    cache = torch.randn(8, rotary_dim)
    query = torch.randn(tokens, heads_q * head_size, dtype=dtype)
    key = torch.randn(tokens, heads_k * head_size, dtype=dtype)
    calls = _spy(monkeypatch, reference_torch_npu, function)
    q, k = ascend_kernels.rotary_embedding(positions, query, key, cache, head_size, neox,
                                           backend="npu")
    ref_q, ref_k = rotary_embedding_reference(positions, query, key, cache, head_size, neox)
    assert calls, f"{function} was not called"
    expected_mode = "half" if neox else "interleave"
    assert all(call["rotary_mode"] == expected_mode for call in calls)
    assert_close(q, ref_q, dtype, scale=2)
    assert_close(k, ref_k, dtype, scale=2)


@pytest.mark.parametrize("key_present", [True, False])
def test_rotary_embedding_npu_in_place(reference_torch_npu, key_present):
    positions = torch.tensor([2, 0])
    cache = torch.randn(4, 128)
    query = torch.randn(2, 2 * 128)
    key = torch.randn(2, 128) if key_present else None
    expected_q, expected_k = rotary_embedding_reference(positions, query, key, cache, 128)
    q, k = ascend_kernels.rotary_embedding(positions, query, key, cache, 128, inplace=True,
                                           backend="npu")
    assert q is query and k is key
    torch.testing.assert_close(query, expected_q)
    if key_present:
        torch.testing.assert_close(key, expected_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_size", "rotary_dim", "neox"), [(128, 128, True),
                                                                (128, 128, False),
                                                                (160, 128, True)])
def test_mrope_npu_takes_npu_mrope_and_equals_reference(reference_torch_npu, monkeypatch,
                                                        dtype, head_size, rotary_dim, neox):
    torch.manual_seed(6)
    tokens, section = 5, (16, 24, 24)
    positions = torch.randint(0, 16, (3, tokens))
    cache = torch.randn(16, rotary_dim)
    query = torch.randn(tokens, 4 * head_size, dtype=dtype)
    key = torch.randn(tokens, 2 * head_size, dtype=dtype)
    calls = _spy(monkeypatch, reference_torch_npu, "npu_mrope")
    q, k = ascend_kernels.mrope(positions, query, key, cache, head_size, section, neox,
                                backend="npu")
    ref_q, ref_k = ascend_kernels.mrope(positions, query, key, cache.to(dtype), head_size,
                                        section, neox, backend="reference")
    assert [call["mrope_section"] for call in calls] == [[16, 24, 24]]
    assert calls[0]["rotary_mode"] == ("half" if neox else "interleave")
    assert_close(q, ref_q, dtype, scale=2)
    assert_close(k, ref_k, dtype, scale=2)


@pytest.mark.parametrize(("section", "interleaved", "head_size", "why"), [
    ((8, 12, 12), False, 64, r"takes mrope_section \[\[16, 24, 24\]\]"),
    ((16, 24, 24), True, 128, "no interleaved sections"),
])
def test_mrope_npu_refuses_what_npu_mrope_does_not_take(reference_torch_npu, section,
                                                        interleaved, head_size, why):
    rotary_dim = 2 * sum(section)
    positions = torch.zeros(3, 2, dtype=torch.long)
    query, key = torch.randn(2, head_size), torch.randn(2, head_size)
    with pytest.raises(ascend_kernels.BackendUnavailable, match=why):
        ascend_kernels.mrope(positions, query, key, torch.randn(4, rotary_dim), head_size,
                             section, True, interleaved, backend="npu")


def _gdn_decode_inputs(state_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = randn(3, 2, 64).bfloat16(), randn(3, 2, 64).bfloat16()
    v = randn(3, 4, 32).bfloat16()
    g = torch.nn.functional.logsigmoid(randn(3, 4))
    beta = torch.sigmoid(randn(3, 4)).bfloat16()
    state = (randn(6, 4, 32, 64) * 0.1).to(state_dtype)
    return q, k, v, g, beta, state, torch.tensor([5, 1, 3])


def test_gdn_decode_npu_takes_npu_recurrent_gated_delta_rule(reference_torch_npu,
                                                              monkeypatch):
    calls = _spy(monkeypatch, reference_torch_npu, "npu_recurrent_gated_delta_rule")
    q, k, v, g, beta, state, slots = _gdn_decode_inputs(torch.bfloat16)
    ref_state = state.clone()
    out = ascend_kernels.gated_delta_rule_decode(q, k, v, g, beta, state, slots,
                                                 use_qk_l2norm=True, backend="npu")
    ref = ascend_kernels.gated_delta_rule_decode(q, k, v, g, beta, ref_state, slots,
                                                 use_qk_l2norm=True, backend="reference")
    assert len(calls) == 1
    assert_close(out, ref, torch.bfloat16, scale=2)
    torch.testing.assert_close(state.float(), ref_state.float(), atol=2e-2, rtol=2e-2)


def test_gdn_decode_npu_refuses_a_float32_state(reference_torch_npu):
    q, k, v, g, beta, state, slots = _gdn_decode_inputs(torch.float32)
    with pytest.raises(BackendUnavailable, match="keeps a bfloat16 state"):
        ascend_kernels.gated_delta_rule_decode(q, k, v, g, beta, state, slots, backend="npu")


def test_gdn_sequences_npu_take_npu_chunk_gated_delta_rule(reference_torch_npu, monkeypatch):
    calls = _spy(monkeypatch, reference_torch_npu, "npu_chunk_gated_delta_rule")
    gen = torch.Generator().manual_seed(3)
    q, k = (torch.randn(9, 2, 128, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(9, 4, 128, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(9, 4, generator=gen))
    beta = torch.sigmoid(torch.randn(9, 4, generator=gen)).bfloat16()
    state = (torch.randn(5, 4, 128, 128, generator=gen) * 0.1).bfloat16()
    cu, slots = torch.tensor([0, 6, 7, 9]), torch.tensor([4, 0, 2])
    ref_state = state.clone()
    out = ascend_kernels.gated_delta_rule(q, k, v, g, beta, state, cu, slots,
                                          use_qk_l2norm=True, backend="npu")
    ref = ascend_kernels.gated_delta_rule(q, k, v, g, beta, ref_state, cu, slots,
                                          use_qk_l2norm=True, backend="reference")
    assert len(calls) == 1 and calls[0]["actual_seq_lengths"].tolist() == [6, 1, 2]
    assert_close(out, ref, torch.bfloat16, scale=2)
    torch.testing.assert_close(state.float(), ref_state.float(), atol=2e-2, rtol=2e-2)
    # A head size the op does not take goes elsewhere, and is refused when forced.
    with pytest.raises(BackendUnavailable, match="head sizes of 128 only"):
        ascend_kernels.gated_delta_rule(q[..., :64], k[..., :64], v, g, beta,
                                        state[..., :64], cu, slots, backend="npu")


def _gdn_verify_inputs(tokens, slots, seed):
    """bfloat16 q / k (2 heads of 64), v (4 heads of 32), g, beta and a state cache."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(tokens, 2, 64, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(tokens, 4, 32, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(tokens, 4, generator=gen))
    beta = torch.sigmoid(torch.randn(tokens, 4, generator=gen)).bfloat16()
    state = (torch.randn(slots, 4, 32, 64, generator=gen) * 0.1).bfloat16()
    return q, k, v, g, beta, state


def test_gdn_verify_npu_takes_npu_recurrent_gated_delta_rule(reference_torch_npu, monkeypatch):
    # Speculative verification: each token's state slot and where each sequence resumes
    # (num_accepted_tokens) go to the op as its per-token indices.
    calls = _spy(monkeypatch, reference_torch_npu, "npu_recurrent_gated_delta_rule")
    q, k, v, g, beta, state = _gdn_verify_inputs(5, 9, seed=4)
    cu, rows = torch.tensor([0, 3, 5]), torch.tensor([[5, 1, 6], [2, 7, 8]])
    accepted = torch.tensor([3, 1])
    ref_state = state.clone()
    out = ascend_kernels.gated_delta_rule_verify(q, k, v, g, beta, state, cu, rows, accepted,
                                                 use_qk_l2norm=True, backend="npu")
    ref = ascend_kernels.gated_delta_rule_verify(q, k, v, g, beta, ref_state, cu, rows,
                                                 accepted, use_qk_l2norm=True,
                                                 backend="reference")
    (call,) = calls
    assert call["ssm_state_indices"].tolist() == [5, 1, 6, 2, 7]
    assert call["num_accepted_tokens"].tolist() == [3, 1]
    assert_close(out, ref, torch.bfloat16, scale=2)
    torch.testing.assert_close(state.float(), ref_state.float(), atol=2e-2, rtol=2e-2)


def test_gdn_verify_npu_full_batch_passes_every_row_without_reading_lengths(
        reference_torch_npu, monkeypatch):
    # A captured graph's uniform batch: 2 sequences x 3 rows, the second a padding sequence
    # (zero length in cu_seqlens, vLLM's null slot 0 in every column): the op gets every row.
    calls = _spy(monkeypatch, reference_torch_npu, "npu_recurrent_gated_delta_rule")
    q, k, v, g, beta, state = _gdn_verify_inputs(6, 8, seed=6)
    cu, rows = torch.tensor([0, 3, 3]), torch.tensor([[3, 1, 4], [0, 0, 0]])
    accepted = torch.tensor([2, 1])
    ref_state = state.clone()
    out = ascend_kernels.gated_delta_rule_verify(q, k, v, g, beta, state, cu, rows, accepted,
                                                 use_qk_l2norm=True, backend="npu")
    ref = ascend_kernels.gated_delta_rule_verify(q[:3], k[:3], v[:3], g[:3], beta[:3],
                                                 ref_state, cu[:2], rows[:1], accepted[:1],
                                                 use_qk_l2norm=True, backend="reference")
    (call,) = calls
    assert call["actual_seq_lengths"].tolist() == [3, 3]
    assert_close(out[:3], ref, torch.bfloat16, scale=2)
    torch.testing.assert_close(state[1:].float(), ref_state[1:].float(), atol=2e-2, rtol=2e-2)
