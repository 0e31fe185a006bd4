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
    # Saved in float32 (the base's dtype): the served estimate is the trainer's own.
    assert report["served"] == report["final"]
    progress = capsys.readouterr().err
    assert "step 10/20: train loss" in progress and "held-out top-1 h1" in progress
    assert "held-out estimate as served (float32)" in progress
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


# --- prompts from a file (your traffic) ----------------------------------------------------


def _tokenizer(vocab_size: int = 96):
    """A real (tokenizers) word-level tokenizer over the tiny base's ids, with a chat
    template, saved the way a model folder holds it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        chat_template="{% for m in messages %}w5 {{ m['content'] }} {% endfor %}"
                      "{% if add_generation_prompt %}w6{% endif %}")


def test_prompts_files_give_one_prompt_per_line_or_record(tmp_path):
    from ascend_specdec.medusa.base_model import read_prompts_file

    text = tmp_path / "prompts.txt"
    text.write_text("w3 w4\n\n  \nw7 w8 w9\n")
    assert read_prompts_file(text) == ["w3 w4", "w7 w8 w9"]
    jsonl = tmp_path / "traffic.jsonl"
    jsonl.write_text('{"prompt": "w10 w11"}\n\n'
                     '{"messages": [{"role": "user", "content": "w12 w13"}]}\n')
    assert read_prompts_file(jsonl, _tokenizer()) == ["w10 w11", "w5 w12 w13 w6"]
    for content, message in [
            ('{"prompt": "w3"}\nnot json\n', "line 2 is not JSON"),
            ('{"text": "w3"}\n', 'line 1: expected an object with "prompt"'),
            ('\n\n', "holds no prompt")]:
        jsonl.write_text(content)
        with pytest.raises(ValueError, match=message):
            read_prompts_file(jsonl, _tokenizer())
    jsonl.write_text('{"messages": [{"role": "user", "content": "w3"}]}\n')
    with pytest.raises(ValueError, match="no chat template"):
        read_prompts_file(jsonl, None)
    with pytest.raises(FileNotFoundError, match="is not a file"):
        read_prompts_file(tmp_path / "missing.jsonl")


def test_file_prompts_are_used_once_and_the_held_out_ones_come_first():
    from ascend_specdec.medusa.training import file_prompt_batches

    prompts = [torch.arange(10, 10 + n) for n in (3, 8, 5, 6, 12, 4, 7, 9, 3, 5)]
    prompts[2] = torch.cat([torch.tensor([1]), prompts[2]])  # a prompt that starts with BOS
    options = TrainOptions(samples=8, holdout=0.25, generation_batch=3, max_prompt_tokens=6)
    batches, held = file_prompt_batches(prompts, options, 1, torch.Generator().manual_seed(0))
    assert held == 2 and sum(len(b) for b in batches) == 8  # samples caps the 10 prompts
    assert len(batches[0]) == 2  # the held-out prompts form their own batch, first
    seen = []
    for batch in batches:
        assert (batch[:, 0] == 1).all() and not (batch[:, 1:] == 1).any()  # one BOS each
        assert batch.shape[1] - 1 <= 6
        for row in batch[:, 1:].tolist():
            owner = [i for i, p in enumerate(prompts)
                     if p[-len(row):].tolist() == row and i not in seen]
            assert owner, row  # every row is the end of a prompt
            seen.append(owner[0])
    assert len(set(seen)) == 8  # none twice
    with pytest.raises(ValueError, match="give at least 2 prompts"):
        file_prompt_batches(prompts[:1], options, 1, torch.Generator())


def test_cli_trains_on_a_prompts_file(tiny_base, tmp_path, capsys):
    import shutil

    base = tmp_path / "base"
    shutil.copytree(tiny_base, base)
    _tokenizer().save_pretrained(str(base))
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(
        f'{{"prompt": "w{3 + i % 40} w{4 + i % 50} w{5 + i % 30} w{9 + i % 20}"}}\n'
        if i % 2 else f'{{"messages": [{{"role": "user", "content": "w{7 + i % 60} w8"}}]}}\n'
        for i in range(20)))
    out = tmp_path / "heads"
    code = train_medusa.main(["--base", str(base), "--out", str(out), "--heads", "2",
                              "--steps", "10", "--samples", "16", "--eval-every", "10",
                              "--continuation-tokens", "6", "--holdout", "0.25",
                              "--prompts-file", str(traffic)])
    bf16 = tmp_path / "heads-bf16"
    assert train_medusa.main(["--base", str(base), "--out", str(bf16), "--heads", "2",
                              "--steps", "10", "--samples", "16", "--eval-every", "10",
                              "--continuation-tokens", "6", "--prompts-file", str(traffic),
                              "--dtype", "bfloat16"]) == 0
    assert code == 0
    progress = capsys.readouterr().err
    assert "held-out estimate as served (bfloat16)" in progress
    assert f"the 20 prompts of {traffic}" in progress
    assert "generating greedy continuations: 16/16" in progress
    report = json.loads((out / "training.json").read_text())
    assert report["options"]["prompts_file"] == str(traffic)
    assert "held-out estimate as served (float32)" in progress
    # 4 held-out prompts of 16, each continuation 6 tokens: their rows are the held-out rows.
    assert report["rows"]["held_out"] * 3 == report["rows"]["train"]
    assert train_medusa.main(["--base", str(base), "--out", str(out), "--prompts-file",
                              str(traffic), "--prompt-text", str(traffic)]) == 2


def test_the_served_estimate_runs_the_heads_in_the_served_dtype():
    """Targets are the float32 heads' own drafts, so float32 scores every row; in bfloat16
    near-ties flip some drafts, and the served estimate must see that."""
    from ascend_specdec.medusa.training import DistillationSet, evaluate, served_estimate

    from medusa_cases import random_heads

    heads = random_heads(seed=4)
    features = torch.randn(4000, 16, generator=torch.Generator().manual_seed(5))
    held_out = DistillationSet(features, heads.propose(features))
    assert evaluate(heads, held_out).top1 == [1.0, 1.0, 1.0]
    assert served_estimate(heads, held_out, torch.float32).top1 == [1.0, 1.0, 1.0]
    served = served_estimate(heads, held_out, torch.bfloat16)
    assert min(served.top1) < 1.0 and served.acceptance_length < 4.0
    assert heads.head_weight(0).dtype == torch.float32  # the trained heads are not cast


def test_trained_heads_record_their_paths_and_measure_paths_rewrites_them(tiny_base, tmp_path,
                                                                         capsys):
    from ascend_specdec.medusa.tree import PATHS_FILE, choose_tree

    out = tmp_path / "heads"
    assert train_medusa.main(["--base", str(tiny_base), "--out", str(out), "--heads", "2",
                              "--steps", "20", "--samples", "48", "--eval-every", "10",
                              "--continuation-tokens", "8", "--seed", "3"]) == 0
    record = json.loads((out / PATHS_FILE).read_text())
    report = json.loads((out / "training.json").read_text())
    frequencies = [(tuple(path), share) for path, share in record["paths"]]
    assert record["rows"] > 0 and frequencies
    assert all(0 < share <= 1 for _, share in frequencies)
    shares = dict(frequencies)
    # A path is accepted only where its parent is: never more often.
    assert all(shares[path[:-1]] >= share for path, share in frequencies if len(path) > 1)
    for budget, tree in record["trees"].items():
        assert len(tree["paths"]) == int(budget)
        assert report["trees"][budget] == tree["acceptance_length"]
        assert [list(p) for p in choose_tree(record["paths"], int(budget),
                                             num_heads=2).paths] == tree["paths"]
    assert "tree of 4 nodes (medusa_tree_config auto" in capsys.readouterr().err
    (out / PATHS_FILE).unlink()
    assert train_medusa.main(["--base", str(tiny_base), "--out", str(out), "--heads", "2",
                              "--samples", "48", "--continuation-tokens", "8", "--seed", "4",
                              "--measure-paths"]) == 0
    measured = json.loads((out / PATHS_FILE).read_text())
    assert measured["rows"] > 0 and measured["paths"] and "chain_acceptance_length" in measured
    assert "measuring the paths of" in capsys.readouterr().err
