"""Attention backends of the npu target, written against torch_npu's documented ops."""

from __future__ import annotations

ASCEND_ATTN_NAME = "ASCEND_ATTN"
ASCEND_ATTN_BACKEND = "ascend_core.attention.npu_attention.AscendAttentionBackend"


def register_attention_backends() -> None:
    """Make ``ASCEND_ATTN`` a member of vLLM's ``AttentionBackendEnum`` (idempotent):
    vLLM's attention layer looks its backend up by ``get_name()`` in that enum."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if ASCEND_ATTN_NAME not in AttentionBackendEnum.__members__:
        AttentionBackendEnum.register(ASCEND_ATTN_NAME, ASCEND_ATTN_BACKEND)
