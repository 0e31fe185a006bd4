"""Names the plugin's KV connectors to vLLM's connector factory (idempotent)."""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

CONNECTORS = {
    "MooncakeConnectorV1": ("ascend_core.distributed.kv_transfer.vllm_mooncake_connector",
                            "MooncakeConnectorV1"),
}


def register_kv_connectors() -> None:
    for name, (module, cls) in CONNECTORS.items():
        # vLLM loads plugins in several processes, some twice; the factory refuses repeats.
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, cls)
