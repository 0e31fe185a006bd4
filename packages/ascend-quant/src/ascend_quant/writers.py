"""Whole quantized checkpoints from a float Hugging Face folder, for tests and benchmarks.

``write_compressed_tensors`` quantizes with the compressed-tensors library: the float
weights go into a tree of ``torch.nn.Linear`` modules named like the checkpoint,
``apply_quantization_config`` attaches the config's schemes, min-max scales (and, for
static activations, calibrated input scales) are filled in, ``ModelCompressor``
compresses and writes ``quantization_config`` into ``config.json``.
``write_modelslim`` writes msModelSlim's form: quantized tensors plus
``quant_model_description.json`` typing every tensor.

Weights are read and written with safetensors only. Imports no vLLM.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ascend_quant.export import ActivationStats, ct_format, ct_scheme, export_modelslim
from ascend_quant.formats.modelslim import DESCRIPTION_FILE, FLOAT

# Modules that stay float in both writers: embeddings, norms, routers, the LM head.
NEVER_QUANTIZED = re.compile(r".*(embed_tokens|lm_head|norm|mlp\.gate|shared_expert_gate)$")


@dataclass(frozen=True)
class Group:
    """Modules whose names match ``pattern`` (a regex, full match) get ``scheme``."""

    pattern: str
    scheme: str
    group_size: int | None = None
    symmetric: bool = True
    act_symmetric: bool = True
    packed: bool | None = None  # compressed-tensors storage; None: llm-compressor's choice


def read_tensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = f.get_tensor(name)
    return tensors


def copy_side_files(src: Path, dst: Path) -> None:
    """config.json, tokenizer and generation files; not the weights."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and \
                path.name != "model.safetensors.index.json":
            shutil.copy2(path, dst / path.name)


def linear_modules(tensors: dict[str, torch.Tensor]) -> list[str]:
    return sorted(name.removesuffix(".weight") for name, t in tensors.items()
                  if name.endswith(".weight") and t.dim() == 2
                  and not NEVER_QUANTIZED.fullmatch(name.removesuffix(".weight")))


def plan(modules: Iterable[str], groups: Sequence[Group]) -> dict[str, Group]:
    chosen = {}
    for module in modules:
        for group in groups:
            if re.fullmatch(group.pattern, module):
                chosen[module] = group
                break
    return chosen


def calibrate(model_dir: str | Path, modules: Iterable[str], num_prompts: int = 8,
              length: int = 32, seed: int = 0, calibration_ids: torch.Tensor | None = None,
              ) -> dict[str, ActivationStats]:
    """Input ranges of ``modules`` from the float model, over ``calibration_ids`` [B, T]
    (token ids of real text: what a trained model should be calibrated on) or, without them,
    random token prompts."""
    from transformers import AutoModelForCausalLM

    wanted = set(modules)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    ranges: dict[str, list[float]] = {}

    def hook(name):
        def record(_module, args):
            x = args[0].detach()
            low, high = ranges.setdefault(name, [float("inf"), float("-inf")])
            ranges[name] = [min(low, float(x.min())), max(high, float(x.max()))]
        return record

    handles = [module.register_forward_pre_hook(hook(name))
               for name, module in model.named_modules() if name in wanted]
    if calibration_ids is None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(4, model.config.vocab_size, (num_prompts, length), generator=g)
    else:
        ids = calibration_ids
    with torch.no_grad():
        model(input_ids=ids)
    for handle in handles:
        handle.remove()
    missing = wanted - set(ranges)
    if missing:
        raise ValueError(f"calibration saw no input for {sorted(missing)[:4]}")
    return {name: ActivationStats(low, high) for name, (low, high) in ranges.items()}


def _needs_calibration(chosen: dict[str, Group]) -> list[str]:
    return [m for m, g in chosen.items() if g.scheme == "W8A8"]


def _save(tensors: dict[str, torch.Tensor], out: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})


def write_modelslim(src_dir: str | Path, out_dir: str | Path, groups: Sequence[Group],
                    group_size: int | None = None) -> Path:
    """msModelSlim form of the float checkpoint in ``src_dir``."""
    src, out = Path(src_dir), Path(out_dir)
    tensors = read_tensors(src)
    chosen = plan(linear_modules(tensors), groups)
    stats = calibrate(src, _needs_calibration(chosen)) if _needs_calibration(chosen) else {}
    written: dict[str, torch.Tensor] = {}
    description: dict[str, object] = {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        group = chosen.get(module)
        if group is None:
            written[name] = tensor
            description[name] = FLOAT
            continue
        if leaf != "weight":
            continue  # the bias is written with its weight
        stored = export_modelslim(group.scheme, tensor, tensors.get(f"{module}.bias"),
                                  group_size=group_size if group.scheme == "W4A8_DYNAMIC"
                                  else None,
                                  activations=stats.get(module), symmetric=group.symmetric,
                                  act_symmetric=group.act_symmetric)
        for local, value in stored.items():
            written[f"{module}.{local}"] = value
            description[f"{module}.{local}"] = group.scheme
    types = sorted({g.scheme for g in chosen.values()})
    header = {"model_quant_type": types[0] if len(types) == 1 else "MIX",
              "version": "1.0.0"}
    if group_size:
        header["group_size"] = group_size
    copy_side_files(src, out)
    _save(written, out)
    with open(out / DESCRIPTION_FILE, "w", encoding="utf-8") as f:
        json.dump({**header, **description}, f, indent=2)
    return out


def _module_tree(tensors: dict[str, torch.Tensor], modules: Iterable[str]) -> torch.nn.Module:
    """``torch.nn.Linear`` modules holding the float weights, at the checkpoint's paths."""
    root = torch.nn.Module()
    for name in modules:
        parent = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        weight = tensors[f"{name}.weight"]
        bias = tensors.get(f"{name}.bias")
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                                 dtype=weight.dtype, device="meta")
        linear.weight = torch.nn.Parameter(weight.clone(), requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias.clone(), requires_grad=False)
        parent.add_module(leaf, linear)
    return root


def write_compressed_tensors(src_dir: str | Path, out_dir: str | Path, groups: Sequence[Group],
                             ignore: Sequence[str] = ("lm_head",),
                             calibration_ids: torch.Tensor | None = None) -> Path:
    """compressed-tensors form of the float checkpoint in ``src_dir`` (see module doc)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    src, out = Path(src_dir), Path(out_dir)
    tensors = read_tensors(src)
    modules = [m for m in sorted(name.removesuffix(".weight") for name, t in tensors.items()
                                 if name.endswith(".weight") and t.dim() == 2)
               if "embed_tokens" not in m]
    tree = _module_tree(tensors, modules)
    chosen = plan([m for m in modules if not NEVER_QUANTIZED.fullmatch(m)], groups)
    config_groups = {}
    for i, group in enumerate(groups):
        # Exact module names: a regex target would also match the container modules.
        targets = [m for m, g in chosen.items() if g is group]
        if not targets:
            continue
        scheme = ct_scheme(group.scheme, targets, group_size=group.group_size,
                           symmetric=group.symmetric, act_symmetric=group.act_symmetric)
        scheme.format = ct_format(group.scheme, group.packed)
        config_groups[f"group_{i}"] = scheme
    ignore_list = list(ignore) + ["re:.*mlp\\.gate$", "re:.*shared_expert_gate$"]
    config = QuantizationConfig(config_groups=config_groups, ignore=ignore_list)
    apply_quantization_config(tree, config)

    quantized = {name: module for name, module in tree.named_modules()
                 if getattr(module, "quantization_scheme", None) is not None}
    static = [n for n, m in quantized.items() if m.quantization_scheme.input_activations
              is not None and not m.quantization_scheme.input_activations.dynamic]
    stats = calibrate(src, static, calibration_ids=calibration_ids) if static else {}
    for name, module in quantized.items():
        _fill_qparams(module, stats.get(name))
    compressor = ModelCompressor.from_pretrained_model(tree)
    compressor.compress_model(tree)
    written = {k: v for k, v in tensors.items()
               if k.removesuffix(".weight").removesuffix(".bias") not in set(modules)}
    written.update({k: v.detach() for k, v in tree.state_dict().items()})
    copy_side_files(src, out)
    _save(written, out)
    compressor.update_config(str(out))
    return out


def _fill_qparams(module: torch.nn.Module, stats: ActivationStats | None) -> None:
    from ascend_quant.export import ct_qparams

    scheme = module.quantization_scheme
    for key, value in ct_qparams(scheme, module.weight.data).items():
        getattr(module, key).data = value.to(getattr(module, key).dtype)
    args = scheme.input_activations
    if args is not None and not args.dynamic:
        if stats is None:
            raise ValueError("static activation quantization needs calibration")
        scale, zero = stats.scale_and_zero(args.num_bits, args.symmetric)
        module.input_scale.data.fill_(scale)
        if hasattr(module, "input_zero_point"):
            module.input_zero_point.data.fill_(zero)


def write_dequantized_compressed_tensors(quant_dir: str | Path, out_dir: str | Path) -> Path:
    """The float checkpoint a compressed-tensors one stands for: every quantized weight
    decompressed by the compressed-tensors library, ``quantization_config`` removed.
    Serving it shows what a weight-only scheme must reproduce up to float rounding."""
    from compressed_tensors.compressors import BaseCompressor

    from ascend_quant.formats.compressed_tensors import CompressedTensorsFormat

    src, out = Path(quant_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text())
    fmt = CompressedTensorsFormat.from_dict(config.pop("quantization_config"))
    tensors = read_tensors(src)
    probe = torch.nn.Linear(1, 1, device="meta")
    modules = sorted({name.rpartition(".")[0] for name in tensors
                      if name.endswith(".weight_scale")})
    for module in modules:
        scheme = fmt.scheme_for(module, probe)
        if scheme is None:
            raise ValueError(f"{module} has scales but no scheme in the config")
        local = {name.rpartition(".")[2]: t for name, t in tensors.items()
                 if name.rpartition(".")[0] == module}
        compressor = BaseCompressor.get_value_from_registry(fmt.format_of(scheme))
        weight = compressor.decompress(dict(local), scheme)["weight"]
        for leaf in local:
            if leaf != "bias":
                del tensors[f"{module}.{leaf}"]
        tensors[f"{module}.weight"] = weight.to(torch.float32)
    copy_side_files(src, out)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _save(tensors, out)
    return out
