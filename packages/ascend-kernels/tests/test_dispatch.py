"""The dispatcher: automatic choice per device, forced backends and their refusals."""

from types import SimpleNamespace

import pytest
import torch

import ascend_kernels.dispatch as dispatch
from ascend_kernels import BackendUnavailable, resolve_backend

ALL = ("reference", "triton", "npu")


def _on(device_type: str):
    # resolve_backend only looks at the device; cuda and npu tensors cannot exist here.
    return SimpleNamespace(device=SimpleNamespace(type=device_type))


@pytest.fixture
def machine(monkeypatch):
    """Set what imports: ``machine(triton=..., torch_npu=...)``."""

    def set_machine(triton: bool, torch_npu: bool, triton_driver: bool = True):
        monkeypatch.setattr(dispatch, "triton_module", lambda: object() if triton else None)
        monkeypatch.setattr(dispatch, "_triton_driver_problem",
                            lambda: None if triton_driver else "no active driver")
        monkeypatch.setattr(dispatch, "torch_npu_module",
                            lambda: object() if torch_npu else None)

    return set_machine


@pytest.mark.parametrize("device, triton, torch_npu, implemented, unsupported, expected", [
    ("cpu", True, True, ALL, {}, "reference"),
    ("cuda", True, False, ALL, {}, "triton"),
    ("cuda", False, False, ALL, {}, "reference"),
    ("cuda", True, False, ("reference", "npu"), {}, "reference"),
    ("cuda", True, False, ALL, {"triton": "row too long"}, "reference"),
    ("npu", True, True, ALL, {}, "npu"),
    ("npu", True, True, ALL, {"npu": "float32"}, "triton"),
    ("npu", False, True, ALL, {"npu": "float32"}, "reference"),
    ("npu", True, False, ALL, {}, "triton"),
    ("npu", True, True, ("reference", "triton"), {}, "triton"),
    ("meta", True, True, ALL, {}, "reference"),
])
def test_automatic_choice(machine, device, triton, torch_npu, implemented, unsupported,
                          expected):
    machine(triton, torch_npu)
    assert resolve_backend("op", _on(device), implemented, None, unsupported) == expected


def test_cpu_interpreter_never_changes_the_automatic_choice(machine, monkeypatch):
    machine(True, False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend("op", torch.ones(1), ALL) == "reference"
    assert resolve_backend("op", torch.ones(1), ALL, "triton") == "triton"


@pytest.mark.parametrize("device, triton, env, match", [
    ("cpu", True, "0", "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1"),
    ("cpu", False, "1", "triton is not installed"),
    ("xpu", True, "1", "Triton has no backend for xpu tensors"),
])
def test_forced_triton_that_cannot_run_is_refused(machine, monkeypatch, device, triton, env,
                                                  match):
    machine(triton, False)
    monkeypatch.setenv("TRITON_INTERPRET", env)
    with pytest.raises(BackendUnavailable, match=match):
        resolve_backend("my_op", _on(device), ALL, "triton")


def test_forced_backend_refusals_name_op_backend_and_reason(machine):
    machine(True, True)
    with pytest.raises(BackendUnavailable,
                       match="my_op: backend 'npu' cannot take these inputs: no float32"):
        resolve_backend("my_op", _on("npu"), ALL, "npu", {"npu": "no float32"})
    with pytest.raises(BackendUnavailable, match=r"my_op has no 'npu' backend; it has"):
        resolve_backend("my_op", _on("npu"), ("reference",), "npu")
    with pytest.raises(ValueError, match="unknown backend 'gpu'"):
        resolve_backend("my_op", _on("cuda"), ALL, "gpu")
    assert resolve_backend("my_op", _on("cuda"), ALL, "reference") == "reference"
    machine(True, False)
    with pytest.raises(BackendUnavailable, match="needs torch_npu"):
        resolve_backend("my_op", _on("npu"), ALL, "npu")


def test_npu_tensors_skip_a_triton_without_a_device_driver(machine):
    # Upstream Triton beside torch_npu (no triton-ascend): it imports, but cannot launch.
    machine(triton=True, torch_npu=True, triton_driver=False)
    assert dispatch.triton_unusable_reason(_on("npu")) == "no active driver"
    assert resolve_backend("op", _on("npu"), ALL, None, {"npu": "float32"}) == "reference"
