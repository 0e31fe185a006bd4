"""The references against vLLM's own native implementations (where vLLM is installed;
the nox e2e session runs this file, which needs vLLM)."""

import pytest
import torch
import vllm  # noqa: E402,F401  (this file runs where vLLM is installed)
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.activation import SiluAndMul  # noqa: E402
from vllm.model_executor.layers.layernorm import RMSNorm  # noqa: E402
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding  # noqa: E402

from ascend_kernels import add_rms_norm, rms_norm, rotary_embedding, silu_and_mul

from conftest import needs_triton


@pytest.fixture(autouse=True)
def vllm_config():
    # vLLM's layers read the current config when they are built.
    with set_current_vllm_config(VllmConfig()):
        yield


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (64, 32)])
def test_rotary_embedding_equals_vllm_forward_native(backend, neox, head_size, rotary_dim):
    torch.manual_seed(0)
    layer = RotaryEmbedding(head_size, rotary_dim, 64, 10000.0, neox, torch.float32)
    positions = torch.tensor([0, 9, 63, 4])
    query, key = torch.randn(4, 4 * head_size), torch.randn(4, 2 * head_size)
    want_q, want_k = layer.forward_native(positions, query.clone(), key.clone())
    got_q, got_k = rotary_embedding(positions, query, key, layer.cos_sin_cache, head_size,
                                    neox, backend=backend)
    torch.testing.assert_close(got_q, want_q.reshape(query.shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k.reshape(key.shape), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_norms_and_silu_equal_vllm_forward_native(backend):
    torch.manual_seed(1)
    x, residual = torch.randn(3, 96), torch.randn(3, 96)
    layer = RMSNorm(96, eps=1e-5)
    layer.weight.data.uniform_(0.5, 1.5)
    torch.testing.assert_close(rms_norm(x, layer.weight.data, 1e-5, backend=backend),
                               layer.forward_native(x.clone()), atol=1e-5, rtol=1e-5)
    want_out, want_residual = layer.forward_native(x.clone(), residual.clone())
    got_out, got_residual = add_rms_norm(x, residual, layer.weight.data, 1e-5, backend=backend)
    torch.testing.assert_close(got_out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_residual, want_residual)
    gate_up = torch.randn(3, 2 * 40)
    torch.testing.assert_close(silu_and_mul(gate_up, backend=backend),
                               SiluAndMul().forward_native(gate_up), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
@pytest.mark.parametrize(("section", "interleaved", "neox", "head_size", "rotary_dim"), [
    ([4, 6, 6], False, True, 32, 32),     # Qwen2-VL's layout, small
    ([8, 12, 12], False, False, 64, 64),  # gptj style
    ([6, 5, 5], True, True, 32, 32),      # Qwen3-VL's interleaved THWTHW..., H and W equal
    ([4, 3, 1], True, True, 32, 16),      # interleaved, W shorter than H, partial rotary
])
def test_mrope_equals_vllm_mrotary_embedding_forward_native(backend, section, interleaved,
                                                            neox, head_size, rotary_dim):
    from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

    from ascend_kernels import mrope

    torch.manual_seed(2)
    layer = MRotaryEmbedding(head_size, rotary_dim, 64, 10000.0, neox, torch.float32,
                             mrope_section=section, mrope_interleaved=interleaved)
    tokens = 7
    positions = torch.randint(0, 64 * 4, (3, tokens))
    query, key = torch.randn(tokens, 4 * head_size), torch.randn(tokens, 2 * head_size)
    want_q, want_k = layer.forward_native(positions, query.clone(), key.clone())
    got_q, got_k = mrope(positions, query, key, layer.cos_sin_cache, head_size, section,
                         neox, interleaved, backend=backend)
    torch.testing.assert_close(got_q, want_q.reshape(query.shape), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k.reshape(key.shape), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("l2norm", [True, False])
def test_gated_delta_rule_equals_vllms_cpu_kernel(l2norm):
    """vLLM's CPU gated delta-net op (what its Qwen3-Next prefill runs on the host; it takes
    bfloat16 q / k / v and beta, float32 g, heads of 128, and holds a state as [K, V] where
    ours is [V, K], vLLM's GPU layout) against ascend-kernels' reference: grouped value
    heads, three sequences, state slots in place."""
    from vllm import _custom_ops as ops

    from ascend_kernels import gated_delta_rule

    generator = torch.Generator().manual_seed(7)
    lengths, heads, value_heads, key_dim, value_dim = [5, 1, 3], 2, 4, 128, 128
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    # Unit-length keys without the norm too (else |k|^2 ~ 128 and the rule amplifies
    # bfloat16 rounding).
    q = (randn(tokens, heads, key_dim) / key_dim ** 0.5).bfloat16()
    k = (randn(tokens, heads, key_dim) / key_dim ** 0.5).bfloat16()
    v = randn(tokens, value_heads, value_dim).bfloat16()
    g = torch.nn.functional.logsigmoid(randn(tokens, value_heads))
    beta = torch.sigmoid(randn(tokens, value_heads)).bfloat16()
    state = randn(4, value_heads, value_dim, key_dim)
    cu = torch.tensor([0, 5, 6, 9], dtype=torch.int32)
    slots = torch.tensor([3, 0, 2], dtype=torch.int32)
    theirs_state = state.transpose(-1, -2).contiguous()
    theirs, _ = ops.chunk_gated_delta_rule_cpu(
        query=q[None], key=k[None], value=v[None], g=g[None], beta=beta[None],
        initial_state=theirs_state, output_final_state=True, cu_seqlens=cu,
        head_first=False, use_qk_l2norm_in_kernel=l2norm, initial_state_indices=slots)
    ours_state = state.clone()
    ours = gated_delta_rule(q, k, v, g, beta, ours_state, cu, slots, use_qk_l2norm=l2norm,
                            eps=1e-5, backend="reference")
    theirs = theirs.reshape(ours.shape).float()
    torch.testing.assert_close(ours.float(), theirs, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ours_state, theirs_state.transpose(-1, -2), atol=1e-2,
                               rtol=1e-2)
    assert torch.equal(ours_state[1], state[1])  # slot 1 is no sequence's: untouched
