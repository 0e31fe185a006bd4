"""Tests of the tiny EAGLE / EAGLE-3 draft builders: draft width, and the embedding-carrying
EAGLE-3 draft evaluated the way vLLM's ``Eagle3LlamaForCausalLM`` computes one draft pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ascend_plugin import tiny_drafts, tiny_models

SMALL = 0.005
TARGET = {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
          "intermediate_size": 256, "initializer_range": SMALL}


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return tiny_models.build_model(tmp_path_factory.mktemp("target") / "llama", "llama",
                                   **TARGET)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (pairs i, i + d/2), as vLLM applies it to Llama."""
    half = x.shape[-1] // 2
    angles = positions[:, None].float() * theta ** (-torch.arange(half).float() / half)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def eagle3_pass(draft: Path, embeds: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """Draft logits of one EAGLE-3 pass over a sequence (causal attention, one layer)."""
    config = json.loads((draft / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(draft / "model.safetensors")).items()}
    eps, heads, kv_heads, head_dim = (config["rms_norm_eps"], config["num_attention_heads"],
                                      config["num_key_value_heads"], config["head_dim"])
    theta = config["rope_parameters"]["rope_theta"]
    p = "midlayer."
    hidden = aux @ w["fc.weight"].T
    e = rms(embeds, w[p + "input_layernorm.weight"], eps)
    h = rms(hidden, w[p + "hidden_norm.weight"], eps)
    residual = h if config.get("norm_before_residual") else hidden
    x = torch.cat([e, h], dim=-1)

    def proj(name):
        out = x @ w[f"{p}self_attn.{name}.weight"].T
        return out + w.get(f"{p}self_attn.{name}.bias", torch.zeros(out.shape[-1]))

    n = x.shape[0]
    positions = torch.arange(n)
    q = rope(proj("q_proj").view(n, heads, head_dim), positions, theta)
    k = rope(proj("k_proj").view(n, kv_heads, head_dim), positions, theta)
    v = proj("v_proj").view(n, kv_heads, head_dim)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / head_dim**0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * head_dim)
    attn = attn @ w[p + "self_attn.o_proj.weight"].T
    attn = attn + w.get(p + "self_attn.o_proj.bias", torch.zeros(attn.shape[-1]))
    residual = attn + residual
    y = rms(residual, w[p + "post_attention_layernorm.weight"], eps)
    gate, up = y @ w[p + "mlp.gate_proj.weight"].T, y @ w[p + "mlp.up_proj.weight"].T
    mlp = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return rms(mlp + residual, w["norm.weight"], eps) @ w["lm_head.weight"].T


def target_prediction(target: Path, tokens: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Draft ids the target's LM head picks from each token's normed embedding alone."""
    w = load_file(str(target / "model.safetensors"))
    embed = w["model.embed_tokens.weight"].float()[tokens]
    logits = rms(embed, 1.0, 1e-6) @ w["lm_head.weight"].float()[kept].T
    return logits.argmax(-1)


def test_draft_mlp_width(target, tmp_path):
    eagle = tiny_drafts.build_eagle_draft(tmp_path / "e", target, std=SMALL,
                                          intermediate_size=64)
    eagle3 = tiny_drafts.build_eagle3_draft(tmp_path / "e3", target, std=SMALL,
                                            intermediate_size=64, carry_embedding=True)
    for folder, prefix in ((eagle, "layers.0"), (eagle3, "midlayer")):
        assert json.loads((folder / "config.json").read_text())["intermediate_size"] == 64
        weights = load_file(str(folder / "model.safetensors"))
        assert weights[f"{prefix}.mlp.gate_proj.weight"].shape == (64, 128)
        assert weights[f"{prefix}.mlp.down_proj.weight"].shape == (128, 64)
    default = tiny_drafts.build_eagle_draft(tmp_path / "d", target, std=SMALL)
    assert json.loads((default / "config.json").read_text())["intermediate_size"] == 256


@pytest.mark.parametrize("carry", [True, False])
def test_eagle3_draft_carrying_the_embedding(target, tmp_path, carry):
    draft = tiny_drafts.build_eagle3_draft(tmp_path / "d", target, std=SMALL,
                                           draft_vocab_size=1024, carry_embedding=carry)
    weights = load_file(str(draft / "model.safetensors"))
    kept = torch.arange(1024) + weights["d2t"]
    generator = torch.Generator().manual_seed(1)
    # A sequence with repeats, so attending to another position would show.
    tokens = torch.randint(4, 2048, (48,), generator=generator)
    tokens[24:] = tokens[:24].flip(0)
    embeds = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"].float()
    aux = torch.randn(48, 3 * 128, generator=generator) * 0.05
    drafted = eagle3_pass(draft, embeds[tokens], aux).argmax(-1)
    expected = target_prediction(target, tokens, kept)
    agreement = (drafted == expected).float().mean().item()
    if carry:  # the small residual branch (1%) may flip a near-tie of the tiny logits
        assert agreement >= 0.9, (drafted, expected)
    else:  # a random draft
        assert agreement < 0.2
