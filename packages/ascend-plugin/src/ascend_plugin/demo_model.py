"""Where the demo model lives, and a check that its files are whole.

The demo model (``pycoder-26m``, a small Llama code model trained on the Python standard
library by ``tools/train_demo_model.py``) is committed to the repository under
``models/pycoder-26m``. The demo, the host end-to-end tests and the benchmarks find it:

- through ``$ASCEND_PLUGIN_DEMO_MODEL`` (a folder), which the noxfile sets, or
- beside this package's sources when they run from a checkout (editable installs).

``demo_model_dir`` never falls back to a random model: a missing folder, a missing file or a
truncated ``model.safetensors`` is an error that names the file and what to do.
Imports neither vLLM nor torch.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

DEMO_MODEL_ENV = "ASCEND_PLUGIN_DEMO_MODEL"
DEMO_MODEL_NAME = "pycoder-26m"
MEDUSA_NAME = f"{DEMO_MODEL_NAME}-medusa"  # its Medusa heads, committed beside it
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
HELD_OUT_FILE = "held_out.jsonl"  # held-out text the benchmarks and tests prompt with


class DemoModelError(FileNotFoundError):
    pass


def _checkout_model_dir() -> Path:
    # src/ascend_plugin/demo_model.py -> the repository root is five levels up.
    return Path(__file__).resolve().parents[4] / "models" / DEMO_MODEL_NAME


def demo_model_dir() -> Path:
    """The demo model's folder, checked whole (``DemoModelError`` otherwise)."""
    configured = os.environ.get(DEMO_MODEL_ENV)
    folder = Path(configured).expanduser() if configured else _checkout_model_dir()
    if not folder.is_dir():
        where = (f"${DEMO_MODEL_ENV}={configured!r}" if configured
                 else f"{folder} (beside the plugin's sources)")
        raise DemoModelError(
            f"the demo model folder {where} does not exist; it is committed to the repository "
            f"as models/{DEMO_MODEL_NAME}: run from a checkout, set {DEMO_MODEL_ENV} to that "
            "folder, or pass --model PATH")
    check_model_files(folder)
    return folder


def demo_medusa_dir() -> Path:
    """The demo model's Medusa heads (beside the model's folder), checked whole."""
    folder = demo_model_dir().parent / MEDUSA_NAME
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise DemoModelError(f"Medusa heads file {folder / name} is missing; restore it "
                                 f"with `git checkout -- models/{MEDUSA_NAME}`")
    check_safetensors_whole(folder / "model.safetensors")
    return folder


def check_model_files(folder: Path) -> None:
    """Every required file present; ``model.safetensors`` as long as its header says."""
    for name in REQUIRED_FILES:
        if not (folder / name).is_file():
            raise DemoModelError(f"demo model file {folder / name} is missing; restore it with "
                                 f"`git checkout -- models/{DEMO_MODEL_NAME}`")
    check_safetensors_whole(folder / "model.safetensors")


def check_safetensors_whole(path: Path) -> None:
    """Raise if ``path`` is shorter (or longer) than its safetensors header declares.

    A safetensors file is an 8-byte little-endian header length, a JSON header giving each
    tensor's byte range in the data section, then the data.
    """
    size = path.stat().st_size
    hint = f"restore it with `git checkout -- models/{DEMO_MODEL_NAME}`"
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            raise DemoModelError(f"{path} is truncated: {size} bytes, not even a safetensors "
                                 f"header; {hint}")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
            raise DemoModelError(f"{path} is truncated: its header alone needs {header_len} "
                                 f"bytes, the file has {size}; {hint}")
        try:
            header = json.loads(handle.read(header_len))
        except ValueError as err:
            raise DemoModelError(f"{path} has a damaged safetensors header ({err}); {hint}"
                                 ) from err
    ends = [entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size != expected:
        raise DemoModelError(f"{path} is truncated or damaged: its header declares "
                             f"{expected} bytes, the file has {size}; {hint}")


def held_out_split(folder: Path | None = None) -> dict[str, list[str]]:
    """The model's held-out files in two halves (alternate paths in sorted order): ``dev``
    for fitting things to the model (its Medusa heads' prompts), ``test`` for measuring."""
    folder = folder or demo_model_dir()
    record = json.loads((folder / "training.json").read_text(encoding="utf-8"))
    paths = sorted(record["corpus"]["held_out_paths"])
    return {"dev": paths[0::2], "test": paths[1::2]}


def held_out_texts(folder: Path | None = None, split: str = "test") -> list[dict]:
    """Held-out samples (``{"path", "offset", "text"}``) of one half of the held-out files,
    stored beside the demo model (two per file: its start and a chunk from its middle)."""
    folder = folder or demo_model_dir()
    path = folder / HELD_OUT_FILE
    if not path.is_file():
        raise DemoModelError(f"{path} is missing; regenerate it with `python "
                             f"tools/train_demo_model.py describe --model {folder} --corpus ...`")
    paths = set(held_out_split(folder)[split])
    samples = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    return [sample for sample in samples if sample["path"] in paths]


def distillation_prompt_text(folder: Path | None = None) -> Path:
    """A text file of the ``dev`` half of the held-out files (read from this Python's standard
    library), written once: prompts for self-distilling Medusa heads on text the model did not
    memorise in training, while the ``test`` half stays unseen for measurements."""
    import sysconfig

    folder = folder or demo_model_dir()
    record = json.loads((folder / "training.json").read_text(encoding="utf-8"))
    cache = Path(os.environ.get("ASCEND_PLUGIN_MODEL_CACHE")
                 or "~/.cache/ascend-plugin/models").expanduser()
    target = cache / f"{DEMO_MODEL_NAME}-dev-text-{record['corpus']['sha256'][:12]}.txt"
    if target.is_file():
        return target
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for rel in held_out_split(folder)["dev"]:
        source = stdlib / rel
        if source.is_file():  # "<compiled>/..." documents have no source file
            parts.append(source.read_text(encoding="utf-8"))
    if not parts:
        raise DemoModelError(f"none of the dev held-out files of {folder} are in {stdlib}")
    cache.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_text("".join(parts), encoding="utf-8")
    partial.rename(target)
    return target
