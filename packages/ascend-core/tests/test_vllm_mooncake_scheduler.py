"""MooncakeConnectorV1's scheduler side per role, on request objects shaped like vLLM's
(prompt length, status, kv_transfer_params) and vLLM's RequestStatus."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from vllm.v1.request import RequestStatus

from ascend_core.distributed.kv_transfer.leases import prompt_digest
from ascend_core.distributed.kv_transfer.params import parse_options
from ascend_core.distributed.kv_transfer.vllm_mooncake_connector import _SchedulerSide

BLOCK = 16
STEP = SimpleNamespace(total_num_scheduled_tokens=0)  # vLLM's SchedulerOutput, as read


def scheduler(role: str) -> _SchedulerSide:
    connector = SimpleNamespace(kv_role=role, block_size=BLOCK, engine_id=f"{role}-0",
                                host="127.0.0.1", kv_port=14579, tp_size=1, world_size=1,
                                options=parse_options({}, "tcp"))
    return _SchedulerSide(connector)


def request(request_id: str, tokens: int, params: dict | None,
            status=RequestStatus.FINISHED_LENGTH_CAPPED):
    return SimpleNamespace(request_id=request_id, num_prompt_tokens=tokens,
                           prompt_token_ids=list(range(100, 100 + tokens)),
                           kv_transfer_params=params, status=status)


def remote_params(block_ids=(3, 4), **changes) -> dict:
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_engine_id": "p-0", "remote_request_id": "cmpl-p", "remote_host": "h",
              "remote_port": 14579, "remote_block_ids": list(block_ids), "remote_tp_size": 1}
    params.update(changes)
    return params


class Blocks:
    """vLLM's KVCacheBlocks as the connector reads it: the blocks a prefix hit did not fill."""

    def __init__(self, unhashed):
        self.unhashed = unhashed

    def get_unhashed_block_ids(self):
        return list(self.unhashed)


@pytest.mark.parametrize("role", ["kv_producer", "kv_both"])
def test_a_producer_keeps_a_finished_prefills_blocks_and_says_where(role):
    side = scheduler(role)
    # Scheduled: the workers expect the request (a decode claim for it waits, not fails).
    for rid in ("r1", "r2"):
        side.update_state_after_alloc(request(rid, 20, {"do_remote_decode": True}),
                                      Blocks([7, 8]), 0)
    side.update_state_after_alloc(request("r3", 20, None), Blocks([9]), 0)
    assert side.build_connector_meta(STEP).expected == ["r1", "r2"]
    delay, params = side.request_finished(request("r1", 20, {"do_remote_decode": True}), [7, 8])
    assert delay is True
    assert params == {"do_remote_prefill": True, "do_remote_decode": False,
                      "remote_engine_id": f"{role}-0", "remote_request_id": "r1",
                      "remote_host": "127.0.0.1", "remote_port": 14579,
                      "remote_block_ids": [7, 8], "remote_tp_size": 1}
    # The lease carries which prompt the blocks hold; a decode claim must name the same.
    assert side.build_connector_meta(STEP).leases == {
        "r1": ([7, 8], prompt_digest(list(range(100, 120))))}
    assert side.build_connector_meta(STEP).leases == {}  # handed to the workers once
    # An aborted prefill keeps nothing.
    aborted = request("r2", 20, {"do_remote_decode": True},
                      status=RequestStatus.FINISHED_ABORTED)
    assert side.request_finished(aborted, [9]) == (False, None)
    meta = side.build_connector_meta(STEP)
    assert meta.dropped == {"r2": "the prefill request ended finished_aborted and kept no "
                                  "blocks"}
    assert meta.expected == [] and meta.leases == {}
    # A request without PD parameters is none of the connector's business.
    assert side.request_finished(request("r3", 20, None), [9]) == (False, None)


@pytest.mark.parametrize("role", ["kv_consumer", "kv_both"])
def test_a_consumer_waits_for_the_pull_of_exactly_the_blocks_it_lacks(role):
    side = scheduler(role)
    decode = request("d1", 20, remote_params(), status=RequestStatus.WAITING)
    assert side.get_num_new_matched_tokens(decode, 0) == (20, True)
    assert side.get_num_new_matched_tokens(decode, 16) == (4, True)  # asked again: same answer
    side.update_state_after_alloc(decode, Blocks([11]), 4)  # block 0 was a local prefix hit
    (pull,) = side.build_connector_meta(STEP).pulls
    assert (pull.request_id, pull.local_block_ids) == ("d1", (11,))
    assert pull.prompt == prompt_digest(list(range(100, 120)))  # what its claim names
    assert (pull.remote.request_id, pull.remote.block_ids) == ("cmpl-p", (3, 4))
    assert decode.kv_transfer_params["do_remote_prefill"] is False  # pulled once
    # A full local hit pulls nothing but still frees the prefill node's blocks.
    hit = request("d2", 16, remote_params(block_ids=(5,)), status=RequestStatus.WAITING)
    assert side.get_num_new_matched_tokens(hit, 16) == (0, False)
    side.update_state_after_alloc(hit, Blocks([]), 0)
    (release,) = side.build_connector_meta(STEP).pulls
    assert release.local_block_ids == () and release.remote.block_ids == (5,)


def test_a_decode_request_that_ends_before_its_pull_releases_the_prefill_blocks():
    side = scheduler("kv_consumer")
    aborted = request("d3", 20, remote_params(), status=RequestStatus.FINISHED_ABORTED)
    assert side.request_finished(aborted, []) == (False, None)
    (release,) = side.build_connector_meta(STEP).pulls
    assert release.local_block_ids == () and release.remote.request_id == "cmpl-p"


@pytest.mark.parametrize("role, params, message", [
    ("kv_consumer", remote_params(block_ids=(3,)), "has 1 blocks, but this 20-token prompt"),
    ("kv_consumer", remote_params(remote_tp_size=2), "remote_tp_size=2 but"),
    ("kv_producer", remote_params(), "this instance is kv_producer"),
])
def test_unusable_remote_prefill_params_are_logged_and_computed_here(role, params, message,
                                                                     caplog):
    side = scheduler(role)
    decode = request("d4", 20, params, status=RequestStatus.WAITING)
    assert side.get_num_new_matched_tokens(decode, 0) == (0, False)
    assert message in caplog.text and "computing its prompt here" in caplog.text
    assert side.build_connector_meta(STEP).pulls == []


def test_a_consumer_keeps_nothing_for_a_prefill_request(caplog):
    side = scheduler("kv_consumer")
    assert side.request_finished(request("r4", 20, {"do_remote_decode": True}), [1]) == \
        (False, None)
    assert "has do_remote_decode but this instance is kv_consumer" in caplog.text


def test_idle_steps_pause_past_vllms_worker_busy_loop(monkeypatch):
    """While only leases or pulls are outstanding the engine steps with nothing to do; from
    the second empty step on it pauses: briefly with one process or a spare core per rank,
    else past the workers' sched_yield busy loop (vLLM's SpinCondition, 1 s)."""
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    import ascend_core.distributed.kv_transfer.vllm_mooncake_connector as module

    busy_loop_s = inspect.signature(SpinCondition.__init__).parameters["busy_loop_s"].default
    assert busy_loop_s == 1
    assert module._idle_step_pause_s(1, cores=1) <= 0.05
    # Two ranks on two cores: no core to spin on beside the transfer threads.
    assert module._idle_step_pause_s(2, cores=2) > busy_loop_s
    assert module._idle_step_pause_s(8, cores=15) > busy_loop_s
    assert module._idle_step_pause_s(2, cores=4) <= 0.05  # a spare core per rank
    assert module._idle_step_pause_s(8, cores=192) <= 0.05
    pauses = []
    monkeypatch.setattr(module.time, "sleep", pauses.append)
    side = scheduler("kv_producer")
    busy = SimpleNamespace(total_num_scheduled_tokens=5)
    side.build_connector_meta(busy)
    side.build_connector_meta(STEP)  # the first empty step after work: no pause
    assert pauses == []
    side.request_finished(request("r1", 32, {"do_remote_decode": True}), [7, 8])
    side.build_connector_meta(STEP)  # hands a new lease to the workers: no pause
    assert pauses == []
    for _ in range(3):  # then the workers wait for a decode node: the last two pause
        side.build_connector_meta(STEP)
    assert pauses == [side._idle_pause_s] * 2
    side.build_connector_meta(busy)
    side.build_connector_meta(STEP)
    assert len(pauses) == 2
