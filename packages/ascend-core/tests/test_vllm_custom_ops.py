"""The custom-op replacements: vLLM instantiates them, and they compute what vLLM's do."""

import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

from ascend_core.ops import vllm_custom_ops
from ascend_core.ops.moe import AscendUnquantizedFusedMoEMethod
from ascend_core.ops.vllm_custom_ops import (
    AscendMRotaryEmbedding,
    AscendRMSNorm,
    AscendRotaryEmbedding,
    AscendSiluAndMul,
    register_with_vllm,
)
from ascend_core.registry import CUSTOM_OPS


@pytest.fixture
def vllm_context():
    saved = dict(op_registry_oot)
    with set_current_vllm_config(VllmConfig()):
        yield
    op_registry_oot.clear()
    op_registry_oot.update(saved)


def test_registration_makes_vllm_build_our_layers(vllm_context):
    assert register_with_vllm() == ["MRotaryEmbedding", "QwenGatedDeltaNetAttention", "RMSNorm",
                                    "RotaryEmbedding", "SiluAndMul",
                                    "UnquantizedFusedMoEMethod"]
    assert register_with_vllm() == []  # once per process, however often plugins load
    assert type(RMSNorm(64)) is AscendRMSNorm
    assert type(SiluAndMul()) is AscendSiluAndMul
    assert type(RotaryEmbedding(64, 64, 128, 10000.0, True, torch.float32)) is (
        AscendRotaryEmbedding)
    assert CUSTOM_OPS.get("RMSNorm") is AscendRMSNorm
    assert op_registry_oot["UnquantizedFusedMoEMethod"] is AscendUnquantizedFusedMoEMethod
    # A pluggable layer, replaced by class name through the same registry.
    from ascend_core.ops.gdn import AscendQwenGatedDeltaNetAttention

    assert op_registry_oot["QwenGatedDeltaNetAttention"] is AscendQwenGatedDeltaNetAttention


def test_another_plugins_replacement_is_not_overwritten(vllm_context):
    class Other(RMSNorm):
        pass

    op_registry_oot["RMSNorm"] = Other
    with pytest.raises(RuntimeError, match="already replaced by .*Other"):
        register_with_vllm()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_vllms(vllm_context, dtype):
    torch.manual_seed(0)
    ours = AscendRMSNorm(96, eps=1e-5).to(dtype)
    ours.weight.data = torch.rand(96, dtype=dtype) + 0.5
    x = torch.randn(5, 96, dtype=dtype)
    residual = torch.randn(5, 96, dtype=dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(ours.forward_oot(x), ours.forward_native(x), **tol)
    out, new_residual = ours.forward_oot(x.clone(), residual.clone())
    ref_out, ref_residual = ours.forward_native(x.clone(), residual.clone())
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(new_residual, ref_residual, **tol)


def test_silu_and_mul_equals_vllms(vllm_context):
    layer = AscendSiluAndMul()
    x = torch.randn(3, 2 * 40)
    torch.testing.assert_close(layer.forward_oot(x), layer.forward_native(x))


def test_user_disabled_op_stays_disabled():
    config = VllmConfig().compilation_config
    config.custom_ops = ["-RMSNorm"]
    vllm_custom_ops.register()
    vllm_custom_ops.enable_in_compilation_config(config)
    assert "+RMSNorm" not in config.custom_ops and "+SiluAndMul" in config.custom_ops


@pytest.mark.parametrize("is_neox_style, rotary_dim", [(True, 64), (False, 64), (True, 32)])
def test_rotary_embedding_equals_vllms(vllm_context, is_neox_style, rotary_dim):
    torch.manual_seed(0)
    rope = AscendRotaryEmbedding(64, rotary_dim, 256, 10000.0, is_neox_style, torch.float32)
    positions = torch.randint(0, 256, (7,))
    query, key = torch.randn(7, 4 * 64), torch.randn(7, 2 * 64)
    ref_q, ref_k = rope.forward_native(positions, query.clone(), key.clone())
    q, k = query.clone(), key.clone()
    out_q, out_k = rope.forward_oot(positions, q, k)  # ascend-kernels, as on npu
    torch.testing.assert_close(out_q, ref_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, ref_k, atol=1e-5, rtol=1e-5)
    assert out_q.data_ptr() == q.data_ptr()  # in place, like vLLM's device kernels


def test_the_host_target_keeps_vllms_cpu_implementations(vllm_context):
    """On the host (a CPU platform to vLLM) our classes run vLLM's CPU code, so the host
    stack is never slower than stock; the rotation (vLLM's C++ kernel) agrees with ours,
    in place."""
    assert AscendRMSNorm.forward_cpu is RMSNorm.forward_cpu
    assert AscendSiluAndMul.forward_cpu is SiluAndMul.forward_cpu
    rope = AscendRotaryEmbedding(64, 64, 256, 10000.0, True, torch.float32)
    positions = torch.randint(0, 256, (7,))
    query, key = torch.randn(7, 4 * 64), torch.randn(7, 2 * 64)
    ours_q, ours_k = rope.forward_oot(positions, query.clone(), key.clone())
    q, k = query.clone(), key.clone()
    out_q, out_k = rope.forward_cpu(positions, q, k)
    torch.testing.assert_close(out_q, ours_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, ours_k, atol=1e-5, rtol=1e-5)
    assert out_q.data_ptr() == q.data_ptr()


def test_rope_launch_size_comes_from_the_environment(vllm_context, monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_ROPE_UB_SIZE_KB", "96")
    rope = AscendRotaryEmbedding(64, 64, 128, 10000.0, True, torch.float32)
    assert rope.ub_size_kb == 96


@pytest.mark.parametrize("is_neox_style", [True, False])
def test_host_rotary_embedding_of_head_views_is_right(vllm_context, monkeypatch,
                                                       is_neox_style):
    """MLA rotates q_pe as a [tokens, heads, head_size] view of q: vLLM 0.32's C++ CPU kernel
    rotates one head per token there (checked below, so a fixed vLLM shows up), ours every
    head; 2-D inputs keep vLLM's kernel."""
    rope = AscendRotaryEmbedding(32, 32, 256, 10000.0, is_neox_style, torch.float32)
    positions = torch.randint(0, 256, (5,))
    q = torch.randn(5, 4, 96)  # 64 "nope" dims, then the 32 rotated ones, per head
    k_pe = torch.randn(5, 1, 32)
    expected_q, expected_k = rope.forward_native(positions, q[..., 64:].clone(), k_pe.clone())
    stock_q = q.clone()
    RotaryEmbedding.forward_cpu(rope, positions, stock_q[..., 64:], k_pe.clone())
    assert not torch.allclose(stock_q[..., 64:], expected_q, atol=1e-3)
    ours_q, ours_k = q.clone(), k_pe.clone()
    rope.forward_cpu(positions, ours_q[..., 64:], ours_k)
    torch.testing.assert_close(ours_q[..., 64:], expected_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_k, expected_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(ours_q[..., :64], q[..., :64])
    calls = []
    monkeypatch.setattr(RotaryEmbedding, "forward_cpu",
                        lambda self, *args: calls.append(len(args)) or args[1:])
    rope.forward_cpu(positions, torch.randn(5, 128), torch.randn(5, 32))
    assert calls == [3]


def _mrope(section=(16, 24, 24), interleaved=False, head_size=128, neox=True):
    register_with_vllm()
    rope = MRotaryEmbedding(head_size, 2 * sum(section), 256, 1000000.0, neox, torch.float32,
                            mrope_section=list(section), mrope_interleaved=interleaved)
    assert type(rope) is AscendMRotaryEmbedding
    return rope


@pytest.mark.parametrize(("section", "interleaved", "head_size", "neox"), [
    ((16, 24, 24), False, 128, True),   # Qwen2-VL / Qwen2.5-VL
    ((24, 20, 20), True, 128, True),    # Qwen3-VL
    ((4, 6, 6), False, 64, False),      # partial rotary, gptj
])
def test_mrotary_embedding_equals_vllms(vllm_context, section, interleaved, head_size, neox):
    torch.manual_seed(3)
    rope = _mrope(section, interleaved, head_size, neox)
    query, key = torch.randn(6, 4 * head_size), torch.randn(6, 2 * head_size)
    for positions in (torch.randint(0, 1024, (3, 6)), torch.randint(0, 1024, (6,))):
        ref_q, ref_k = rope.forward_native(positions, query.clone(), key.clone())
        q, k = query.clone(), key.clone()
        out_q, out_k = rope.forward_oot(positions, q, k)  # ascend-kernels, as on npu
        torch.testing.assert_close(out_q, ref_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out_k, ref_k, atol=1e-5, rtol=1e-5)
        assert out_q.data_ptr() == q.data_ptr()  # in place
    # The host keeps vLLM's code.
    assert AscendMRotaryEmbedding.forward_cpu is MRotaryEmbedding.forward_cpu


def test_mrotary_embedding_on_npu_takes_npu_mrope(vllm_context, monkeypatch):
    """On npu tensors (the reference torch_npu) Qwen2.5-VL's sections go through
    ``npu_mrope``, bfloat16, and equal vLLM's native rotation."""
    from npu_reference import reference_torch_npu

    with reference_torch_npu() as torch_npu:
        calls = []
        real = torch_npu.npu_mrope

        def spy(*args, **kwargs):
            calls.append(kwargs["mrope_section"])
            return real(*args, **kwargs)

        monkeypatch.setattr(torch_npu, "npu_mrope", spy)
        rope = _mrope()
        torch.manual_seed(4)
        positions = torch.randint(0, 1024, (3, 5))
        query = torch.randn(5, 2 * 128).bfloat16()
        key = torch.randn(5, 128).bfloat16()
        ref_q, ref_k = rope.forward_native(positions, query.clone(), key.clone())
        q, k = rope.forward_oot(positions.to("npu"), query.to("npu"), key.to("npu"))
        assert calls == [[16, 24, 24]] and q.device.type == "npu"
        torch.testing.assert_close(q.cpu().float(), ref_q.float(), atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(k.cpu().float(), ref_k.float(), atol=3e-2, rtol=3e-2)
