"""The pull protocol between a prefill and a decode worker, on two Mooncake transfer
engines (protocol tcp, loopback) and the zmq side channel, in one process: exactly the
request's blocks arrive, and every refusal (forged engine id or block ids, expired lease,
dead peer, another model's cache) leaves the decode cache untouched."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from ascend_core.distributed.kv_transfer.layout import describe_kv_caches, memory_regions
from ascend_core.distributed.kv_transfer.leases import LeaseTable, prompt_digest
from ascend_core.distributed.kv_transfer.params import RemotePrefill
from ascend_core.distributed.kv_transfer.pull import (
    DecodeSide,
    PrefillSide,
    PullError,
    PullTask,
)
from ascend_core.distributed.kv_transfer.side_channel import SideChannelServer
from ascend_core.distributed.kv_transfer.transfer_engine import MooncakeEngine

HOST = "127.0.0.1"
PROMPT = prompt_digest([11, 12, 13])  # the prompt whose KV every lease here holds
NUM_BLOCKS, BLOCK_SIZE = 8, 16
SHAPE = (NUM_BLOCKS, 2, 2, BLOCK_SIZE, 32)  # [blocks, K/V, kv heads, tokens, head size]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class Node:
    def __init__(self, num_layers: int = 2, timeout_s: float = 2.0):
        generator = torch.Generator().manual_seed(num_layers)
        self.caches = {f"model.layers.{i}.self_attn.attn": torch.randn(SHAPE, generator=generator)
                       for i in range(num_layers)}
        self.layout = describe_kv_caches(self.caches, NUM_BLOCKS, BLOCK_SIZE)
        self.engine = MooncakeEngine(HOST, "tcp")
        self.engine.register(memory_regions(self.caches))
        self.timeout_s = timeout_s

    def zero(self):
        for cache in self.caches.values():
            cache.zero_()

    def decode_side(self, timeout_s: float | None = None,
                    pending_timeout_s: float | None = None) -> DecodeSide:
        return DecodeSide(self.engine, self.layout, tp_rank=0, tp_size=1,
                          timeout_s=timeout_s or self.timeout_s,
                          pending_timeout_s=pending_timeout_s)


@pytest.fixture(scope="module")
def prefill():
    node = Node()
    node.leases = LeaseTable(timeout_s=30)
    node.port = free_port()
    node.side = PrefillSide("prefill-0", node.engine.session, node.layout, node.leases,
                            f"{HOST}:{node.port}")
    node.server = SideChannelServer(HOST, node.port, node.side.handle)
    yield node
    node.server.close()


@pytest.fixture(scope="module")
def decode_node():
    return Node()


@pytest.fixture
def decode(decode_node):
    decode_node.zero()
    return decode_node


def remote(prefill, request_id, block_ids, engine_id="prefill-0", port=None):
    return RemotePrefill(engine_id=engine_id, request_id=request_id, host=HOST,
                         port=port or prefill.port, block_ids=tuple(block_ids), tp_size=1)


def pull_task(request_id, local_block_ids, remote_prefill, prompt=PROMPT) -> PullTask:
    return PullTask(request_id, local_block_ids, remote_prefill, prompt)


def untouched(decode) -> bool:
    return all(not cache.any() for cache in decode.caches.values())


def test_pull_copies_the_requests_blocks_and_nothing_else(prefill, decode):
    prefill.leases.add("p-1", [5, 2, 6], PROMPT)
    read = decode.decode_side().pull(pull_task("d-1", (1, 3, 4), remote(prefill, "p-1",
                                                                       [5, 2, 6])))
    block_bytes = SHAPE[1] * SHAPE[2] * SHAPE[3] * SHAPE[4] * 4
    assert read == 3 * 2 * block_bytes
    for name, cache in decode.caches.items():
        source = prefill.caches[name]
        for local, far in ((1, 5), (3, 2), (4, 6)):
            assert torch.equal(cache[local], source[far])
        assert not cache[[0, 2, 5, 6, 7]].any()
    assert prefill.leases.take_finished() == ({"p-1"}, set())


def test_a_decode_prefix_hit_pulls_only_the_missing_blocks(prefill, decode):
    prefill.leases.add("p-2", [0, 1, 2], PROMPT)
    decode.decode_side().pull(pull_task("d-2", (7,), remote(prefill, "p-2", [0, 1, 2])))
    for name, cache in decode.caches.items():
        assert torch.equal(cache[7], prefill.caches[name][2])
        assert not cache[:7].any()
    assert prefill.leases.take_finished()[0] == {"p-2"}


def test_a_claim_that_arrives_before_the_lease_waits_for_it(prefill, decode):
    # Still being prefilled: the claim waits past the side channel's answer timeout (0.2 s)
    # for as long as pending_timeout_s allows.
    prefill.leases.expect("p-3")
    timer = threading.Timer(0.6, prefill.leases.add, args=("p-3", [4], PROMPT))
    timer.start()
    decode.decode_side(timeout_s=0.2, pending_timeout_s=5).pull(
        pull_task("d-3", (0,), remote(prefill, "p-3", [4])))
    timer.join()
    assert torch.equal(next(iter(decode.caches.values()))[0],
                       next(iter(prefill.caches.values()))[4])
    prefill.leases.take_finished()


def test_a_claim_for_a_request_never_prefilled_there_fails_at_once(prefill, decode):
    started = time.monotonic()
    with pytest.raises(PullError, match="no request 'p-never' is or was prefilled here"):
        decode.decode_side(pending_timeout_s=30).pull(
            pull_task("d-never", (0,), remote(prefill, "p-never", [4])))
    assert time.monotonic() - started < 5
    assert untouched(decode)


def test_a_claim_still_pending_after_pending_timeout_s_fails(prefill, decode):
    prefill.leases.expect("p-slow")
    with pytest.raises(PullError, match="still prefilling request 'p-slow' after 0.5 s"):
        decode.decode_side(pending_timeout_s=0.5).pull(
            pull_task("d-slow", (0,), remote(prefill, "p-slow", [4])))
    assert untouched(decode)
    prefill.leases.drop("p-slow", "test over")


def test_a_release_without_blocks_frees_the_lease(prefill, decode):
    prefill.leases.add("p-4", [3], PROMPT)
    assert decode.decode_side().pull(pull_task("d-4", (), remote(prefill, "p-4", [3]))) == 0
    assert prefill.leases.take_finished() == ({"p-4"}, set())
    assert untouched(decode)


@pytest.mark.parametrize("engine_id, block_ids, message", [
    ("prefill-forged", [5, 6],
     r"remote_engine_id 'prefill-forged' is not the engine at 127.0.0.1:\d+, which is "
     r"'prefill-0'"),
    ("prefill-0", [5, 99], r"holds block id 99, outside the cache's 8 blocks \(ids 0 to 7\)"),
    ("prefill-0", [5, 7], r"block id 7 is not one of the 2 blocks held for request 'p-5'"),
])
def test_forged_kv_transfer_params_are_refused_and_nothing_is_written(
        prefill, decode, engine_id, block_ids, message):
    prefill.leases.add("p-5", [5, 6], PROMPT)
    task = pull_task("d-5", (0, 1), remote(prefill, "p-5", block_ids, engine_id=engine_id))
    with pytest.raises(PullError, match=message) as err:
        decode.decode_side().pull(task)
    assert "\n" not in str(err.value)
    assert untouched(decode)
    # The real lease is still there for the real decode request.
    decode.decode_side().pull(pull_task("d-5", (0, 1), remote(prefill, "p-5", [5, 6])))
    prefill.leases.take_finished()


def test_an_expired_lease_is_refused(decode):
    node = Node(timeout_s=2)
    node.leases = LeaseTable(timeout_s=0.2)
    port = free_port()
    side = PrefillSide("prefill-1", node.engine.session, node.layout, node.leases,
                       f"{HOST}:{port}")
    server = SideChannelServer(HOST, port, side.handle)
    try:
        node.leases.add("p-6", [1], PROMPT)
        time.sleep(0.3)
        assert node.leases.take_finished() == (set(), {"p-6"})
        with pytest.raises(PullError, match=r"no longer held here: their lease expired "
                                            r"after 0.2 s"):
            decode.decode_side().pull(pull_task("d-6", (2,), RemotePrefill(
                "prefill-1", "p-6", HOST, port, (1,), 1)))
        assert untouched(decode)
    finally:
        server.close()


def test_a_dead_prefill_node_fails_the_pull_within_the_timeout(prefill, decode):
    started = time.monotonic()
    with pytest.raises(PullError, match=r"no answer from the prefill node's side channel at "
                                        r"tcp://127.0.0.1:\d+ within"):
        decode.decode_side(timeout_s=0.5).pull(
            pull_task("d-7", (0,), remote(prefill, "p-7", [0], port=free_port())))
    assert time.monotonic() - started < 3
    assert untouched(decode)


def test_another_models_cache_is_refused_before_any_read(prefill):
    deeper = Node(num_layers=3)
    deeper.zero()
    prefill.leases.add("p-8", [1], PROMPT)
    with pytest.raises(PullError, match=r"serves a different model: its KV cache has 2 "
                                        r"planes, this node's 3"):
        deeper.decode_side().pull(pull_task("d-8", (0,), remote(prefill, "p-8", [1])))
    assert untouched(deeper)
    # Refused after the claim: the lease is released, not left to expire.
    assert prefill.leases.take_finished()[0] == {"p-8"}


def consecutive_free_ports(count: int) -> int:
    for _ in range(50):
        base = free_port()
        try:
            socks = []
            for offset in range(count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind((HOST, base + offset))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError("no consecutive free ports")


def test_prefill_tp_2_to_decode_tp_1_assembles_each_block_from_both_ranks():
    # vLLM's CPU layout [blocks, kv heads, 2 * block_size, head size]; each prefill rank
    # holds one of the two KV heads, the decode rank both.
    generator = torch.Generator().manual_seed(7)
    base = consecutive_free_ports(2)
    ranks = []
    for rank in range(2):
        caches = {f"layer.{i}": torch.randn(NUM_BLOCKS, 1, 2 * BLOCK_SIZE, 32,
                                            generator=generator) for i in range(2)}
        layout = describe_kv_caches(caches, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads=1)
        engine = MooncakeEngine(HOST, "tcp")
        engine.register(memory_regions(caches))
        leases = LeaseTable(timeout_s=30)
        leases.add("p-tp", [6, 1], PROMPT)
        side = PrefillSide("prefill-tp2", engine.session, layout, leases, f"{HOST}:{base + rank}")
        ranks.append((caches, leases, SideChannelServer(HOST, base + rank, side.handle), engine))
    decode_caches = {f"layer.{i}": torch.zeros(NUM_BLOCKS, 2, 2 * BLOCK_SIZE, 32)
                     for i in range(2)}
    decode_layout = describe_kv_caches(decode_caches, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads=2)
    engine = MooncakeEngine(HOST, "tcp")
    engine.register(memory_regions(decode_caches))
    try:
        side = DecodeSide(engine, decode_layout, tp_rank=0, tp_size=1, timeout_s=2)
        read = side.pull(pull_task("d-tp", (2, 3), RemotePrefill(
            "prefill-tp2", "p-tp", HOST, base, (6, 1), tp_size=2)))
        assert read == 2 * 2 * 2 * (2 * BLOCK_SIZE * 32 * 4)  # blocks x layers x ranks
        for name, cache in decode_caches.items():
            for local, far in ((2, 6), (3, 1)):
                expected = torch.cat([ranks[0][0][name][far], ranks[1][0][name][far]])
                assert torch.equal(cache[local], expected)
            assert not cache[[0, 1, 4, 5, 6, 7]].any()
        # Both ranks' leases were released.
        assert [leases.take_finished()[0] for _, leases, _, _ in ranks] == [{"p-tp"}] * 2
    finally:
        for _, _, server, _ in ranks:
            server.close()


def test_a_kv_port_in_use_is_refused_with_the_address_and_what_to_change(prefill):
    from ascend_core.distributed.kv_transfer.side_channel import SideChannelError, ask

    with pytest.raises(SideChannelError) as refused:
        SideChannelServer(HOST, prefill.port, prefill.side.handle)
    message = str(refused.value)
    assert message.startswith(f"cannot listen on tcp://{HOST}:{prefill.port} for the KV side "
                              f"channel (")
    assert message.endswith("pick a free kv_port (each rank uses kv_port + its "
                            "tensor-parallel rank)")
    assert "\n" not in message
    # The server that holds the port still answers on it.
    assert ask(HOST, prefill.port, {"op": "release", "engine_id": "prefill-0",
                                    "request_id": "nobody"}, 2.0) == {"status": "ok"}


@pytest.mark.parametrize("lease,prompt", [("p-9", prompt_digest([11, 12, 14])), ("p-10", None)])
def test_a_claim_for_another_prompt_is_refused_and_reads_nothing(prefill, decode, lease,
                                                                 prompt):
    """A decode request whose prompt is not the one the leased blocks hold (forged or stale
    kv_transfer_params, or a prompt given as embeddings) never reads them; the lease stays
    for the request it belongs to."""
    prefill.leases.add(lease, [2, 3], PROMPT)
    with pytest.raises(PullError, match="hold the KV of another prompt than the claim's"):
        decode.decode_side().pull(pull_task("d-9", (0, 1), remote(prefill, lease, [2, 3]),
                                            prompt=prompt))
    assert untouched(decode)
    decode.decode_side().pull(pull_task("d-9", (0, 1), remote(prefill, lease, [2, 3])))
    assert torch.equal(decode.caches[next(iter(decode.caches))][0],
                       prefill.caches[next(iter(prefill.caches))][2])


def test_a_decode_worker_waits_on_pending_claims_for_lease_timeout_s(monkeypatch):
    """The connector's decode side: each answer within side_channel_timeout_s, a claim the
    prefill node answers "pending" asked again for up to lease_timeout_s."""
    from types import SimpleNamespace

    import vllm.distributed.parallel_state as parallel_state

    from ascend_core.distributed.kv_transfer.params import parse_options
    from ascend_core.distributed.kv_transfer.vllm_mooncake_connector import _WorkerSide

    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    options = parse_options({"lease_timeout_s": 42, "side_channel_timeout_s": 4}, "tcp")
    connector = SimpleNamespace(
        options=options, host=HOST, kv_role="kv_consumer", block_size=BLOCK_SIZE, tp_size=1,
        _vllm_config=SimpleNamespace(
            compilation_config=SimpleNamespace(static_forward_context={})))
    spec = SimpleNamespace(num_kv_heads=2)
    kv_cache_config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec)])
    worker = _WorkerSide(connector, kv_cache_config)
    try:
        worker.register_kv_caches(Node().caches)
        assert (worker.decode.timeout_s, worker.decode.pending_timeout_s) == (4, 42)
    finally:
        worker.shutdown()
