"""Train the project's demo model: a small Llama code model on the Python standard library.

Two steps, because the GPU machine reaches no network and may hold another Python:

    # 1. on any machine: the corpus (this Python's standard library, sources and docstrings)
    python tools/train_demo_model.py corpus --out .corpus/stdlib.jsonl.gz
    # 2. on a GPU (about 10 minutes on one H200): tokenizer, model, evaluation, samples
    python tools/train_demo_model.py train --corpus .corpus/stdlib.jsonl.gz --out OUT_DIR

Step 2 without a GPU stops and says how to train on the CPU instead (``--device cpu``, with
``--steps`` and ``--batch-size`` cut down: hours, not minutes).

The corpus is deterministic for a given Python build: every ``.py`` file under the standard
library folder (``site-packages`` excluded), sorted by path, plus one generated document per
built-in and extension module made of its docstrings (these modules have no source). Whole files
are held out for evaluation (a fixed hash of the path). The corpus file's SHA-256 is recorded
in the model's ``training.json``; the trainer refuses a corpus whose embedded hash is wrong.

Outputs (``OUT_DIR``): ``config.json``, ``generation_config.json``, ``model.safetensors``
(bf16), ``tokenizer.json``, ``tokenizer_config.json`` (with a chat template) and
``training.json`` (corpus hash, token counts, steps, losses, unigram baseline, samples).
This script is a development tool, not part of any shipped package.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import inspect
import json
import math
import sys
import sysconfig
import time
from pathlib import Path

CORPUS_FORMAT = 1
HOLDOUT_EVERY = 40  # one file in 40 (by a hash of its path) is held out
EOT = "<|endoftext|>"
PAD = "<|pad|>"

# The demo model is a code model, so a chat turn is shown to it as a code comment: the user's
# words become "# ..." lines and a blank line, after which the model writes code (without the
# blank line it goes on commenting). System text is a comment too. (transformers renders with
# trim_blocks, which drops a newline right after a block tag: hence the {{ '\n' }}.)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}\n"
    "{% else %}{% for line in message['content'].split('\\n') %}# {{ line }}\n{% endfor %}"
    "{{ '\\n' }}{% endif %}{% endfor %}"
)

# No prompt ends in a newline: the tokenizer joins a newline with the indentation after it,
# so a prompt cut after "\n" asks for a token split the model never saw in training.
SAMPLE_PROMPTS = (
    "def fibonacci(n):",
    "import os\n\n\ndef list_python_files(folder):",
    "class Stack:\n    def __init__(self):",
    "    def __repr__(self):",
    "def is_palindrome(text):\n    \"\"\"Return True if text reads the same backwards.\"\"\"",
    "if __name__ == '__main__':",
)


def log(message: str) -> None:
    print(f"[train_demo_model] {message}", flush=True)


# --------------------------------------------------------------------------------- corpus

def _module_docs(name: str) -> str | None:
    """A Python-looking text of a compiled module's docstrings, or None if it has none."""
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a module that cannot import here is simply left out
        return None
    parts = [f'"""{inspect.cleandoc(module.__doc__)}"""\n' if module.__doc__ else ""]
    for attr in sorted(vars(module)):
        if attr.startswith("_"):
            continue
        value = getattr(module, attr)
        if name == "sys":  # test runners replace sys's hooks; sys keeps the originals
            value = getattr(module, f"__{attr}__", value)
        doc = getattr(value, "__doc__", None)
        if not isinstance(doc, str) or not doc.strip() or not callable(value):
            continue
        if getattr(value, "__module__", name) not in (name, None):
            continue
        kind = "class" if isinstance(value, type) else "def"
        try:
            signature = str(inspect.signature(value)) if kind == "def" else ""
        except (TypeError, ValueError):
            signature = "(*args, **kwargs)"
        header = f"class {attr}:" if kind == "class" else f"def {attr}{signature}:"
        body = inspect.cleandoc(doc).replace('"""', "'''")
        parts.append(f'\n\n{header}\n    """' + body.replace("\n", "\n    ") + '"""\n')
    text = "".join(parts).strip()
    return text + "\n" if text else None


def is_held_out(path: str) -> bool:
    return int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % HOLDOUT_EVERY == 0


def build_corpus() -> list[dict]:
    """Documents of this Python's standard library, in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib).as_posix()
        if rel.startswith("site-packages/") or "/site-packages/" in rel:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            docs.append({"path": rel, "text": text})
    dynload = Path(sysconfig.get_paths()["platstdlib"]) / "lib-dynload"
    compiled = set(sys.builtin_module_names)
    compiled.update(p.name.split(".")[0] for p in dynload.glob("*.so"))
    for name in sorted(compiled):
        if name.startswith("_test") or name in ("antigravity", "this"):
            continue
        text = _module_docs(name)
        if text:
            docs.append({"path": f"<compiled>/{name}.py", "text": text})
    for doc in docs:
        doc["split"] = "held_out" if is_held_out(doc["path"]) else "train"
    return docs


def write_corpus(out: Path) -> str:
    docs = build_corpus()
    header = {"format": CORPUS_FORMAT, "python": sys.version.split()[0],
              "documents": len(docs), "holdout_every": HOLDOUT_EVERY}
    body = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs)
    header["sha256"] = hashlib.sha256(body.encode()).hexdigest()
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = (json.dumps(header, sort_keys=True) + "\n" + body).encode()
    with open(out, "wb") as handle:  # mtime 0: the same corpus gives the same bytes
        with gzip.GzipFile(filename="", fileobj=handle, mode="wb", mtime=0,
                           compresslevel=9) as gz:
            gz.write(raw)
    held = sum(d["split"] == "held_out" for d in docs)
    log(f"corpus {out}: {len(docs)} documents ({held} held out), {len(body) / 1e6:.1f} MB of "
        f"text, sha256 {header['sha256'][:16]}")
    return header["sha256"]


def read_corpus(path: Path) -> tuple[dict, list[dict]]:
    if not path.is_file():
        raise SystemExit(f"error: corpus {path} does not exist; build it with "
                         f"`python tools/train_demo_model.py corpus --out {path}`")
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        header = json.loads(handle.readline())
        body = handle.read()
    digest = hashlib.sha256(body.encode()).hexdigest()
    if header.get("format") != CORPUS_FORMAT or digest != header.get("sha256"):
        raise SystemExit(f"error: corpus {path} is damaged or of another format (sha256 "
                         f"{digest[:16]}, header says {str(header.get('sha256'))[:16]}); "
                         "rebuild it with the `corpus` command")
    return header, [json.loads(line) for line in body.splitlines()]


# ------------------------------------------------------------------------------ tokenizer

def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=[EOT, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def save_tokenizer(tokenizer, out: Path, max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOT, pad_token=PAD,
                                   bos_token=None, unk_token=None,
                                   model_max_length=max_length)
    fast.save_pretrained(str(out))
    finish_tokenizer_files(out)


def finish_tokenizer_files(out: Path) -> None:
    """The chat template in both places transformers looks, under a class name every 4.x/5.x
    transformers knows (5.x writes ``TokenizersBackend``, which 4.x cannot load)."""
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")


def encode(tokenizer, texts: list[str]):
    import numpy as np

    eot = tokenizer.token_to_id(EOT)
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts):
        ids.extend(encoding.ids)
        ids.append(eot)
    return np.asarray(ids, dtype=np.int32)


def unigram_loss(train_ids, held_ids, vocab_size: int) -> float:
    """Cross-entropy (nats/token) on held-out tokens of add-one-smoothed training frequencies."""
    import numpy as np

    counts = np.bincount(train_ids, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[held_ids].mean())


# ---------------------------------------------------------------------------------- model

def model_config(args, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden_size // args.heads, max_position_embeddings=args.max_positions,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.token_to_id(EOT),
        pad_token_id=tokenizer.token_to_id(PAD), initializer_range=0.02,
        attention_bias=False, mlp_bias=False, hidden_act="silu")


def evaluate(model, held, seq_len: int, device, batch: int = 32) -> float:
    """Mean next-token loss over the held-out stream in non-overlapping windows."""
    import torch

    n = (len(held) - 1) // seq_len
    inputs = held[: n * seq_len].view(n, seq_len)
    targets = held[1: n * seq_len + 1].view(n, seq_len)
    total, count = 0.0, 0
    model.eval()
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        for i in range(0, n, batch):
            x, y = inputs[i:i + batch].to(device), targets[i:i + batch].to(device)
            logits = model(input_ids=x).logits.float()
            total += torch.nn.functional.cross_entropy(
                logits.view(-1, logits.shape[-1]), y.reshape(-1), reduction="sum").item()
            count += y.numel()
    model.train()
    return total / count


def greedy_samples(model, tokenizer, device, max_new_tokens: int = 48) -> list[dict]:
    import torch

    samples = []
    model.eval()
    for prompt in SAMPLE_PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt).ids], device=device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.token_to_id(EOT),
                                 pad_token_id=tokenizer.token_to_id(PAD))
        samples.append({"prompt": prompt,
                        "continuation": tokenizer.decode(out[0, ids.shape[1]:].tolist())})
    model.train()
    return samples


def pick_device(name: str):
    import torch

    if name == "cuda" or name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        raise SystemExit(
            "error: no CUDA GPU is visible (torch.cuda.is_available() is False); the demo "
            "model is trained on a GPU in about 10 minutes. To train on the CPU instead "
            "(hours), pass --device cpu, and cut --steps and --batch-size, e.g. "
            "`--device cpu --steps 2000 --batch-size 8`")
    return torch.device(name)


def train(args) -> None:
    import numpy as np
    import torch
    from transformers import LlamaForCausalLM

    device = pick_device(args.device)
    started = time.monotonic()
    header, docs = read_corpus(Path(args.corpus))
    train_docs = [d["text"] for d in docs if d["split"] == "train"]
    held_docs = [d["text"] for d in docs if d["split"] == "held_out"]
    log(f"corpus {args.corpus}: sha256 {header['sha256'][:16]}, {len(train_docs)} training "
        f"and {len(held_docs)} held-out documents")

    tokenizer = train_tokenizer(train_docs, args.vocab_size)
    train_ids, held_ids = encode(tokenizer, train_docs), encode(tokenizer, held_docs)
    text_bytes = {"train": sum(len(t.encode()) for t in train_docs),
                  "held_out": sum(len(t.encode()) for t in held_docs)}
    unigram = unigram_loss(train_ids, held_ids, tokenizer.get_vocab_size())
    log(f"tokenizer: {tokenizer.get_vocab_size()} tokens; {len(train_ids):,} training and "
        f"{len(held_ids):,} held-out tokens ({text_bytes['train'] / len(train_ids):.2f} "
        f"bytes/token); unigram held-out loss {unigram:.3f} ({time.monotonic() - started:.0f} s)")

    torch.manual_seed(args.seed)
    config = model_config(args, tokenizer)
    model = LlamaForCausalLM(config).to(device)
    params = sum(p.numel() for p in model.parameters())
    log(f"model: {params / 1e6:.1f}M parameters ({params * 2 / 2**20:.1f} MiB in bf16)")
    step_model = torch.compile(model) if device.type == "cuda" and not args.no_compile else model

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    def lr_at(step: int, elapsed: float) -> float:
        """Linear warm-up, then a cosine to a tenth over the steps or the time budget."""
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        if args.time_budget:
            progress = max(progress, elapsed / args.time_budget)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))

    data = torch.from_numpy(train_ids.astype(np.int64)).to(device)
    held = torch.from_numpy(held_ids.astype(np.int64))
    generator = torch.Generator(device=device).manual_seed(args.seed)
    seq = args.seq_len
    offsets = torch.arange(seq + 1, device=device)
    history, best = [], (float("inf"), -1, None)
    train_started = time.monotonic()

    def forward_backward(net, window):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = net(input_ids=window[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]),
                                                 window[:, 1:].reshape(-1))
        loss.backward()
        return loss

    step, trained = 0, 0
    while step < args.steps:
        elapsed = time.monotonic() - train_started
        last = step == args.steps - 1 or (args.time_budget and elapsed >= args.time_budget)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, elapsed)
        starts = torch.randint(0, len(data) - seq - 1, (args.batch_size,), device=device,
                               generator=generator)
        window = data[starts[:, None] + offsets]
        if step == 0 and step_model is not model:
            try:
                loss = forward_backward(step_model, window)
            except Exception as err:  # noqa: BLE001 - compilation is an optimisation only
                log(f"torch.compile failed ({type(err).__name__}: {err}); training eagerly")
                optimizer.zero_grad(set_to_none=True)
                step_model = model
                loss = forward_backward(model, window)
        else:
            loss = forward_backward(step_model, window)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.eval_every == 0 or last:
            held_loss = evaluate(model, held, seq, device)
            elapsed = time.monotonic() - train_started
            tokens = (step + 1) * args.batch_size * seq
            history.append({"step": step + 1, "train_loss": round(loss.item(), 4),
                            "held_out_loss": round(held_loss, 4), "seconds": round(elapsed, 1)})
            log(f"step {step + 1}/{args.steps}: train {loss.item():.3f}, held-out "
                f"{held_loss:.3f} (ppl {math.exp(held_loss):.2f}), {tokens / elapsed:,.0f} "
                f"tokens/s, {elapsed:.0f} s")
            if held_loss < best[0]:
                best = (held_loss, step + 1,
                        {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        step += 1
        if last:
            break
    trained = step
    train_seconds = time.monotonic() - train_started
    model.load_state_dict(best[2])
    log(f"best held-out loss {best[0]:.4f} at step {best[1]}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    samples = greedy_samples(model, tokenizer, device)
    model.to(torch.bfloat16).save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tokenizer, out, args.max_positions)
    bf16_loss = evaluate(model, held, seq, device)
    record = {
        "script": "tools/train_demo_model.py",
        "command": " ".join(sys.argv),
        "corpus": {"sha256": header["sha256"], "python": header["python"],
                   "documents": {"train": len(train_docs), "held_out": len(held_docs)},
                   "bytes": text_bytes,
                   "held_out_paths": [d["path"] for d in docs if d["split"] == "held_out"]},
        "tokens": {"train": int(len(train_ids)), "held_out": int(len(held_ids))},
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size":
                      tokenizer.get_vocab_size()},
        "model": {"architecture": "LlamaForCausalLM", "parameters": params,
                  "dtype": "bfloat16"},
        "training": {"steps": trained, "time_budget": args.time_budget,
                     "batch_size": args.batch_size, "seq_len": seq,
                     "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
                     "seed": args.seed, "seconds": round(train_seconds, 1),
                     "device": torch.cuda.get_device_name() if device.type == "cuda"
                     else str(device), "torch": torch.__version__, "best_step": best[1]},
        "held_out": {"loss": round(best[0], 4), "perplexity": round(math.exp(best[0]), 3),
                     "loss_bf16_weights": round(bf16_loss, 4),
                     "bits_per_byte": round(bf16_loss * len(held_ids) / math.log(2)
                                            / text_bytes["held_out"], 4),
                     "unigram_loss": round(unigram, 4),
                     "unigram_perplexity": round(math.exp(unigram), 3)},
        "history": history,
        "greedy_samples": samples,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    log(f"wrote {out}: held-out loss {bf16_loss:.3f} with bf16 weights (perplexity "
        f"{math.exp(bf16_loss):.2f}; unigram {unigram:.3f}, perplexity {math.exp(unigram):.1f})")
    for sample in samples:
        log(f"greedy {sample['prompt']!r} -> {sample['continuation']!r}")


def held_out_samples(docs: list[dict], per_file: int = 2, chars: int = 1500) -> list[dict]:
    """Chunks of the held-out files (at line starts), for prompts and perplexity elsewhere."""
    samples = []
    for doc in docs:
        if doc["split"] != "held_out":
            continue
        text = doc["text"]
        for i in range(per_file):
            start = text.rfind("\n", 0, len(text) * i // per_file) + 1
            chunk = text[start:start + chars]
            if len(chunk) == chars:
                chunk = chunk[: chunk.rfind("\n") + 1] or chunk
            if chunk.strip():
                samples.append({"path": doc["path"], "offset": start, "text": chunk})
    return samples


def describe(args) -> None:
    """Refresh a trained folder's tokenizer files, greedy samples and model card (CPU is fine)."""
    import torch
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    out = Path(args.model)
    record = json.loads((out / "training.json").read_text(encoding="utf-8"))
    finish_tokenizer_files(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    model = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    record["greedy_samples"] = greedy_samples(model, tokenizer, torch.device("cpu"))
    if args.corpus:
        header, docs = read_corpus(Path(args.corpus))
        if header["sha256"] != record["corpus"]["sha256"]:
            trained_on = record["corpus"]["sha256"][:16]
            raise SystemExit(f"error: corpus {args.corpus} (sha256 {header['sha256'][:16]}) is "
                             f"not the one {out} was trained on ({trained_on})")
        samples = held_out_samples(docs)
        (out / "held_out.jsonl").write_text(
            "".join(json.dumps(s, sort_keys=True) + "\n" for s in samples), encoding="utf-8")
        log(f"wrote {len(samples)} held-out samples to {out / 'held_out.jsonl'}")
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(model_card(record), encoding="utf-8")
    for sample in record["greedy_samples"]:
        log(f"greedy {sample['prompt']!r} -> {sample['continuation']!r}")


def model_card(record: dict) -> str:
    t, h, c = record["training"], record["held_out"], record["corpus"]
    lines = [
        "# pycoder-26m: the project's demo model",
        "",
        f"A {record['model']['parameters'] / 1e6:.1f}M-parameter Llama (`LlamaForCausalLM`, "
        "bf16 safetensors) trained from scratch on the Python standard library's sources and "
        f"docstrings (Python {c['python']}), with a {record['tokenizer']['vocab_size']}-token "
        "byte-level BPE tokenizer trained on the same text. It continues Python code; it does "
        "not follow instructions. The chat template shows each user or system message as "
        "`# ...` comment lines, so a chat request reads as a comment the model writes code "
        "after.",
        "",
        f"Built by `{record['script']}` (`{record['command']}`), then refreshed with "
        "`python tools/train_demo_model.py describe --model models/pycoder-26m`.",
        "",
        "| what | value |",
        "|---|---|",
        f"| corpus | sha256 `{c['sha256']}`, {c['documents']['train']} training and "
        f"{c['documents']['held_out']} held-out files (whole files, by a hash of the path) |",
        f"| tokens | {record['tokens']['train']:,} training, {record['tokens']['held_out']:,} "
        "held out |",
        f"| training | {t['steps']} steps of {t['batch_size']} x {t['seq_len']} tokens on "
        f"{t['device']} ({t['seconds']:.0f} s, torch {t['torch']}); weights kept from step "
        f"{t['best_step']}, the lowest held-out loss |",
        f"| held-out loss | {h['loss_bf16_weights']:.3f} nats/token (perplexity "
        f"{math.exp(h['loss_bf16_weights']):.2f}, {h['bits_per_byte']:.3f} bits/byte) with "
        "the bf16 weights |",
        f"| unigram baseline | {h['unigram_loss']:.3f} nats/token (perplexity "
        f"{h['unigram_perplexity']:.1f}) |",
        "",
        "Greedy continuations (`training.json` holds them all):",
        "",
    ]
    for sample in record["greedy_samples"][:3]:
        lines += ["```python", sample["prompt"] + sample["continuation"], "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/train_demo_model.py",
                                     description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    corpus = sub.add_parser("corpus", help="write the standard-library corpus")
    corpus.add_argument("--out", required=True)
    t = sub.add_parser("train", help="train the tokenizer and the model on a corpus")
    t.add_argument("--corpus", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="auto", help="auto (a CUDA GPU), cuda or cpu")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--hidden-size", type=int, default=512)
    t.add_argument("--intermediate-size", type=int, default=1024)
    t.add_argument("--layers", type=int, default=8)
    t.add_argument("--heads", type=int, default=8)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--max-positions", type=int, default=2048)
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--steps", type=int, default=20000, help="most optimizer steps")
    t.add_argument("--time-budget", type=float, default=360.0,
                   help="seconds of training (the LR schedule follows it); 0: --steps only")
    t.add_argument("--warmup", type=int, default=300)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--eval-every", type=int, default=500)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--no-compile", action="store_true", help="skip torch.compile on a GPU")
    d = sub.add_parser("describe", help="refresh a trained folder's samples and model card")
    d.add_argument("--model", required=True)
    d.add_argument("--corpus", help="the training corpus: also write held_out.jsonl from it")
    args = parser.parse_args(argv)
    if args.command == "corpus":
        write_corpus(Path(args.out))
    elif args.command == "describe":
        describe(args)
    else:
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
