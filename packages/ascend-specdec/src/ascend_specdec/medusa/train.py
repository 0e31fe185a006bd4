"""Train Medusa heads for a base model folder and write a heads folder vLLM loads.

``train_medusa_heads`` is the whole job behind ``python -m ascend_specdec.train_medusa``;
``ensure_medusa_heads`` caches its result by the base model's contents and the options.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from ascend_specdec.medusa.checkpoint import save_heads
from ascend_specdec.medusa.training import (
    TrainOptions,
    TrainResult,
    generate_distillation_data,
    served_estimate,
    train_heads,
    tree_estimates,
)
from ascend_specdec.medusa.tree import PATHS_FILE

# Bump when a change here alters what training writes, so cached heads are not reused.
# 2: the base runs in the checkpoint's dtype, prompts may come from text; 3: acceptance
# walked as served, held-out prompts saved; 4: the measured paths for trees (medusa_paths.json)
TRAIN_VERSION = 4
REPORT_FILE = "training.json"
# The held-out prompts' token ids (BOS included), to serve them and compare with the report.
HELD_OUT_PROMPTS_FILE = "held_out_prompts.json"
CACHE_ENV_VAR = "ASCEND_PLUGIN_MODEL_CACHE"  # the tiny models' cache: heads sit beside them
DEFAULT_CACHE_ROOT = Path("~/.cache/ascend-plugin/models")


def _stderr(message: str) -> None:
    print(f"[train_medusa] {message}", file=sys.stderr, flush=True)


def _checkpoint_dtype(base_dir: Path) -> torch.dtype:
    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name), None)
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32


def train_medusa_heads(base_dir: str | Path, out_dir: str | Path,
                       options: TrainOptions | None = None, *, log=_stderr,
                       save_dtype: torch.dtype | None = None) -> TrainResult:
    """Self-distil heads from ``base_dir`` (safetensors) and write them into ``out_dir``.

    The heads are saved in the base checkpoint's dtype unless ``save_dtype`` says otherwise.
    """
    from ascend_specdec.medusa.base_model import TransformersBaseLM

    options = options or TrainOptions()
    base_dir = Path(base_dir)
    started = time.monotonic()
    base_dtype = (getattr(torch, options.base_dtype) if options.base_dtype
                  else _checkpoint_dtype(base_dir))
    base = TransformersBaseLM.load(base_dir, dtype=base_dtype)
    text_ids = base.encode_text(options.prompt_text) if options.prompt_text else None
    file_prompts = (base.encode_prompts_file(options.prompts_file) if options.prompts_file
                    else None)
    if file_prompts is not None:
        prompts = f"the {len(file_prompts):,} prompts of {options.prompts_file}"
    elif text_ids is not None:
        prompts = f"windows of {options.prompt_text} ({text_ids.numel():,} tokens)"
    else:
        prompts = "random tokens"
    log(f"base model {base_dir} in {str(base_dtype).removeprefix('torch.')}: hidden size "
        f"{base.hidden_size}, vocabulary {base.vocab_size}; {options.samples} greedy "
        f"continuations of {options.continuation_tokens} tokens from {prompts}, "
        f"{options.heads} heads, {options.steps} steps")
    train, held_out = generate_distillation_data(base, options, base.sample_ids,
                                                 base.bos_token_id, log=log, text_ids=text_ids,
                                                 file_prompts=file_prompts)
    generated = time.monotonic() - started
    log(f"{len(train)} training rows, {len(held_out)} held-out rows ({generated:.1f} s)")
    result = train_heads(train, held_out, base.lm_head_weight(), options, log=log)
    result.seconds["generate"] = generated
    dtype = save_dtype or _checkpoint_dtype(base_dir)
    served = served_estimate(result.heads, held_out, dtype)
    log(f"held-out estimate as served ({str(dtype).removeprefix('torch.')}): "
        f"{served.describe()}")
    trees = tree_estimates(result.heads, held_out, dtype)
    for budget, tree in trees["trees"].items():
        log(f"held-out estimate as served, tree of {budget} nodes (medusa_tree_config "
            f"auto, num_speculative_tokens {budget}): acceptance length "
            f"{tree['acceptance_length']:.2f}")
    save_heads(result.heads, out_dir, dtype=dtype)
    (Path(out_dir) / PATHS_FILE).write_text(json.dumps(trees) + "\n", encoding="utf-8")
    report = {
        "base_model": str(base_dir),
        "options": asdict(options),
        "rows": {"train": len(train), "held_out": len(held_out)},
        "initial": asdict(result.initial) if result.initial else None,
        "final": asdict(result.final) if result.final else None,
        "served": asdict(served),
        "trees": {budget: tree["acceptance_length"] for budget, tree in trees["trees"].items()},
        "history": result.history,
        "seconds": result.seconds,
        "dtype": str(dtype).removeprefix("torch."),
    }
    (Path(out_dir) / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n",
                                             encoding="utf-8")
    (Path(out_dir) / HELD_OUT_PROMPTS_FILE).write_text(json.dumps(held_out.prompts) + "\n",
                                                       encoding="utf-8")
    log(f"wrote {out_dir} ({time.monotonic() - started:.1f} s in all)")
    return result


def measure_tree_paths(base_dir: str | Path, heads_dir: str | Path,
                       options: TrainOptions | None = None, *, log=_stderr) -> dict:
    """Measure heads trained before (``heads_dir``, in their saved dtype) for trees: fresh
    greedy continuations from ``options`` (prompts, samples, seed), their candidate paths
    written to ``medusa_paths.json`` beside the heads (what ``medusa_tree_config.auto``
    reads). Returns what was written."""
    from ascend_specdec.medusa.base_model import TransformersBaseLM
    from ascend_specdec.medusa.checkpoint import load_heads

    options = options or TrainOptions()
    started = time.monotonic()
    from safetensors import safe_open

    heads = load_heads(heads_dir)  # float32, cast to the saved dtype for the measurement
    first = sorted(Path(heads_dir).glob("*.safetensors"))[0]
    with safe_open(str(first), framework="pt") as weights:
        dtype = weights.get_tensor(next(iter(weights.keys()))).dtype
    if heads.num_heads != options.heads:
        options = replace(options, heads=heads.num_heads)
    base_dtype = (getattr(torch, options.base_dtype) if options.base_dtype
                  else _checkpoint_dtype(Path(base_dir)))
    base = TransformersBaseLM.load(Path(base_dir), dtype=base_dtype)
    text_ids = base.encode_text(options.prompt_text) if options.prompt_text else None
    file_prompts = (base.encode_prompts_file(options.prompts_file) if options.prompts_file
                    else None)
    log(f"measuring the paths of {heads_dir} ({heads.num_heads} heads, "
        f"{str(dtype).removeprefix('torch.')}) on {options.samples} greedy continuations")
    _, held_out = generate_distillation_data(base, options, base.sample_ids,
                                             base.bos_token_id, log=log, text_ids=text_ids,
                                             file_prompts=file_prompts, held_out_only=True)
    trees = tree_estimates(heads, held_out, dtype)
    log(f"chain of {heads.num_heads}: acceptance length "
        f"{trees['chain_acceptance_length']:.2f}")
    for budget, tree in trees["trees"].items():
        log(f"tree of {budget} nodes: acceptance length {tree['acceptance_length']:.2f}")
    (Path(heads_dir) / PATHS_FILE).write_text(json.dumps(trees) + "\n", encoding="utf-8")
    log(f"wrote {Path(heads_dir) / PATHS_FILE} ({time.monotonic() - started:.1f} s)")
    return trees


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_ROOT).expanduser()


def heads_key(base_dir: str | Path, options: TrainOptions,
              save_dtype: torch.dtype | None = None) -> str:
    """``medusa-<hash>`` of the base model's files, the options and this trainer's version."""
    digest = hashlib.sha256()
    base = Path(base_dir)
    for path in sorted(base.glob("*.json")) + sorted(base.glob("*.safetensors")):
        if path.name.startswith("tiny_model_build"):
            continue
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 24), b""):
                digest.update(block)
    identity: dict[str, Any] = {
        "options": asdict(options),
        "train_version": TRAIN_VERSION,
        "save_dtype": str(save_dtype),
        "torch": torch.__version__.split("+")[0],
    }
    digest.update(json.dumps(identity, sort_keys=True).encode())
    return f"medusa-{digest.hexdigest()[:12]}"


def ensure_medusa_heads(base_dir: str | Path, options: TrainOptions | None = None, *,
                        cache_dir: str | Path | None = None, log=_stderr,
                        save_dtype: torch.dtype | None = None) -> Path:
    """The folder of heads trained for ``base_dir`` with ``options``, training them once.

    Cached under ``cache_dir`` (default: ``$ASCEND_PLUGIN_MODEL_CACHE`` or
    ``~/.cache/ascend-plugin/models``) by a hash of the base model's files and the options;
    written to a temporary folder and renamed into place, so a half-written folder is never
    taken for a finished one.
    """
    options = options or TrainOptions()
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    final = root / heads_key(base_dir, options, save_dtype)
    if (final / REPORT_FILE).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=root))
    try:
        train_medusa_heads(base_dir, staging, options, log=log, save_dtype=save_dtype)
        if final.exists() and not (final / REPORT_FILE).is_file():
            shutil.rmtree(final)
        try:
            os.rename(staging, final)
        except OSError:
            if not (final / REPORT_FILE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"heads ready in {final}")
    return final
