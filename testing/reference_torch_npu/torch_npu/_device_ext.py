"""Builds and loads the C++ extension that gives the reference its ``npu`` device.

``csrc/reference_device.cpp`` is compiled once by ``torch.utils.cpp_extension.load`` (g++,
ninja and the Python headers are needed) into torch's extensions folder
(``TORCH_EXTENSIONS_DIR``, by default ``~/.cache/torch_extensions``), under a name holding
a hash of the source and of torch's version, so an edited source or another torch builds
anew and an unchanged one loads in well under a second. The first build takes about a
minute on two cores; one line on stderr says it is happening.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "reference_device.cpp"
_module = None


def _name() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return f"torch_npu_reference_device_{digest.hexdigest()[:16]}"


def load():
    """The extension module, built first if needed (once per process, then cached)."""
    global _module
    if _module is not None:
        return _module
    name = _name()
    if name in sys.modules:  # a previous torch_npu import in this process loaded it
        _module = sys.modules[name]
        return _module
    from torch.utils import cpp_extension

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_directory = Path(root) / name
    built = build_directory / f"{name}.so"
    if built.exists() and not (build_directory / "lock").exists():
        spec = importlib.util.spec_from_file_location(name, built)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    else:
        print(f"reference torch_npu: compiling its npu device ({SOURCE.name}) into "
              f"{build_directory}; this happens once and takes about a minute.",
              file=sys.stderr, flush=True)
        build_directory.mkdir(parents=True, exist_ok=True)
        module = cpp_extension.load(
            name=name, sources=[str(SOURCE)], build_directory=str(build_directory),
            extra_cflags=["-O2"], verbose=False)
        sys.modules[name] = module
    module.register_hooks()
    _module = module
    return module
