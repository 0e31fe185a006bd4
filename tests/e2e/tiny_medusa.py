"""The tiny random Llama with self-distilled Medusa heads that the float32 tests serve.

A random Llama with the demo's initializer_range 0.2 is chaotic (no head can learn it); with
0.005 the token embedding dominates the residual stream and its greedy continuations are a
walk that heads learn several steps ahead. The heads are trained at test time (about a minute
on 2 cores), then cached by base model and options; the nox e2e session trains them before
the tests start (`python tiny_medusa.py`), alone on the machine. The trained demo model's heads are
committed instead (models/pycoder-26m-medusa).
"""

from __future__ import annotations

TINY_MEDUSA_BASE = {"initializer_range": 0.005}
MEDUSA_HEADS = 3


def tiny_medusa_options():
    from ascend_specdec.medusa import TrainOptions

    return TrainOptions(heads=MEDUSA_HEADS, samples=4000, steps=3000, continuation_tokens=64,
                        seed=0)


def ensure_tiny_medusa() -> tuple[str, str]:
    """(base model folder, Medusa heads folder), built and trained once, then cached."""
    from ascend_plugin.tiny_models import ensure_model
    from ascend_specdec.medusa import ensure_medusa_heads

    base = ensure_model("llama", **TINY_MEDUSA_BASE)
    return str(base), str(ensure_medusa_heads(base, tiny_medusa_options()))


if __name__ == "__main__":
    print(ensure_tiny_medusa()[1])
