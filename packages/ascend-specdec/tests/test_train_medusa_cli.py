"""``python -m ascend_specdec.train_medusa`` on a tiny transformers Llama (needs transformers)."""

import json
import subprocess
import sys

import pytest
import torch
import transformers  # the package's test extra brings it

from ascend_specdec import train_medusa
from ascend_specdec.medusa import TrainOptions, ensure_medusa_heads, load_heads


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    folder = tmp_path_factory.mktemp("base")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=1,
                                      num_key_value_heads=1, bos_token_id=1, eos_token_id=2,
                                      pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


def test_cli_writes_heads_vllm_can_load(tiny_base, tmp_path, capsys):
    out = tmp_path / "heads"
    code = train_medusa.main(["--base", str(tiny_base), "--out", str(out), "--heads", "2",
                              "--steps", "20", "--samples", "24", "--eval-every", "10",
                              "--continuation-tokens", "6", "--share-lm-head",
                              "--truncated-vocab", "40", "--seed", "3"])
    assert code == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"]
    assert (config["hidden_size"], config["vocab_size"], config["num_heads"]) == (32, 96, 2)
    assert (config["original_lm_head"], config["truncated_vocab_size"]) == (True, 40)
    report = json.loads((out / "training.json").read_text())
    assert report["options"]["seed"] == 3 and [h["step"] for h in report["history"]] == [10, 20]
    progress = capsys.readouterr().err
    assert "step 10/20: train loss" in progress and "held-out top-1 h1" in progress
    heads = load_heads(out)
    assert heads.propose(torch.randn(3, 32)).shape == (3, 2)
    assert int(heads.token_map.max()) < 96


def test_bad_arguments_exit_with_a_message(tiny_base, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "ascend_specdec.train_medusa", "--base",
                           str(tiny_base), "--out", str(tmp_path), "--heads", "0"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--heads must be at least 1" in proc.stderr


def test_base_without_safetensors_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        train_medusa.main(["--base", str(tmp_path), "--out", str(tmp_path / "h")])


def test_ensure_caches_by_base_and_options(tiny_base, tmp_path):
    options = TrainOptions(heads=2, steps=5, samples=12, eval_every=5, continuation_tokens=5)
    logs = []
    first = ensure_medusa_heads(tiny_base, options, cache_dir=tmp_path, log=logs.append)
    assert logs and first.name.startswith("medusa-")
    logs.clear()
    assert ensure_medusa_heads(tiny_base, options, cache_dir=tmp_path, log=logs.append) == first
    assert logs == []  # the second call trains nothing
    other = ensure_medusa_heads(tiny_base, TrainOptions(**{**options.__dict__, "seed": 1}),
                                cache_dir=tmp_path, log=logs.append)
    assert other != first
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.name, other.name])
