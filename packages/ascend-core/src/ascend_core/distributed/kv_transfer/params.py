"""The ``kv_transfer_params`` a prefill node returns and a decode node reads back,
and the connector's ``kv_connector_extra_config``.

A prefill node answers a request sent with ``{"do_remote_decode": true}`` with::

    {"do_remote_prefill": true, "do_remote_decode": false,
     "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ...,
     "remote_port": ..., "remote_block_ids": [...], "remote_tp_size": ...}

which a proxy passes on, unchanged, with the same prompt to a decode node. Nothing
here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ascend_core.suggest import did_you_mean

ROLES = ("kv_producer", "kv_consumer", "kv_both")
PROTOCOLS = ("tcp", "rdma", "ascend")
# A prefill node frees blocks that no decode node pulled after this long (NIXL's
# VLLM_NIXL_ABORT_REQUEST_TIMEOUT has the same default).
DEFAULT_LEASE_TIMEOUT_S = 480.0
DEFAULT_SIDE_CHANNEL_TIMEOUT_S = 10.0


class KVTransferParamsError(ValueError):
    """kv_transfer_params or kv_connector_extra_config that cannot be used."""


@dataclass(frozen=True)
class RemotePrefill:
    """What a decode node needs to pull one request's blocks."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: tuple[int, ...]
    tp_size: int


_REQUIRED = {"remote_engine_id": str, "remote_request_id": str, "remote_host": str,
             "remote_port": int, "remote_block_ids": list, "remote_tp_size": int}


def parse_remote_prefill(params: Mapping[str, Any], num_prompt_tokens: int,
                         block_size: int) -> RemotePrefill:
    """Check a decode request's kv_transfer_params; raise a one-line error naming the
    field, its value and what is expected."""
    for key, kind in _REQUIRED.items():
        if key not in params:
            raise KVTransferParamsError(
                f"kv_transfer_params has do_remote_prefill but no {key!r}: pass the "
                f"kv_transfer_params the prefill node returned, unchanged")
        value = params[key]
        if not isinstance(value, kind) or isinstance(value, bool):
            raise KVTransferParamsError(
                f"kv_transfer_params {key}={value!r} is not a {kind.__name__}")
    ids = params["remote_block_ids"]
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids):
        raise KVTransferParamsError(
            f"kv_transfer_params remote_block_ids={ids!r}: expected non-negative integers")
    expected = -(-num_prompt_tokens // block_size)
    if len(ids) != expected:
        raise KVTransferParamsError(
            f"kv_transfer_params remote_block_ids has {len(ids)} blocks, but this "
            f"{num_prompt_tokens}-token prompt fills {expected} blocks of {block_size} "
            f"tokens: the parameters belong to another prompt or another block size")
    if not 0 < params["remote_port"] < 65536:
        raise KVTransferParamsError(
            f"kv_transfer_params remote_port={params['remote_port']!r} is not a port")
    return RemotePrefill(engine_id=params["remote_engine_id"],
                         request_id=params["remote_request_id"], host=params["remote_host"],
                         port=params["remote_port"], block_ids=tuple(ids),
                         tp_size=params["remote_tp_size"])


def remote_prefill_params(*, engine_id: str, request_id: str, host: str, port: int,
                          block_ids: list[int], tp_size: int) -> dict[str, Any]:
    """The kv_transfer_params a prefill node returns with its one-token answer."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id, "remote_request_id": request_id,
            "remote_host": host, "remote_port": port, "remote_block_ids": list(block_ids),
            "remote_tp_size": tp_size}


@dataclass(frozen=True)
class ParallelSizes:
    dp_size: int = 1
    tp_size: int = 1


@dataclass(frozen=True)
class MooncakeConnectorOptions:
    """``kv_connector_extra_config`` of MooncakeConnectorV1."""

    prefill: ParallelSizes
    decode: ParallelSizes
    protocol: str
    lease_timeout_s: float
    side_channel_timeout_s: float
    device_name: str


_OPTION_KEYS = ("prefill", "decode", "protocol", "lease_timeout_s",
                "side_channel_timeout_s", "device_name")


def _sizes(extra: Mapping[str, Any], side: str) -> ParallelSizes:
    value = extra.get(side, {})
    if not isinstance(value, Mapping):
        raise KVTransferParamsError(
            f"kv_connector_extra_config {side}={value!r}: expected "
            f'{{"dp_size": N, "tp_size": N}}')
    for key in value:
        if key not in ("dp_size", "tp_size"):
            raise KVTransferParamsError(
                f"kv_connector_extra_config {side} has unknown key {key!r}: allowed are "
                f"dp_size, tp_size." + did_you_mean(key, ["dp_size", "tp_size"]))
    sizes = {}
    for key in ("dp_size", "tp_size"):
        number = value.get(key, 1)
        if not isinstance(number, int) or isinstance(number, bool) or number < 1:
            raise KVTransferParamsError(
                f"kv_connector_extra_config {side}.{key}={number!r}: expected an integer >= 1")
        sizes[key] = number
    return ParallelSizes(**sizes)


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    value = extra.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise KVTransferParamsError(
            f"kv_connector_extra_config {key}={value!r}: expected a number of seconds > 0")
    return float(value)


def parse_options(extra: Mapping[str, Any], default_protocol: str) -> MooncakeConnectorOptions:
    for key in extra:
        if key not in _OPTION_KEYS:
            raise KVTransferParamsError(
                f"kv_connector_extra_config has unknown key {key!r} for MooncakeConnectorV1: "
                f"allowed are {', '.join(_OPTION_KEYS)}." + did_you_mean(key, _OPTION_KEYS))
    protocol = extra.get("protocol", default_protocol)
    if protocol not in PROTOCOLS:
        raise KVTransferParamsError(
            f"kv_connector_extra_config protocol={protocol!r}: expected one of "
            f"{', '.join(PROTOCOLS)} (tcp on the host target, ascend on NPUs)")
    device_name = extra.get("device_name", "")
    if not isinstance(device_name, str):
        raise KVTransferParamsError(
            f"kv_connector_extra_config device_name={device_name!r}: expected a string")
    return MooncakeConnectorOptions(
        prefill=_sizes(extra, "prefill"), decode=_sizes(extra, "decode"), protocol=protocol,
        lease_timeout_s=_seconds(extra, "lease_timeout_s", DEFAULT_LEASE_TIMEOUT_S),
        side_channel_timeout_s=_seconds(extra, "side_channel_timeout_s",
                                        DEFAULT_SIDE_CHANNEL_TIMEOUT_S),
        device_name=device_name)


def check_role(role: Any) -> str:
    if role not in ROLES:
        raise KVTransferParamsError(
            f"kv_role={role!r} is not a role of MooncakeConnectorV1: expected one of "
            f"{', '.join(ROLES)}." + did_you_mean(str(role), ROLES))
    return role


def check_parallel_sizes(options: MooncakeConnectorOptions, role: str, *, tp_size: int,
                         dp_size: int) -> None:
    """This instance's sizes must be what the config says its side has; the prefill TP
    size must be a multiple of the decode one (each decode rank reads whole blocks from
    ``prefill_tp / decode_tp`` prefill ranks)."""
    sides = {"kv_producer": ("prefill",), "kv_consumer": ("decode",),
             "kv_both": ("prefill", "decode")}[role]
    for side in sides:
        declared: ParallelSizes = getattr(options, side)
        for key, actual in (("tp_size", tp_size), ("dp_size", dp_size)):
            if getattr(declared, key) != actual:
                raise KVTransferParamsError(
                    f"kv_connector_extra_config {side}.{key}={getattr(declared, key)} but "
                    f"this {role} instance runs with {key} {actual}: set it to {actual}")
    prefill_tp, decode_tp = options.prefill.tp_size, options.decode.tp_size
    if prefill_tp % decode_tp:
        raise KVTransferParamsError(
            f"prefill tp_size {prefill_tp} is not a multiple of decode tp_size {decode_tp}: "
            f"MooncakeConnectorV1 reads each decode rank's heads from whole prefill ranks "
            f"(prefill TP 2 to decode TP 1 works, 1 to 2 does not)")
    if options.prefill.dp_size != 1 or options.decode.dp_size != 1:
        raise KVTransferParamsError(
            f"prefill dp_size {options.prefill.dp_size}, decode dp_size "
            f"{options.decode.dp_size}: MooncakeConnectorV1 supports dp_size 1 per instance "
            f"(run more instances behind the proxy instead)")
