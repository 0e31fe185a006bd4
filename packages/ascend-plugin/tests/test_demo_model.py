"""The committed demo model is found, checked whole, and never replaced by something else."""

from __future__ import annotations

import json
import shutil

import pytest

from ascend_plugin import demo_model
from ascend_plugin.demo_model import DemoModelError, check_model_files, demo_model_dir


@pytest.fixture()
def model_copy(tmp_path):
    source = demo_model_dir()
    target = tmp_path / "pycoder"
    shutil.copytree(source, target)
    return target


def test_demo_model_is_the_committed_trained_llama():
    folder = demo_model_dir()
    config = json.loads((folder / "config.json").read_text())
    record = json.loads((folder / "training.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["dtype"] == "bfloat16"
    assert (folder / "model.safetensors").stat().st_size <= 55 * 2**20
    # It learned something: held-out loss far below the unigram baseline of the same tokens.
    assert record["held_out"]["loss_bf16_weights"] < record["held_out"]["unigram_loss"] - 3
    assert len(demo_model.held_out_texts(folder)) >= 100


def test_env_var_points_elsewhere_and_a_missing_folder_is_named(monkeypatch, tmp_path):
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(demo_model.DEMO_MODEL_ENV, str(missing))
    with pytest.raises(DemoModelError, match="nowhere.*does not exist.*--model PATH"):
        demo_model_dir()


def test_env_var_selects_a_whole_copy(monkeypatch, model_copy):
    monkeypatch.setenv(demo_model.DEMO_MODEL_ENV, str(model_copy))
    assert demo_model_dir() == model_copy


def test_missing_file_is_named(model_copy):
    (model_copy / "tokenizer.json").unlink()
    with pytest.raises(DemoModelError, match=r"tokenizer\.json is missing"):
        check_model_files(model_copy)


@pytest.mark.parametrize("keep", [4, 8 + 100, -1])
def test_truncated_weights_are_refused_with_the_file_named(model_copy, keep):
    weights = model_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:keep])
    with pytest.raises(DemoModelError, match=r"model\.safetensors.*truncated"):
        check_model_files(model_copy)


def test_demo_refuses_a_broken_model_instead_of_serving_another(monkeypatch, model_copy,
                                                                 capsys):
    from ascend_plugin import demo

    weights = model_copy / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    monkeypatch.setenv(demo_model.DEMO_MODEL_ENV, str(model_copy))
    assert demo.main([]) == 2
    assert "truncated" in capsys.readouterr().err
