"""The Mooncake transfer engine, behind the few calls the connector makes.

``mooncake-transfer-engine-non-cuda`` (host target, protocol ``tcp``) and
``mooncake-transfer-engine-npu`` (NPUs, protocol ``ascend``) provide the same
``mooncake.engine.TransferEngine``. Peers find each other without a metadata server
(``P2PHANDSHAKE``): a peer's session is ``host:rpc_port``. No vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

INSTALL_HINT = ("install the Mooncake transfer engine: pip install 'ascend-plugin[pd-host]' "
                "on the host target (mooncake-transfer-engine-non-cuda, needs the system "
                "library libibverbs.so.1, Debian package libibverbs1), "
                "'ascend-plugin[pd-npu]' on NPUs")


class TransferEngineError(RuntimeError):
    pass


class MooncakeEngine:
    def __init__(self, host: str, protocol: str, device_name: str = ""):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as err:
            raise TransferEngineError(
                f"MooncakeConnectorV1 cannot import mooncake.engine ({err}): "
                f"{INSTALL_HINT}") from err
        self._engine = TransferEngine()
        status = self._engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if status != 0:
            raise TransferEngineError(
                f"the Mooncake transfer engine did not start on {host} with protocol "
                f"{protocol!r} (status {status}): check the host address and protocol "
                f"(tcp on the host target, ascend on NPUs)")
        self.session = f"{host}:{self._engine.get_rpc_port()}"

    def register(self, regions: Sequence[tuple[int, int]]) -> None:
        status = self._engine.batch_register_memory([a for a, _ in regions],
                                                    [n for _, n in regions])
        if status != 0:
            raise TransferEngineError(
                f"the Mooncake transfer engine could not register {len(regions)} KV cache "
                f"regions (status {status})")

    def read(self, session: str, local: Sequence[int], remote: Sequence[int],
             lengths: Sequence[int]) -> int:
        """Copy remote bytes into local memory; 0 on success, negative on failure."""
        return self._engine.batch_transfer_sync_read(session, list(local), list(remote),
                                                     list(lengths))

    def close(self, regions: Sequence[tuple[int, int]]) -> None:
        if regions:
            self._engine.batch_unregister_memory([a for a, _ in regions])
