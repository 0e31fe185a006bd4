"""torch_npu functions that libraries import by name but the reference does not compute.

transformers imports ``torch_npu.npu_fusion_attention`` at module import time whenever
torch_npu is importable; if the name were absent, merely importing transformers beside the
reference would fail. The name exists so that the import succeeds, and calling it raises
``NotImplementedError``: the reference never returns a result it has not modelled.
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
