"""Finding the scheme class for a name in ascend-core's QUANT_SCHEMES, with the errors a
user needs when there is none."""

from __future__ import annotations

from ascend_core.registry import QUANT_SCHEMES
from ascend_quant.errors import QuantConfigError

MOE_PREFIX = "moe:"


def _ensure_registered() -> None:
    import ascend_quant

    ascend_quant.register()


def supported_names(layout: str, moe: bool = False) -> list[str]:
    """Scheme names served for a checkpoint layout (linear layers, or MoE experts)."""
    _ensure_registered()
    names = []
    for name in QUANT_SCHEMES.names():
        is_moe = name.startswith(MOE_PREFIX)
        if is_moe != moe:
            continue
        cls = QUANT_SCHEMES.get(name)
        if layout in getattr(cls, "layouts", (layout,)):
            names.append(name.removeprefix(MOE_PREFIX))
    return names


def scheme_class(name: str, layout: str, layer: str, moe: bool = False):
    """The scheme class serving ``name`` in ``layout``; QuantConfigError naming the layer
    and the supported list otherwise."""
    _ensure_registered()
    cls = QUANT_SCHEMES.find(MOE_PREFIX + name if moe else name)
    if cls is None or layout not in getattr(cls, "layouts", (layout,)):
        what = "MoE experts" if moe else "linear layers"
        raise QuantConfigError(
            f"layer {layer!r}: quantization scheme {name!r} ({layout}) is not supported for "
            f"{what}; supported: {', '.join(supported_names(layout, moe)) or 'none'}")
    return cls
