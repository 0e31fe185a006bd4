"""``explain_trace_failures``: a Dynamo failure under vLLM's compilation (PIECEWISE graphs on
npu) becomes a start-up error that names the model, the graph mode and what serves it
instead; without vLLM's compilation, or for errors that are not Dynamo's, nothing changes."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.exc import TorchDynamoException
from vllm.config import CompilationConfig, CompilationMode, CUDAGraphMode

from ascend_core.worker.npu_trace_errors import explain_trace_failures


def _config(mode: CompilationMode, cudagraph_mode: CUDAGraphMode):
    compilation = CompilationConfig(mode=mode, cudagraph_mode=cudagraph_mode)
    return SimpleNamespace(compilation_config=compilation,
                           model_config=SimpleNamespace(model="/models/tiny"))


def _untraceable(x: torch.Tensor) -> torch.Tensor:
    # What stopped Dynamo in a quantized layer before its npu form was a custom op:
    # ascend-kernels' backend dispatch importing torch_npu at trace time.
    importlib.import_module("json")
    return x + 1


def _trace_untraceable() -> None:
    torch._dynamo.reset()
    torch.compile(_untraceable, backend="eager", fullgraph=True)(torch.ones(2))


def test_a_dynamo_failure_under_vllm_compilation_is_explained_at_start_up():
    config = _config(CompilationMode.VLLM_COMPILE, CUDAGraphMode.PIECEWISE)
    with pytest.raises(RuntimeError) as caught:
        with explain_trace_failures(config, "profiling run"):
            _trace_untraceable()
    message = str(caught.value)
    assert message.startswith("npu target: PIECEWISE graphs need vLLM's compilation")
    assert "'/models/tiny' during the profiling run" in message
    assert "FULL_DECODE_ONLY" in message and "enforce_eager=True" in message
    assert isinstance(caught.value.__cause__, TorchDynamoException)


def test_without_vllm_compilation_the_dynamo_error_passes_unchanged():
    config = _config(CompilationMode.NONE, CUDAGraphMode.FULL_DECODE_ONLY)
    with pytest.raises(TorchDynamoException):
        with explain_trace_failures(config, "warm-up"):
            _trace_untraceable()


def test_other_errors_pass_unchanged():
    config = _config(CompilationMode.VLLM_COMPILE, CUDAGraphMode.FULL_AND_PIECEWISE)
    with pytest.raises(ValueError, match="no KV cache"):
        with explain_trace_failures(config, "warm-up"):
            raise ValueError("no KV cache")
