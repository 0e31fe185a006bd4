"""Prefill/decode disaggregation: KV-cache transfer between vLLM instances.

The decode instance pulls a finished prompt's KV blocks from the prefill instance
with the Mooncake transfer engine, then tells the prefill instance to free them.
Algorithmic modules (``layout``, ``params``, ``leases``, ``side_channel``,
``transfer_engine``) import no vLLM; ``vllm_mooncake_connector`` is the vLLM-facing
glue (``KVConnectorBase_V1``) and ``vllm_registration`` names it to vLLM's
connector factory.
"""
