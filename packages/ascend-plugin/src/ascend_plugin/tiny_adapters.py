"""Random LoRA adapters for the tiny test models, saved in peft's format.

What vLLM's ``--lora-modules`` / ``LoRARequest`` load: a folder with ``adapter_config.json``
(``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``) and
``adapter_model.safetensors`` holding, per adapted linear layer,
``base_model.model.<module path>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
``[out, r]``. peft itself initialises B to zero (an adapter that changes nothing until
trained); here both are random, so that every adapter visibly changes the model's output
and two adapters change it differently.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ascend_plugin.tiny_models import build_into_cache, cache_root, is_complete

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _linear_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each adaptable linear layer of a Llama / Qwen2 decoder layer."""
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    inter = config["intermediate_size"]
    return {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
            "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def _module_path(name: str, layer: int) -> str:
    block = "self_attn" if name in ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{name}"


def build_lora_adapter(out_dir: str | os.PathLike, model_dir: str | os.PathLike, *,
                       rank: int = 8, alpha: int = 16, seed: int = 0,
                       target_modules: tuple[str, ...] = ATTENTION + MLP,
                       b_std: float = 0.05) -> Path:
    """A random rank-``rank`` adapter of ``model_dir``'s decoder layers, in peft's format."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    shapes = _linear_shapes(config)
    unknown = sorted(set(target_modules) - set(shapes))
    if unknown:
        raise ValueError(f"target_modules {unknown} are not linear layers of this model; "
                         f"choose from {sorted(shapes)}")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name in target_modules:
            out_features, in_features = shapes[name]
            path = _module_path(name, layer)
            tensors[f"{path}.lora_A.weight"] = (
                torch.randn(rank, in_features, generator=gen) / in_features ** 0.5)
            tensors[f"{path}.lora_B.weight"] = torch.randn(out_features, rank,
                                                           generator=gen) * b_std
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "lora_dropout": 0.0, "target_modules": list(target_modules), "bias": "none",
        "base_model_name_or_path": str(model_dir), "fan_in_fan_out": False,
        "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n",
                                             encoding="utf-8")
    return out


def ensure_lora_adapter(model_dir: str | os.PathLike, **kwargs) -> Path:
    """The folder of ``build_lora_adapter(model_dir, **kwargs)``, built once per model build
    (the model folder's name is its build key) and arguments."""
    identity = json.dumps({"model": Path(model_dir).name, **kwargs}, sort_keys=True)
    key = f"lora-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    final = cache_root() / "adapters" / key
    if not is_complete(final):
        build_into_cache(final, {"key": key, "model": str(model_dir), "arguments": kwargs},
                         lambda staging: build_lora_adapter(staging, model_dir, **kwargs))
    return final
