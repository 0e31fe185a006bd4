"""Synthetic expert loads for benchmarks, tests and the CLI's examples.

``zipf_loads`` is the generator behind the issue's reference figures for vLLM's
default policy (seed 0, global placement: 0.297 / 0.993 / 0.995 at s=0.6 and
0.061 / 0.906 / 0.986 at s=1.2 for 0 / 64 / 128 redundant experts), which it reproduces.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["drift_loads", "zipf_loads"]


def zipf_loads(
    num_layers: int,
    num_experts: int,
    s: float,
    *,
    seed: int = 0,
    tokens_per_layer: float = 1e6,
) -> torch.Tensor:
    """Zipf-distributed expert loads: [num_layers, num_experts] float64.

    The expert of popularity rank ``r`` (1-based) gets a load proportional to
    ``1 / r**s``, scaled so that each layer sums to ``tokens_per_layer``. Each layer
    then permutes its experts with ``numpy.random.default_rng(seed).permutation``, one
    call per layer in layer order from a single generator.
    """
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    base = ranks ** -float(s)
    base *= tokens_per_layer / base.sum()
    rng = np.random.default_rng(seed)
    layers = [rng.permutation(base) for _ in range(num_layers)]
    return torch.from_numpy(np.stack(layers) if layers else np.zeros((0, num_experts)))


def drift_loads(loads: torch.Tensor, fraction: float = 0.1, *, seed: int = 0) -> torch.Tensor:
    """Loads after a drift: every load times ``1 + u``, ``u`` uniform in
    ``[-fraction, fraction]`` (numpy ``default_rng(seed)``), rescaled so that each layer
    keeps its total."""
    loads = torch.as_tensor(loads, dtype=torch.float64)
    rng = np.random.default_rng(seed)
    noise = rng.uniform(-fraction, fraction, size=tuple(loads.shape))
    drifted = loads * (1.0 + torch.from_numpy(noise))
    total, new_total = loads.sum(-1, keepdim=True), drifted.sum(-1, keepdim=True)
    return drifted * torch.where(new_total > 0, total / new_total.clamp(min=1e-300), 0.0)
