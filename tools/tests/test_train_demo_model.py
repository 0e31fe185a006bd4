"""The demo model's corpus is deterministic, holds out whole files, and refuses damage."""

import gzip
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import train_demo_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "stdlib.jsonl.gz"
    train_demo_model.write_corpus(out)
    return out


def test_the_corpus_is_the_same_bytes_every_time(corpus, tmp_path):
    again = tmp_path / "again.jsonl.gz"
    train_demo_model.write_corpus(again)
    assert again.read_bytes() == corpus.read_bytes()


def test_whole_files_are_held_out_by_a_hash_of_their_path(corpus):
    header, docs = train_demo_model.read_corpus(corpus)
    held = [d for d in docs if d["split"] == "held_out"]
    assert header["documents"] == len(docs) > 1000
    assert 0.01 < len(held) / len(docs) < 0.05
    assert all(train_demo_model.is_held_out(d["path"]) for d in held)
    assert len({d["path"] for d in docs}) == len(docs)  # one document per file
    assert any(d["path"].startswith("<compiled>/") for d in docs)  # docstrings of C modules


def test_the_committed_model_was_trained_on_this_pythons_corpus(corpus):
    header, _ = train_demo_model.read_corpus(corpus)
    record = json.loads((ROOT / "models" / "pycoder-26m" / "training.json").read_text())
    if header["python"] != record["corpus"]["python"]:
        pytest.fail(f"this Python is {header['python']}, the model's corpus came from "
                    f"{record['corpus']['python']}: the hash cannot be compared")
    assert header["sha256"] == record["corpus"]["sha256"]


def test_a_damaged_corpus_is_refused_with_the_hash(corpus, tmp_path):
    lines = gzip.decompress(corpus.read_bytes()).decode().splitlines(keepends=True)
    damaged = tmp_path / "damaged.jsonl.gz"
    damaged.write_bytes(gzip.compress("".join(lines[:-1]).encode()))
    with pytest.raises(SystemExit, match="damaged or of another format"):
        train_demo_model.read_corpus(damaged)
    with pytest.raises(SystemExit, match="does not exist; build it with"):
        train_demo_model.read_corpus(tmp_path / "missing.jsonl.gz")
