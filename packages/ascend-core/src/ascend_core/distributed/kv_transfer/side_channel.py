"""The side channel between decode and prefill workers: JSON messages over zmq.

Each prefill worker answers on ``tcp://host:(kv_port + tp_rank)`` from a thread; a
decode worker sends one request per socket (so a timed-out request leaves no socket
in a bad state) and gets one reply. No vLLM.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

import zmq

logger = logging.getLogger(__name__)


class SideChannelError(RuntimeError):
    """The peer did not answer, or answered something unreadable."""


class SideChannelServer:
    def __init__(self, host: str, port: int, handler: Callable[[dict], dict]):
        self.address = f"tcp://{host}:{port}"
        self._handler = handler
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(self.address)
        except zmq.ZMQError as err:
            self._socket.close()
            self._context.term()
            raise SideChannelError(
                f"cannot listen on {self.address} for the KV side channel ({err}): pick a "
                f"free kv_port (each rank uses kv_port + its tensor-parallel rank)") from err
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel",
                                        daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            raw = self._socket.recv()
            try:
                reply = self._handler(json.loads(raw))
            except Exception as err:  # a bad message must not stop the channel
                logger.exception("KV side channel: cannot handle %r", raw[:200])
                reply = {"status": "refused", "message": f"bad side-channel message: {err}"}
            self._socket.send(json.dumps(reply).encode())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._socket.close()
        self._context.term()


def ask(host: str, port: int, message: dict, timeout_s: float,
        context: zmq.Context | None = None) -> dict:
    """Send one message and wait at most ``timeout_s`` for the reply."""
    context = context or zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    address = f"tcp://{host}:{port}"
    try:
        sock.connect(address)
        sock.send(json.dumps(message).encode())
        raw = sock.recv()
    except zmq.Again as err:
        raise SideChannelError(
            f"no answer from the prefill node's side channel at {address} within "
            f"{timeout_s:.3g} s: is a MooncakeConnectorV1 kv_producer up with that kv_port?"
        ) from err
    except zmq.ZMQError as err:
        raise SideChannelError(f"side channel to {address} failed: {err}") from err
    finally:
        sock.close()
    try:
        reply = json.loads(raw)
    except ValueError as err:
        raise SideChannelError(f"unreadable reply from {address}: {raw[:100]!r}") from err
    if not isinstance(reply, dict):
        raise SideChannelError(f"unreadable reply from {address}: {reply!r}")
    return reply
