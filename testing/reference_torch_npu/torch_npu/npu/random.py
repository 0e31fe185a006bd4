"""Seeding of the reference ``torch.npu``.

Follows torch_npu's Random Number Generator API (Ascend/op-plugin
``docs/context/Random-Number-Generator.md``), which documents these functions as torch.cuda's.
The reference has no NPU generator: its tensors live on the CPU and draw from torch's CPU
generator, which these functions leave alone (as ``torch.npu.manual_seed_all`` leaves it
alone on a real NPU). They record the seed so that ``initial_seed()`` reports it.
"""

from __future__ import annotations

from torch_npu.npu._device import _index, device_count

_seeds: dict[int, int] = {}
_DEFAULT_SEED = 67280421310721  # torch's default initial seed


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}.")
    return seed


def manual_seed(seed: int) -> None:
    """Seed the current NPU's generator (``torch_npu.npu.manual_seed``)."""
    _seeds[_index(None)] = _check_seed(seed)


def manual_seed_all(seed: int) -> None:
    """Seed every visible NPU's generator (``torch_npu.npu.manual_seed_all``)."""
    seed = _check_seed(seed)
    for index in range(device_count()):
        _seeds[index] = seed


def initial_seed() -> int:
    """The current NPU's seed (``torch_npu.npu.initial_seed``)."""
    return _seeds.get(_index(None), _DEFAULT_SEED)


def _reset() -> None:
    _seeds.clear()
