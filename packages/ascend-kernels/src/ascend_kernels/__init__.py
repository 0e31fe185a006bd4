"""Device ops for vLLM on Ascend, one op with several backends.

Each op has a torch reference (the specification, any device), and where it
pays a Triton implementation and a torch_npu implementation. ``backend=None``
lets the dispatcher choose by device; tests force a backend by name.
"""

from ascend_kernels.__about__ import __version__
from ascend_kernels.dispatch import BACKENDS, BackendUnavailable, resolve_backend
from ascend_kernels.ops import rms_norm, silu_and_mul

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "__version__",
    "resolve_backend",
    "rms_norm",
    "silu_and_mul",
]
