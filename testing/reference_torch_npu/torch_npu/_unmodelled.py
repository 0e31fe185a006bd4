"""torch_npu functions that libraries import by name but the reference does not compute.

transformers imports ``torch_npu.npu_fusion_attention`` at module import time whenever
torch_npu is importable; if the name were absent, merely importing transformers beside the
reference would fail. The name exists so that the import succeeds, and calling it raises
``NotImplementedError``: the reference never returns a result it has not modelled.

The same error serves arguments: a reference function's signature takes every argument of
the real binding's schema, and one the reference does not model raises
``unmodelled_argument`` (through ``refuse_unmodelled``) when given anything but its default.
"""

from __future__ import annotations


def _unmodelled(name: str, doc_page: str):
    def function(*args, **kwargs):
        raise NotImplementedError(
            f"torch_npu.{name} is not modelled by the reference torch_npu "
            f"(torch_npu's documentation: Ascend/op-plugin docs/context/{doc_page}); "
            "model it in testing/reference_torch_npu before code under test calls it."
        )

    function.__name__ = name
    function.__qualname__ = name
    function.__doc__ = (
        f"Not modelled: raises NotImplementedError. The real op is documented in "
        f"Ascend/op-plugin docs/context/{doc_page}."
    )
    return function


npu_fusion_attention = _unmodelled("npu_fusion_attention", "torch_npu-npu_fusion_attention.md")


def unmodelled_argument(op: str, argument: str, value) -> NotImplementedError:
    """The error for an argument the real binding takes and the reference accepts in its
    signature, but whose non-default ``value`` it does not model: raised, never ignored."""
    return NotImplementedError(
        f"torch_npu.{op}: {argument}={value!r} is not modelled by the reference torch_npu "
        f"(only the default); model it in testing/reference_torch_npu before code under test "
        "passes it."
    )


def refuse_unmodelled(op: str, **arguments) -> None:
    """Raise :func:`unmodelled_argument` for the first of ``arguments`` that is not None."""
    for argument, value in arguments.items():
        if value is not None:
            raise unmodelled_argument(op, argument, value)
