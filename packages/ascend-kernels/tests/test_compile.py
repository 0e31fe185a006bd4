"""The ops trace whole under torch.compile (vLLM compiles models by default): no graph
break, so the ops can sit inside vLLM's compiled model on the host target."""

import pytest
import torch

import ascend_kernels as k


def model_step(x, residual, weight, positions, query, key, cos_sin_cache):
    normed = k.rms_norm(x, weight, 1e-6)
    fused, new_residual = k.add_rms_norm(x, residual, weight, 1e-6)
    activated = k.silu_and_mul(torch.cat([normed, fused], dim=-1))
    q, kk = k.rotary_embedding(positions, query, key, cos_sin_cache, 32, True, inplace=True)
    return normed, fused, new_residual, activated, q, kk


@pytest.mark.parametrize("dynamic", [False, True])
def test_reference_paths_compile_without_graph_breaks(dynamic):
    torch.manual_seed(0)
    args = (torch.randn(5, 64), torch.randn(5, 64), torch.rand(64) + 0.5, torch.arange(5),
            torch.randn(5, 4 * 32), torch.randn(5, 2 * 32), torch.randn(16, 32))
    eager = model_step(*[a.clone() for a in args])
    compiled = torch.compile(model_step, fullgraph=True, backend="eager", dynamic=dynamic)
    for got, want in zip(compiled(*[a.clone() for a in args]), eager, strict=True):
        torch.testing.assert_close(got, want)
