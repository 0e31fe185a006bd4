"""A clear start-up error when vLLM's compilation cannot trace a model on the npu target.

PIECEWISE / FULL_AND_PIECEWISE graphs on npu trace the model with Dynamo (``VLLM_COMPILE``,
eager backend) on its first forward: the worker's profiling run, then the warm-up and
capture. Everything of ours Dynamo cannot look into (torch_npu kernels, ascend-kernels'
backend dispatch) enters the graph as an opaque custom op (``torch.ops.ascend.*``,
``torch.ops.ascend_quant.linear``, vLLM's ``moe_forward`` and attention ops); a model with
a path none of these cover would stop Dynamo there. That happens at start-up, before any
request, and ``explain_trace_failures`` turns Dynamo's error into one that says which
configuration failed and what serves the model instead; the model is never half-compiled
mid-run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch._dynamo.exc import TorchDynamoException
from vllm.config import CompilationMode


@contextlib.contextmanager
def explain_trace_failures(vllm_config, stage: str) -> Iterator[None]:
    """Re-raise a Dynamo failure under vLLM's compilation as a RuntimeError that names the
    model, the graph mode and the way out; other errors pass unchanged."""
    try:
        yield
    except TorchDynamoException as error:
        compilation = vllm_config.compilation_config
        if compilation.mode != CompilationMode.VLLM_COMPILE:
            raise
        model_config = vllm_config.model_config
        model = model_config.model if model_config is not None else "?"
        mode = getattr(compilation.cudagraph_mode, "name", compilation.cudagraph_mode)
        reason = (str(error).strip().splitlines() or [""])[0]
        raise RuntimeError(
            f"npu target: {mode} graphs need vLLM's compilation to trace the model, and "
            f"Dynamo could not trace {model!r} during the {stage} ({type(error).__name__}: "
            f"{reason}). Some layer of this model calls npu code that is not an opaque "
            "custom op. Serve it with compilation_config={'cudagraph_mode': "
            "'FULL_DECODE_ONLY'} (FULL decode graphs, no tracing) or with enforce_eager=True."
        ) from error


__all__ = ["explain_trace_failures"]
