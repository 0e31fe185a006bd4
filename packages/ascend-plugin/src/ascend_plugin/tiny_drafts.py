"""Tiny draft models for EAGLE, EAGLE-3 and MTP speculative decoding, built locally.

Companions of ``tiny_models``: nothing is downloaded, weights are random (seeded), builds are
deterministic and cached under the same root (``$ASCEND_PLUGIN_MODEL_CACHE``, default
``~/.cache/ascend-plugin/models``), one folder per distinct set of build arguments.

- ``ensure_eagle_draft(target_dir)``: an EAGLE-1 draft for a Llama target, in the layout vLLM
  loads as ``EagleLlamaForCausalLM`` (``fc`` of [H, 2H] over the token embedding and the
  target's last hidden state, one decoder layer without its input norm; embedding and LM head
  shared with the target).
- ``ensure_eagle3_draft(target_dir)``: an EAGLE-3 draft (``Eagle3LlamaForCausalLM``): ``fc`` of
  [H, 3H] over three of the target's hidden states, one ``midlayer`` whose attention reads
  [embedding, hidden] (2H wide), its own norm and LM head over a truncated draft vocabulary,
  with the ``d2t`` offsets (draft id + d2t = target id) and the ``t2d`` membership mask.
- ``ensure_deepseek_mtp_model()``: a DeepSeek-V3 target (MLA attention, a dense first layer,
  then MoE layers) carrying one multi-token-prediction layer at index ``num_hidden_layers``
  (``enorm``, ``hnorm``, ``eh_proj``, a full decoder block, ``shared_head``), as DeepSeek-V3
  checkpoints do; vLLM's ``method: mtp`` loads that layer as ``DeepSeekMTPModel``. vLLM's CPU
  MLA backend only takes a latent of 512 + rope 64, hence ``kv_lora_rank`` 512 here.
- ``ensure_qwen3_next_mtp_model()``: a tiny Qwen3-Next (``tiny_models``' ``qwen3_next``)
  with Qwen3-Next's MTP weights beside it (``mtp.fc``, its two input norms, one full-attention
  decoder layer, ``mtp.norm``), which vLLM's ``method: mtp`` loads as
  ``Qwen3NextMTP``.

Weights are written straight to safetensors under the names vLLM's loaders read (drafts are
not ``transformers`` models). Requires the ``demo`` extra; imports no vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from ascend_plugin.tiny_models import (
    BUILD_VERSION,
    DEFAULT_INITIALIZER_RANGE,
    build_into_cache,
    build_tokenizer,
    cache_root,
    corpus_digest,
    is_complete,
)

# Bump when a builder here changes what it writes.
DRAFT_BUILD_VERSION = 2

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class DraftBuildError(ValueError):
    """Arguments that cannot make a draft vLLM would load for this target."""


def _log(message: str) -> None:
    import sys

    print(f"[tiny_drafts] {message}", file=sys.stderr, flush=True)


def _read_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DraftBuildError(f"{model_dir} has no config.json: expected a model folder")
    return json.loads(path.read_text(encoding="utf-8"))


class _Weights:
    """Seeded random tensors, created in a fixed order so builds are reproducible."""

    def __init__(self, seed: int, std: float) -> None:
        import torch

        self.generator = torch.Generator().manual_seed(seed)
        self.std = std
        self.tensors: dict[str, Any] = {}

    def matrix(self, name: str, rows: int, cols: int, std: float | None = None) -> None:
        import torch

        scale = self.std if std is None else std
        self.tensors[name] = torch.randn(rows, cols, generator=self.generator) * scale

    def norm(self, name: str, size: int) -> None:
        import torch

        self.tensors[name] = torch.ones(size)

    def save(self, out: Path, dtype: str) -> None:
        import torch
        from safetensors.torch import save_file

        torch_dtype = getattr(torch, dtype)
        tensors = {name: (t.to(torch_dtype) if t.is_floating_point() else t).contiguous()
                   for name, t in self.tensors.items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _attention_and_mlp(weights: _Weights, prefix: str, *, hidden: int, attn_in: int,
                       heads: int, kv_heads: int, head_dim: int, intermediate: int) -> None:
    weights.matrix(f"{prefix}.self_attn.q_proj.weight", heads * head_dim, attn_in)
    weights.matrix(f"{prefix}.self_attn.k_proj.weight", kv_heads * head_dim, attn_in)
    weights.matrix(f"{prefix}.self_attn.v_proj.weight", kv_heads * head_dim, attn_in)
    weights.matrix(f"{prefix}.self_attn.o_proj.weight", hidden, heads * head_dim)
    weights.matrix(f"{prefix}.mlp.gate_proj.weight", intermediate, hidden)
    weights.matrix(f"{prefix}.mlp.up_proj.weight", intermediate, hidden)
    weights.matrix(f"{prefix}.mlp.down_proj.weight", hidden, intermediate)
    weights.norm(f"{prefix}.post_attention_layernorm.weight", hidden)


def _llama_draft_config(target: dict[str, Any], hidden_size: int, **fields: Any) -> dict:
    heads = target["num_attention_heads"]
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": target.get("num_key_value_heads", heads),
        "head_dim": target["hidden_size"] // heads,
        "intermediate_size": target["intermediate_size"],
        "vocab_size": target["vocab_size"],
        "max_position_embeddings": target["max_position_embeddings"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": target.get("bos_token_id"),
        "eos_token_id": target.get("eos_token_id"),
        "dtype": target.get("dtype") or target.get("torch_dtype") or "float32",
    }
    for key in ("rope_parameters", "rope_theta", "rope_scaling"):
        if key in target:
            config[key] = target[key]
    config.update(fields)
    return config


def build_eagle_draft(out_dir: str | os.PathLike, target_dir: str | os.PathLike, *,
                      hidden_size: int | None = None, seed: int = 0,
                      std: float = DEFAULT_INITIALIZER_RANGE,
                      carry_embedding: bool = False,
                      intermediate_size: int | None = None) -> Path:
    """An EAGLE-1 draft for the Llama model in ``target_dir``.

    ``hidden_size`` defaults to the target's; another value makes a draft vLLM cannot run on
    this target (its ``fc`` expects the target's hidden state at the draft's width), which the
    start-up check of our proposer reports.

    ``carry_embedding``: ``fc`` passes the input token's embedding through ([I, 0]) instead of
    being random. On a target whose residual stream is dominated by the token embedding
    (small ``initializer_range``), the shared LM head then predicts from the draft's input
    token what the target predicts from it: a draft with real acceptance, without training.

    ``intermediate_size``: the draft layer's MLP width (default: the target's); a narrower one
    keeps the draft small next to the target.
    """
    target = _read_config(target_dir)
    if target.get("model_type") != "llama":
        raise DraftBuildError(f"EAGLE drafts here are for Llama targets; {target_dir} is "
                              f"model_type={target.get('model_type')!r}")
    hidden = hidden_size or target["hidden_size"]
    config = _llama_draft_config(target, hidden,
                                 intermediate_size=intermediate_size
                                 or target["intermediate_size"])
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    weights = _Weights(seed, std)
    weights.matrix("fc.weight", hidden, 2 * hidden)
    if carry_embedding:
        weights.tensors["fc.weight"] = _pass_first_half(hidden, hidden)
    _attention_and_mlp(weights, "layers.0", hidden=hidden, attn_in=hidden, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim,
                       intermediate=config["intermediate_size"])
    return _write(out_dir, config, weights, target_dir)


def build_eagle3_draft(out_dir: str | os.PathLike, target_dir: str | os.PathLike, *,
                       draft_vocab_size: int | None = 1024, seed: int = 0,
                       std: float = DEFAULT_INITIALIZER_RANGE,
                       carry_embedding: bool = False,
                       intermediate_size: int | None = None) -> Path:
    """An EAGLE-3 draft for the Llama model in ``target_dir``.

    ``draft_vocab_size``: the draft's LM head covers this many target tokens (a seeded random
    subset, always including the special tokens 0..3), mapped by ``d2t``; None gives the full
    vocabulary and no maps.

    ``carry_embedding``: the draft's output is its input token's normed embedding, so on an
    embedding-dominated target (see ``build_eagle_draft``) it predicts what the target predicts
    whenever that token is in the draft vocabulary. EAGLE-3 feeds the embedding only to the
    attention, so the attention passes it through: q and k are a constant bias (weights zero),
    whose rotary score peaks sharply at distance 0, hence each position attends to itself; v
    takes the embedding half of the input ([I, 0], one KV head per head), o is I. The residual
    branch is scaled down (``hidden_norm`` weight 0.01, ``norm_before_residual``) and the LM
    head rows are the target's for the draft vocabulary.

    ``intermediate_size``: the draft layer's MLP width (default: the target's).
    """
    import torch

    target = _read_config(target_dir)
    if target.get("model_type") != "llama":
        raise DraftBuildError(f"EAGLE-3 drafts here are for Llama targets; {target_dir} is "
                              f"model_type={target.get('model_type')!r}")
    hidden, vocab = target["hidden_size"], target["vocab_size"]
    draft_vocab = draft_vocab_size or vocab
    if not 4 <= draft_vocab <= vocab:
        raise DraftBuildError(f"draft_vocab_size={draft_vocab_size} must be between 4 and the "
                              f"target's vocabulary of {vocab}")
    layers = target["num_hidden_layers"]
    if layers < 2:
        raise DraftBuildError(f"an EAGLE-3 draft reads three distinct hidden states of the "
                              f"target; {target_dir} has only {layers} layer(s), need 2 or more")
    # vLLM's default aux layers (2, L // 2, L - 3) fall outside a shallow target and then
    # yield fewer than three states (a shape error at the first draft): name them. Index 0 is
    # the embedding output, index i the output of layer i.
    config = _llama_draft_config(target, hidden, draft_vocab_size=draft_vocab,
                                 target_hidden_size=hidden,
                                 eagle_aux_hidden_state_layer_ids=[0, layers // 2, layers],
                                 intermediate_size=intermediate_size
                                 or target["intermediate_size"])
    if carry_embedding:
        config.update(attention_bias=True, norm_before_residual=True,
                      num_key_value_heads=config["num_attention_heads"])
    heads, kv_heads, head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                 config["head_dim"])
    weights = _Weights(seed, std)
    weights.matrix("fc.weight", hidden, 3 * hidden)
    weights.norm("midlayer.input_layernorm.weight", hidden)
    weights.norm("midlayer.hidden_norm.weight", hidden)
    _attention_and_mlp(weights, "midlayer", hidden=hidden, attn_in=2 * hidden, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim,
                       intermediate=config["intermediate_size"])
    weights.norm("norm.weight", hidden)
    weights.matrix("lm_head.weight", draft_vocab, hidden)
    kept = torch.arange(vocab)
    if draft_vocab < vocab:
        rest = torch.randperm(vocab - 4, generator=weights.generator)[: draft_vocab - 4] + 4
        kept = torch.cat([torch.arange(4), rest.sort().values])
        weights.tensors["d2t"] = kept - torch.arange(draft_vocab)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[kept] = True
        weights.tensors["t2d"] = t2d
    if carry_embedding:
        _carry_through_attention(weights, "midlayer", config, target_dir, target, kept)
    return _write(out_dir, config, weights, target_dir)


def _carry_through_attention(weights: _Weights, prefix: str, config: dict,
                             target_dir: str | os.PathLike, target: dict, kept) -> None:
    """Make an EAGLE-3 layer output its normed input embedding (``build_eagle3_draft``)."""
    import math

    import torch
    from safetensors import safe_open

    hidden, heads, head_dim = (config["hidden_size"], config["num_attention_heads"],
                               config["head_dim"])
    attn = f"{prefix}.self_attn"
    zeros = torch.zeros(heads * head_dim, 2 * hidden)
    weights.tensors[f"{attn}.q_proj.weight"] = zeros
    weights.tensors[f"{attn}.k_proj.weight"] = zeros.clone()
    # Same bias v for q and k on every rotary pair (neox layout: i and i + head_dim / 2): the
    # score between positions d apart is 2 v^2 / sqrt(head_dim) * sum_i cos(d * theta_i),
    # largest at d = 0; at d = 1 it is lower by that scale times about 1.08 (theta_0 = 1 rad),
    # by more at larger d. v is chosen for a margin of 27: the neighbour's weight is e^-27.
    value = math.sqrt(12.5 * math.sqrt(head_dim))
    bias = torch.full((heads * head_dim,), value)
    weights.tensors[f"{attn}.q_proj.bias"] = bias
    weights.tensors[f"{attn}.k_proj.bias"] = bias.clone()
    weights.tensors[f"{attn}.v_proj.weight"] = _pass_first_half(hidden, hidden)
    weights.tensors[f"{attn}.v_proj.bias"] = torch.zeros(hidden)
    weights.tensors[f"{attn}.o_proj.weight"] = torch.eye(hidden)
    weights.tensors[f"{attn}.o_proj.bias"] = torch.zeros(hidden)
    weights.tensors[f"{prefix}.hidden_norm.weight"] = torch.full((hidden,), 0.01)
    tied = target.get("tie_word_embeddings", False)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for path in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as reader:
            if name in reader.keys():  # noqa: SIM118 (not a mapping)
                weights.tensors["lm_head.weight"] = reader.get_tensor(name).float()[kept]
                return
    raise DraftBuildError(f"{target_dir} has no {name} in its safetensors files")


def build_deepseek_mtp_model(out_dir: str | os.PathLike, *, hidden_size: int = 128,
                             num_layers: int = 2, num_heads: int = 2,
                             num_experts: int = 4, experts_per_token: int = 2,
                             intermediate_size: int = 256, moe_intermediate_size: int = 64,
                             seed: int = 0, std: float = DEFAULT_INITIALIZER_RANGE,
                             carry_embedding: bool = False, dtype: str = "float32") -> Path:
    """A DeepSeek-V3 model with one MTP layer, and its tokenizer, in ``out_dir``.

    Layer 0 is dense, layers 1.. and the MTP layer are MoE (``first_k_dense_replace`` 1), as in
    DeepSeek-V3. Attention is MLA with the shapes vLLM's CPU MLA backend supports.
    ``carry_embedding``: the MTP layer's ``eh_proj`` passes the normed token embedding through
    (see ``build_eagle_draft``); with a small ``std`` the MTP layer then has real acceptance.
    """
    from transformers import DeepseekV3Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    vocab = len(tokenizer)
    kv_lora_rank, rope_dim, nope_dim, v_dim = 512, 64, 32, 32
    config = DeepseekV3Config(
        vocab_size=vocab, hidden_size=hidden_size, intermediate_size=intermediate_size,
        moe_intermediate_size=moe_intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_heads, n_shared_experts=1,
        n_routed_experts=num_experts, num_experts_per_tok=experts_per_token, n_group=1,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=kv_lora_rank, q_lora_rank=None,
        qk_rope_head_dim=rope_dim, qk_nope_head_dim=nope_dim, v_head_dim=v_dim,
        num_nextn_predict_layers=1, max_position_embeddings=2048, initializer_range=std,
        tie_word_embeddings=False, rope_interleave=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).to_dict()
    config.update({"architectures": ["DeepseekV3ForCausalLM"], "dtype": dtype,
                   "topk_method": "noaux_tc", "scoring_func": "sigmoid"})
    weights = _Weights(seed, std)
    weights.matrix("model.embed_tokens.weight", vocab, hidden_size)

    def decoder_layer(i: int) -> None:
        p = f"model.layers.{i}"
        weights.norm(f"{p}.input_layernorm.weight", hidden_size)
        weights.matrix(f"{p}.self_attn.q_proj.weight", num_heads * (nope_dim + rope_dim),
                       hidden_size)
        weights.matrix(f"{p}.self_attn.kv_a_proj_with_mqa.weight", kv_lora_rank + rope_dim,
                       hidden_size)
        weights.norm(f"{p}.self_attn.kv_a_layernorm.weight", kv_lora_rank)
        weights.matrix(f"{p}.self_attn.kv_b_proj.weight", num_heads * (nope_dim + v_dim),
                       kv_lora_rank, std=std / 4)
        weights.matrix(f"{p}.self_attn.o_proj.weight", hidden_size, num_heads * v_dim)
        weights.norm(f"{p}.post_attention_layernorm.weight", hidden_size)
        if i == 0:
            for name, rows, cols in (("gate_proj", intermediate_size, hidden_size),
                                     ("up_proj", intermediate_size, hidden_size),
                                     ("down_proj", hidden_size, intermediate_size)):
                weights.matrix(f"{p}.mlp.{name}.weight", rows, cols)
            return
        import torch

        weights.matrix(f"{p}.mlp.gate.weight", num_experts, hidden_size)
        weights.tensors[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(num_experts)
        experts = [f"experts.{e}" for e in range(num_experts)] + ["shared_experts"]
        for expert in experts:
            for name, rows, cols in (("gate_proj", moe_intermediate_size, hidden_size),
                                     ("up_proj", moe_intermediate_size, hidden_size),
                                     ("down_proj", hidden_size, moe_intermediate_size)):
                weights.matrix(f"{p}.mlp.{expert}.{name}.weight", rows, cols)

    for i in range(num_layers):
        decoder_layer(i)
    weights.norm("model.norm.weight", hidden_size)
    weights.matrix("lm_head.weight", vocab, hidden_size)
    # The MTP layer: its own norms and projection, a full decoder block, and (as DeepSeek-V3
    # checkpoints ship them) copies of the embedding and the LM head.
    mtp = f"model.layers.{num_layers}"
    weights.norm(f"{mtp}.enorm.weight", hidden_size)
    weights.norm(f"{mtp}.hnorm.weight", hidden_size)
    weights.matrix(f"{mtp}.eh_proj.weight", hidden_size, 2 * hidden_size)
    if carry_embedding:  # DeepSeek's eh_proj input is [enorm(embedding), hnorm(hidden)]
        weights.tensors[f"{mtp}.eh_proj.weight"] = _pass_first_half(hidden_size, hidden_size)
    decoder_layer(num_layers)
    weights.norm(f"{mtp}.shared_head.norm.weight", hidden_size)
    weights.tensors[f"{mtp}.shared_head.head.weight"] = weights.tensors["lm_head.weight"].clone()
    weights.tensors[f"{mtp}.embed_tokens.weight"] = (
        weights.tensors["model.embed_tokens.weight"].clone())
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")
    weights.save(out, dtype)
    _log(f"built DeepSeek-V3 + MTP model ({sum(t.numel() for t in weights.tensors.values()):,} "
         f"values) in {out}")
    return out


def build_qwen3_next_mtp_model(out_dir: str | os.PathLike, *, num_layers: int = 4,
                               mlp_only_layers: tuple[int, ...] = (1, 2, 3),
                               experts_per_token: int = 8,
                               std: float = DEFAULT_INITIALIZER_RANGE,
                               carry_embedding: bool = False, dtype: str = "bfloat16",
                               lm_head_scale: float = 1.0, linear_attention_scale: float = 1.0,
                               linear_attention_decay: float | None = None,
                               seed: int = 0) -> Path:
    """``tiny_models.build_model(kind="qwen3_next", ...)`` plus one MTP layer in
    ``mtp.safetensors`` and ``num_nextn_predict_layers: 1``.

    The MTP decoder layer is a full-attention layer at index 0 with an MoE block (vLLM's
    ``Qwen3NextMTP`` needs one, so layer 0 must not be in ``mlp_only_layers``): its attention
    is a copy of the model's first full-attention layer's, its MoE block of layer 0's, with
    random perturbations of ``std``. ``experts_per_token`` defaults to all 8 experts: no
    routing choice to round apart between two runs in bfloat16. ``lm_head_scale`` multiplies
    the LM head (shared by the MTP layer): with a small ``std`` the logits are nearly flat,
    and a larger head spreads them so that greedy choices are rarely near-ties.
    ``linear_attention_scale`` multiplies the gated delta-net layers' output projections and
    ``linear_attention_decay`` sets their heads' decay rate ``A = exp(A_log)``: randomly
    initialised states forget within a few tokens and add little to the residual, so a test
    that must see them (where a speculative step resumes) makes them matter.
    ``carry_embedding``: ``mtp.fc`` passes the normed token embedding through (its input is
    [embedding, hidden]), so with a small ``std`` the MTP layer has real acceptance.
    """
    import math

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ascend_plugin.tiny_models import build_model

    if 0 in mlp_only_layers:
        raise DraftBuildError(f"mlp_only_layers={list(mlp_only_layers)}: vLLM's Qwen3NextMTP "
                              "needs an MoE block in its layer (index 0); leave 0 out")
    out = build_model(out_dir, "qwen3_next", num_layers=num_layers, dtype=dtype, seed=seed,
                      mlp_only_layers=list(mlp_only_layers), initializer_range=std,
                      num_experts_per_tok=experts_per_token)
    config = _read_config(out)
    layer_types = config.get("layer_types") or []
    if "full_attention" not in layer_types:
        raise DraftBuildError(f"num_layers={num_layers}: the model has no full-attention "
                              f"layer to copy (layer_types {layer_types})")
    attention_layer = layer_types.index("full_attention")
    with safe_open(str(out / "model.safetensors"), framework="pt") as reader:
        base = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118
    for name, tensor in base.items():
        if name == "lm_head.weight":
            base[name] = tensor * lm_head_scale
        elif name.endswith("linear_attn.out_proj.weight"):
            base[name] = tensor * linear_attention_scale
        elif name.endswith("linear_attn.A_log") and linear_attention_decay is not None:
            base[name] = torch.full_like(tensor, math.log(linear_attention_decay))
    save_file(base, str(out / "model.safetensors"), metadata={"format": "pt"})
    base = {name: tensor.float() for name, tensor in base.items()}
    hidden = config["hidden_size"]
    weights = _Weights(seed + 1, std)
    for name, tensor in base.items():
        for source, part in ((f"model.layers.{attention_layer}.self_attn.", "self_attn."),
                             (f"model.layers.{attention_layer}.input_layernorm",
                              "input_layernorm"),
                             ("model.layers.0.mlp.", "mlp."),  # its MoE block
                             ("model.layers.0.post_attention_layernorm",
                              "post_attention_layernorm")):
            if name.startswith(source):
                target = "mtp.layers.0." + part + name[len(source):]
                noise = torch.randn(tensor.shape, generator=weights.generator) * std
                weights.tensors[target] = tensor + (noise if tensor.dim() > 1 else 0)
    # Qwen3-Next's norms scale by (1 + weight): zeros are the identity.
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights.tensors[f"mtp.{norm}.weight"] = torch.zeros(hidden)
    weights.matrix("mtp.fc.weight", hidden, 2 * hidden)
    if carry_embedding:
        weights.tensors["mtp.fc.weight"] = _pass_first_half(hidden, hidden)
    torch_dtype = getattr(torch, dtype)
    save_file({name: t.to(torch_dtype).contiguous() for name, t in weights.tensors.items()},
              str(out / "mtp.safetensors"), metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")
    _log(f"built Qwen3-Next + MTP model in {out}")
    return out


def _pass_first_half(rows: int, half: int):
    """[I, 0]: a projection of [a, b] (each ``half`` wide) that returns a."""
    import torch

    return torch.cat([torch.eye(rows, half), torch.zeros(rows, half)], dim=1)


def _write(out_dir: str | os.PathLike, config: dict, weights: _Weights,
           target_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n",
                                     encoding="utf-8")
    weights.save(out, str(config["dtype"]))
    # vLLM reads the draft folder's tokenizer files when it has them; keep the target's.
    for name in TOKENIZER_FILES:
        source = Path(target_dir) / name
        if source.is_file():
            shutil.copyfile(source, out / name)
    return out


# --------------------------------------------------------------------------- cache

_BUILDERS = {
    "eagle": build_eagle_draft,
    "eagle3": build_eagle3_draft,
    "deepseek_mtp": build_deepseek_mtp_model,
    "qwen3_next_mtp": build_qwen3_next_mtp_model,
}


def _key(kind: str, arguments: dict[str, Any]) -> str:
    import torch

    identity = {"kind": kind, "arguments": arguments, "corpus": corpus_digest(),
                "build_version": [BUILD_VERSION, DRAFT_BUILD_VERSION],
                "torch": torch.__version__.split("+")[0]}
    blob = json.dumps(identity, sort_keys=True, default=repr).encode("utf-8")
    return f"{kind}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _ensure(kind: str, **arguments: Any) -> Path:
    # A target folder is named by its own build hash, so its path identifies its weights.
    key = _key(kind, {k: str(v) if isinstance(v, Path) else v for k, v in arguments.items()})
    root = cache_root()
    final = root / key
    if is_complete(final):
        return final
    build_into_cache(final, {"key": key, "kind": kind, "arguments": arguments},
                     lambda staging: _BUILDERS[kind](staging, **arguments))
    _log(f"{kind} ready in {final}")
    return final


def ensure_eagle_draft(target_dir: str | os.PathLike, **kwargs: Any) -> Path:
    """The cached folder of ``build_eagle_draft(target_dir=target_dir, **kwargs)``."""
    return _ensure("eagle", target_dir=str(Path(target_dir).resolve()), **kwargs)


def ensure_eagle3_draft(target_dir: str | os.PathLike, **kwargs: Any) -> Path:
    """The cached folder of ``build_eagle3_draft(target_dir=target_dir, **kwargs)``."""
    return _ensure("eagle3", target_dir=str(Path(target_dir).resolve()), **kwargs)


def ensure_deepseek_mtp_model(**kwargs: Any) -> Path:
    """The cached folder of ``build_deepseek_mtp_model(**kwargs)``."""
    return _ensure("deepseek_mtp", **kwargs)


def ensure_qwen3_next_mtp_model(**kwargs: Any) -> Path:
    """The cached folder of ``build_qwen3_next_mtp_model(**kwargs)``."""
    return _ensure("qwen3_next_mtp", **kwargs)
