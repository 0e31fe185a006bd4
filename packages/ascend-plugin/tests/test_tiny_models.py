"""Tests of the locally built tiny models: tokenizer, determinism, cache, loading."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ascend_plugin import tiny_models

# Smaller than the defaults, still a head_dim vLLM's CPU attention accepts.
TINY = {"hidden_size": 64, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1,
        "intermediate_size": 64}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {kind: tiny_models.build_model(root / kind, kind)
            for kind in ("llama", "qwen2", "qwen2_moe")}


@pytest.fixture
def cache_root(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(tiny_models.CACHE_ENV_VAR, str(root))
    return root


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trips_text_and_has_special_tokens(tmp_path):
    from transformers import AutoTokenizer

    tiny_models.build_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)

    assert len(tokenizer) == tiny_models.DEFAULT_VOCAB_SIZE
    assert [tokenizer.convert_tokens_to_ids(t) for t in ("<unk>", "<s>", "</s>", "<pad>")] == [
        0, 1, 2, 3]
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token,
            tokenizer.unk_token) == ("<s>", "</s>", "<pad>", "<unk>")
    for text in ("hello world", "  def f(x):\n\treturn x ** 2  ", "héllo wörld, 你好 🙂"):
        ids = tokenizer(text).input_ids
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Trained merges: common words are fewer tokens than bytes.
    assert len(tokenizer("the function returns").input_ids) < 10


def test_chat_template_renders_turns_and_generation_prompt(tmp_path):
    from transformers import AutoTokenizer

    tiny_models.build_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hello world"}]

    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nhello world</s>\n<|assistant|>\n"
    without = tokenizer.apply_chat_template(messages, tokenize=False)
    assert without == prompt.removesuffix("<|assistant|>\n")


def test_tokenizer_training_is_deterministic_across_processes():
    code = ("import hashlib; from ascend_plugin import tiny_models as t; "
            "print(hashlib.sha256(t._trained_tokenizer_json(2048).encode()).hexdigest())")
    src = str(Path(tiny_models.__file__).parents[1])
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={"PYTHONPATH": src, "PYTHONHASHSEED": "123"})
    here = hashlib.sha256(tiny_models._trained_tokenizer_json(2048).encode()).hexdigest()
    assert other.stdout.strip() == here


# --------------------------------------------------------------------------- models


@pytest.mark.parametrize("kind", ["llama", "qwen2_moe"])
def test_builds_are_byte_identical(tmp_path, kind):
    first = tiny_models.build_model(tmp_path / "a", kind, **TINY)
    tiny_models._trained_tokenizer_json.cache_clear()  # train the tokenizer again
    second = tiny_models.build_model(tmp_path / "b", kind, **TINY)

    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert sha256(first / name) == sha256(second / name), name


def test_different_seeds_give_different_weights(tmp_path):
    first = tiny_models.build_model(tmp_path / "a", **TINY, seed=0)
    second = tiny_models.build_model(tmp_path / "b", **TINY, seed=1)
    assert sha256(first / "model.safetensors") != sha256(second / "model.safetensors")
    assert sha256(first / "tokenizer.json") == sha256(second / "tokenizer.json")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen2_moe"])
def test_models_load_and_greedy_continuations_depend_on_the_prompt(built_models, kind):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = built_models[kind]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    assert type(model).__name__ == tiny_models._MODEL_CLASSES[kind][1]
    assert model.dtype == torch.float32

    continuations = []
    for prompt in ("hello world", "The capital of France is"):
        inputs = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            output = model.generate(**inputs, max_new_tokens=8, do_sample=False)
        continuations.append(output[0, inputs.input_ids.shape[1]:].tolist())
    assert continuations[0] != continuations[1]
    assert len(set(continuations[0])) > 1  # not one token repeated


def test_qwen2_moe_config_has_the_asked_expert_counts(built_models, tmp_path):
    config = json.loads((built_models["qwen2_moe"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (config["num_experts"], config["num_experts_per_tok"],
            config["moe_intermediate_size"]) == (8, 2, 64)
    assert config["shared_expert_intermediate_size"] > 0

    tiny_models.build_model(tmp_path, "qwen2_moe", **TINY, num_experts=4, num_experts_per_tok=1)
    config = json.loads((tmp_path / "config.json").read_text())
    assert (config["num_experts"], config["num_experts_per_tok"]) == (4, 1)


def test_vocab_size_pads_the_embedding(tmp_path):
    from safetensors import safe_open

    tiny_models.build_model(tmp_path, **TINY, vocab_size=3000)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as weights:
        assert weights.get_slice("model.embed_tokens.weight").get_shape() == [3000, 64]
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == 3000


@pytest.mark.parametrize(
    ("arguments", "message"),
    [({"hidden_size": 64, "num_heads": 4}, "head_dim"),
     ({"num_heads": 4, "num_kv_heads": 3}, "multiple"),
     ({"dtype": "int8"}, "dtype"),
     ({"kind": "gpt2"}, "unknown model kind")],
)
def test_bad_arguments_are_refused(tmp_path, arguments, message):
    with pytest.raises(ValueError, match=message):
        tiny_models.build_model(tmp_path, **arguments)


# --------------------------------------------------------------------------- cache


def test_ensure_model_builds_once_and_reuses(cache_root, monkeypatch):
    calls = []
    real_build = tiny_models.build_model

    def counting_build(*args, **kwargs):
        calls.append(args)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(tiny_models, "build_model", counting_build)

    first = tiny_models.ensure_model("llama", **TINY)
    marker_mtime = (first / tiny_models.COMPLETE_MARKER).stat().st_mtime_ns
    second = tiny_models.ensure_model("llama", **TINY)

    assert first == second
    assert first.parent == cache_root and first.name.startswith("llama-")
    assert len(calls) == 1
    assert (second / tiny_models.COMPLETE_MARKER).stat().st_mtime_ns == marker_mtime
    assert sorted(p.name for p in cache_root.iterdir()) == [first.name]  # no staging left

    other = tiny_models.ensure_model("llama", **TINY, seed=1)
    assert other != first and len(calls) == 2


def test_build_key_fills_in_defaults():
    assert tiny_models.build_key("llama") == tiny_models.build_key("llama", hidden_size=128)
    assert tiny_models.build_key("llama") != tiny_models.build_key("qwen2")
    assert tiny_models.build_key("llama") != tiny_models.build_key("llama", rope_theta=500.0)


def test_interrupted_build_never_looks_complete(cache_root, monkeypatch):
    real_save = tiny_models.build_tokenizer

    def failing_build(out_dir, vocab_size=2048):
        real_save(out_dir, vocab_size)
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny_models, "build_tokenizer", failing_build)
    with pytest.raises(KeyboardInterrupt):
        tiny_models.ensure_model("llama", **TINY)
    assert not any(cache_root.iterdir())

    monkeypatch.setattr(tiny_models, "build_tokenizer", real_save)
    path = tiny_models.ensure_model("llama", **TINY)
    assert tiny_models.is_complete(path) and (path / "model.safetensors").is_file()


def test_folder_without_marker_is_rebuilt(cache_root):
    stale = cache_root / tiny_models.build_key("llama", **TINY)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")

    path = tiny_models.ensure_model("llama", **TINY)
    assert path == stale and tiny_models.is_complete(path)
    assert json.loads((path / "config.json").read_text())["hidden_size"] == 64
