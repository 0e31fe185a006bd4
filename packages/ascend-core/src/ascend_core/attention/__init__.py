"""Attention backends of the npu target, written against torch_npu's documented ops."""

from __future__ import annotations

ASCEND_ATTN_NAME = "ASCEND_ATTN"
ASCEND_ATTN_BACKEND = "ascend_core.attention.npu_attention.AscendAttentionBackend"
ASCEND_MLA_NAME = "ASCEND_MLA"
ASCEND_MLA_BACKEND = "ascend_core.attention.npu_mla.AscendMLABackend"
ASCEND_MLA_PREFILL_BACKEND = "ascend_core.attention.npu_mla.NPUMLAPrefillBackend"


def register_attention_backends() -> None:
    """Make ``ASCEND_ATTN`` and ``ASCEND_MLA`` members of vLLM's ``AttentionBackendEnum``
    (idempotent): vLLM's attention layer looks its backend up by ``get_name()`` there."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if ASCEND_ATTN_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(ASCEND_ATTN_NAME, ASCEND_ATTN_BACKEND)
    if ASCEND_MLA_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(ASCEND_MLA_NAME, ASCEND_MLA_BACKEND)


def configuration_problems(backend, config) -> list[str]:
    """Why vLLM's ``validate_configuration`` says ``backend`` cannot run the attention that
    ``config`` (vLLM's attention selector config) describes; empty when it can."""
    return backend.validate_configuration(
        head_size=config.head_size,
        dtype=config.dtype,
        kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size,
        use_mla=config.use_mla,
        has_sink=config.has_sink,
        use_sparse=config.use_sparse,
        use_mm_prefix=config.use_mm_prefix,
        use_per_head_quant_scales=config.use_per_head_quant_scales,
        device_capability=None,
        attn_type=config.attn_type,
        has_sliding_window=config.has_sliding_window,
        use_non_causal=config.use_non_causal,
        use_batch_invariant=config.use_batch_invariant,
        use_kv_connector=config.use_kv_connector,
        use_pcp=config.use_pcp,
        use_adaptive_verification=config.use_adaptive_verification,
        use_dcp=config.use_dcp,
        use_rswa=config.use_rswa,
    )
