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
