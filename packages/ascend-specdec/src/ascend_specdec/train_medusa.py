"""``python -m ascend_specdec.train_medusa --base MODEL_DIR --out HEADS_DIR``.

Self-distils Medusa heads from the base model's own greedy continuations of random token
prefixes (no dataset download), prints progress (step, loss, held-out top-1 accuracy per head,
the acceptance length greedy verification would see) and writes ``HEADS_DIR`` with
``config.json`` and ``model.safetensors``, which vLLM loads as
``speculative_config={"method": "medusa", "model": HEADS_DIR, "num_speculative_tokens": K}``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

import torch

from ascend_specdec.medusa.training import TrainOptions

_HELP = {
    "heads": "number of Medusa heads (the most speculative tokens they can serve)",
    "steps": "optimizer steps",
    "samples": "greedy continuations generated from the base model",
    "continuation_tokens": "tokens per greedy continuation",
    "min_prompt_tokens": "shortest random prompt",
    "max_prompt_tokens": "longest random prompt",
    "layers": "residual layers per head (x + SiLU(W x + b) each)",
    "batch_size": "training rows per step",
    "lr": "learning rate of the residual blocks (LM heads get 0.3x)",
    "weight_decay": "AdamW weight decay",
    "share_lm_head": "one LM head for all heads (vLLM's original_lm_head), from the base's",
    "freeze_lm_head": "keep the LM head(s) equal to the base model's",
    "truncated_vocab": "draft only the N most frequent tokens (writes a token_map)",
    "holdout": "share of continuations held out for evaluation",
    "eval_every": "evaluate on held-out data every N steps",
    "generation_batch": "prompts per greedy generation batch",
    "seed": "random seed (prompts, sampling of batches)",
    "prompt_text": "prompts from this text file or folder of .py/.txt/.md files "
                   "(default: random tokens)",
    "prompts_file": "prompts from your traffic: a text file (one prompt per line) or a "
                    ".jsonl file of {\"prompt\": ...} or {\"messages\": [...]} objects "
                    "(chats rendered with the model's chat template); held-out estimate "
                    "from held-out prompts of the file",
    "base_dtype": "dtype the base model generates in (default: the checkpoint's, as served)",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ascend_specdec.train_medusa",
                                description=__doc__.split("\n\n")[1])
    p.add_argument("--base", required=True, help="base model folder (config.json, safetensors)")
    p.add_argument("--out", required=True, help="folder to write the heads into")
    p.add_argument("--measure-paths", action="store_true",
                   help="measure the heads already in --out instead of training: greedy "
                        "continuations as the options say (use another --seed than training's), "
                        "their candidate paths written to medusa_paths.json for "
                        "medusa_tree_config auto")
    p.add_argument("--dtype", default=None,
                   help="dtype of the saved heads (default: the base checkpoint's)")
    for f in fields(TrainOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, action="store_true", default=f.default, help=_HELP[f.name])
        elif f.name == "truncated_vocab":
            p.add_argument(flag, type=int, default=None, metavar="N", help=_HELP[f.name])
        elif f.name in ("prompt_text", "prompts_file", "base_dtype"):
            p.add_argument(flag, default=None, help=_HELP[f.name])
        else:
            kind = float if f.type in ("float", float) else int
            p.add_argument(flag, type=kind, default=f.default,
                           help=f"{_HELP[f.name]} (default {f.default})")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(TrainOptions)}
    try:
        options = TrainOptions(**values)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    save_dtype = None
    if args.dtype:
        save_dtype = getattr(torch, args.dtype, None)
        if not isinstance(save_dtype, torch.dtype) or not save_dtype.is_floating_point:
            print(f"error: --dtype {args.dtype!r} is not a torch floating-point dtype "
                  "(float32, bfloat16, float16)", file=sys.stderr)
            return 2
    if args.measure_paths:
        from ascend_specdec.medusa.train import measure_tree_paths

        measure_tree_paths(args.base, args.out, options)
        return 0
    from ascend_specdec.medusa.train import train_medusa_heads

    train_medusa_heads(args.base, args.out, options, save_dtype=save_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
