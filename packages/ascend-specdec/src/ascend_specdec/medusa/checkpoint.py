"""Reading and writing Medusa heads: ``config.json`` plus safetensors weights.

Writes what vLLM's ``Medusa.load_weights`` reads, and reads what it reads: names with an optional
``medusa_heads.`` prefix, FasterDecoding's ``{head}.{layer}.linear.*`` / ``{head}.{n}.weight``
names, ``lm_heads.0.weight`` for a shared LM head, and LM-head weights over the whole vocabulary
that a ``token_map`` cuts down to the truncated one. Pickled ``.bin`` / ``.pt`` files are never
loaded (they can run code); convert them to safetensors first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from ascend_specdec.medusa.config import MedusaConfigError, MedusaHeadsConfig
from ascend_specdec.medusa.heads import MedusaHeads

WEIGHTS_FILE = "model.safetensors"
_FASTER_DECODING_NAME = re.compile(r"^(\d+)\.(\d+)\.(.+)$")
_BLOCK_BIAS = re.compile(r"^blocks\.\d+\.layers\.\d+\.bias$")


def save_heads(heads: MedusaHeads, directory: str | Path, dtype: torch.dtype | None = None,
               ) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``directory`` (created)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, tensor in heads.state_dict().items():
        tensor = tensor.detach().cpu()
        if dtype is not None and tensor.is_floating_point():
            tensor = tensor.to(dtype)
        tensors[name] = tensor.contiguous()
    heads.config.save(out)
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    return out


def canonical_name(name: str, config: MedusaHeadsConfig) -> str:
    """The parameter name in MedusaHeads for a checkpoint's tensor name."""
    name = name.removeprefix("medusa_heads.")
    match = _FASTER_DECODING_NAME.match(name)
    if match:
        head, layer, rest = match.groups()
        parts = rest.split(".")
        if "linear" in parts:
            name = f"blocks.{head}.layers.{layer}." + ".".join(parts[parts.index("linear") + 1:])
        else:
            name = f"lm_heads.{head}.{rest}"
    if config.original_lm_head and name == "lm_heads.0.weight":
        name = "lm_head.weight"
    return name


def iter_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    folder = Path(directory)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in folder.iterdir()
                         if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (f" It has {pickles}: pickled weights are not loaded (they can run code); "
                "convert them with safetensors.torch.save_file.") if pickles else ""
        raise MedusaConfigError(f"Medusa heads folder {str(folder)!r} has no *.safetensors."
                                + hint)
    for path in files:
        with safe_open(str(path), framework="pt") as reader:
            for name in reader.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, reader.get_tensor(name)


def load_state(heads: MedusaHeads, weights: Iterable[tuple[str, torch.Tensor]],
               where: str = "checkpoint") -> None:
    """Copy named checkpoint tensors into ``heads``; every parameter must be given."""
    config = heads.config
    params = dict(heads.named_parameters())
    by_name: dict[str, torch.Tensor] = {}
    token_map = None
    stray_biases: list[str] = []
    for raw_name, tensor in weights:
        name = canonical_name(raw_name, config)
        if name == "token_map":
            token_map = tensor
        elif name in params:
            by_name[name] = tensor
        elif _BLOCK_BIAS.match(name) and not config.medusa_fc_bias:
            stray_biases.append(name)
        # Anything else (heads beyond num_heads, other LM heads when one is shared) is unused.
    if stray_biases:
        raise MedusaConfigError(
            f"Medusa heads ({where}): the weights hold residual-block biases "
            f"{sorted(stray_biases)[:3]}{' ...' if len(stray_biases) > 3 else ''} but "
            "config.json says the blocks have none (medusa_fc_bias is false or absent, which "
            "vLLM reads as false and would drop them): set \"medusa_fc_bias\": true in "
            "config.json to serve them, or delete them from the weights")

    if config.is_truncated:
        if token_map is None:
            raise MedusaConfigError(
                f"Medusa heads ({where}): truncated_vocab_size={config.truncated_vocab_size} < "
                f"vocab_size={config.vocab_size} needs a 'token_map' tensor in the weights "
                "(the base-vocabulary id of each kept token)"
            )
        _check_token_map(token_map, config, where)
        heads.token_map = token_map.to(device=heads.token_map.device, dtype=torch.long)

    missing = sorted(set(params) - set(by_name))
    if missing and all(_BLOCK_BIAS.match(name) for name in missing):
        raise MedusaConfigError(
            f"Medusa heads ({where}): config.json says the residual blocks carry a bias "
            f"(medusa_fc_bias: true) but the weights have none for {missing[:3]}"
            f"{' ...' if len(missing) > 3 else ''}: set \"medusa_fc_bias\": false (or remove "
            "the key) in config.json")
    if missing:
        raise MedusaConfigError(f"Medusa heads ({where}): no weights for {missing}; the "
                                f"checkpoint holds {sorted(by_name) or 'none of them'}")
    with torch.no_grad():
        for name, tensor in by_name.items():
            param = params[name]
            if ("lm_head" in name and config.is_truncated
                    and tensor.shape[0] == config.vocab_size != param.shape[0]):
                tensor = tensor[heads.token_map.cpu()]  # a whole-vocabulary head, cut down
            if tuple(tensor.shape) != tuple(param.shape):
                raise MedusaConfigError(
                    f"Medusa heads ({where}): {name} has shape {tuple(tensor.shape)}, expected "
                    f"{tuple(param.shape)} from config.json (hidden_size={config.hidden_size}, "
                    f"draft vocabulary {config.draft_vocab_size})"
                )
            param.copy_(tensor.to(param.dtype))


def _check_token_map(token_map: torch.Tensor, config: MedusaHeadsConfig, where: str) -> None:
    if token_map.dtype.is_floating_point or token_map.dim() != 1:
        raise MedusaConfigError(f"Medusa heads ({where}): token_map must be a 1-D integer "
                                f"tensor, got {token_map.dtype} of shape {tuple(token_map.shape)}")
    if token_map.numel() != config.truncated_vocab_size:
        raise MedusaConfigError(
            f"Medusa heads ({where}): token_map has {token_map.numel()} entries but "
            f"truncated_vocab_size is {config.truncated_vocab_size}"
        )
    if token_map.numel() and (int(token_map.min()) < 0
                              or int(token_map.max()) >= config.vocab_size):
        raise MedusaConfigError(f"Medusa heads ({where}): token_map holds ids outside "
                                f"[0, {config.vocab_size})")


def load_heads(directory: str | Path, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> MedusaHeads:
    """MedusaHeads from a heads folder (config.json + *.safetensors), in ``dtype``."""
    config = MedusaHeadsConfig.load(directory)
    heads = MedusaHeads(config)
    load_state(heads, iter_safetensors(directory), where=str(directory))
    return heads.to(device=device, dtype=dtype).eval()
