"""enable_cpu_binding: which cores each local rank takes, and binding a process to them."""

import json
import os
import subprocess
import sys

import pytest

from ascend_core.worker.cpu_binding import cpu_share, numa_node_of_core, parse_cpu_list


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]
    assert parse_cpu_list("") == []


def test_ranks_take_disjoint_contiguous_slices_covering_every_core():
    shares = [cpu_share(range(8), rank, 3) for rank in range(3)]
    assert shares == [[0, 1], [2, 3, 4], [5, 6, 7]]


def test_slices_follow_numa_nodes():
    # Cores interleaved across two nodes (even ids on node 0): each of two ranks gets one
    # node, not a mix.
    node_of = {core: core % 2 for core in range(8)}
    assert cpu_share(range(8), 0, 2, node_of) == [0, 2, 4, 6]
    assert cpu_share(range(8), 1, 2, node_of) == [1, 3, 5, 7]
    assert cpu_share(range(8), 1, 4, node_of) == [4, 6]


def test_only_the_allowed_cores_are_shared():
    assert cpu_share({3, 7, 9, 12}, 1, 2) == [9, 12]


def test_more_ranks_than_cores_share_cores_round_robin():
    assert [cpu_share([4, 5], rank, 3) for rank in range(3)] == [[4], [5], [4]]


def test_bad_rank_and_no_cores_are_refused():
    with pytest.raises(ValueError, match="local rank 2 is not in 0..1"):
        cpu_share(range(4), 2, 2)
    with pytest.raises(ValueError, match="no CPU core"):
        cpu_share([], 0, 1)


def test_numa_nodes_from_sysfs(tmp_path):
    for node, cpus in (("node0", "0-1"), ("node1", "2-3")):
        (tmp_path / node).mkdir()
        (tmp_path / node / "cpulist").write_text(cpus + "\n")
    (tmp_path / "possible").write_text("0-1\n")
    assert numa_node_of_core(tmp_path) == {0: 0, 1: 0, 2: 1, 3: 1}
    assert numa_node_of_core(tmp_path / "missing") == {}


def test_binding_a_process_binds_all_its_threads():
    """In a child (binding is for the life of a process): the existing threads and the
    torch pool end up on the chosen cores."""
    allowed = sorted(os.sched_getaffinity(0))
    script = """
import json, os, threading, time
from ascend_core.worker.cpu_binding import bind_worker
started = threading.Event()
def idle():
    started.set()
    time.sleep(30)
threading.Thread(target=idle, daemon=True).start()
started.wait()
cores = bind_worker(local_rank=LAST, local_world_size=WORLD)
import torch
threads = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
print(json.dumps({"cores": cores, "threads": threads, "pool": torch.get_num_threads()}))
"""
    world = min(2, len(allowed))
    script = script.replace("LAST", str(world - 1)).replace("WORLD", str(world))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    expected = cpu_share(allowed, world - 1, world, numa_node_of_core())
    assert result["cores"] == expected
    assert len(result["threads"]) >= 2
    assert all(sorted(set(t)) == sorted(expected) for t in result["threads"])
    assert result["pool"] == len(expected)
