"""Tiny random-weight models, built locally, for the demo and the host end-to-end tests.

Nothing is downloaded. The tokenizer is a byte-level BPE trained on docstrings of a fixed list
of standard-library modules (text every Python install carries); the models are random-init
``transformers`` checkpoints saved as safetensors next to that tokenizer, so vLLM loads the folder
like any Hugging Face model. Builds are deterministic: the same arguments give byte-identical
``model.safetensors`` and ``tokenizer.json``.

``ensure_model`` caches builds under ``$ASCEND_PLUGIN_MODEL_CACHE`` (default
``~/.cache/ascend-plugin/models``), one folder per distinct set of build arguments.

Requires the ``demo`` extra (transformers, tokenizers, safetensors); imports no vLLM.
"""

from __future__ import annotations

import ast
import codecs
import hashlib
import inspect
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

# Bump whenever a change here alters what a build writes, so cached folders are not reused.
BUILD_VERSION = 1

CACHE_ENV_VAR = "ASCEND_PLUGIN_MODEL_CACHE"
DEFAULT_CACHE_ROOT = Path("~/.cache/ascend-plugin/models")
COMPLETE_MARKER = "tiny_model_build.json"

DEFAULT_VOCAB_SIZE = 2048
UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0..3, in this order

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Head sizes vLLM's CPU attention accepts (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Default std of the random weights. transformers' 0.02 makes a tiny model emit one token for
# every prompt; a larger std gives prompt-dependent greedy continuations.
DEFAULT_INITIALIZER_RANGE = 0.2

# Paths relative to the standard library folder. Fixed and sorted, so the corpus depends only on
# the Python version; a file missing from a trimmed install is skipped (the corpus hash, part of
# the cache key, records what was read).
_CORPUS_MODULES = (
    "argparse.py",
    "ast.py",
    "asyncio/tasks.py",
    "base64.py",
    "bisect.py",
    "calendar.py",
    "collections/__init__.py",
    "contextlib.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "decimal.py",
    "difflib.py",
    "email/message.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "glob.py",
    "gzip.py",
    "heapq.py",
    "html/__init__.py",
    "http/client.py",
    "inspect.py",
    "ipaddress.py",
    "json/__init__.py",
    "logging/__init__.py",
    "os.py",
    "pathlib.py",
    "pickle.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "shutil.py",
    "socket.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "textwrap.py",
    "threading.py",
    "typing.py",
    "unittest/case.py",
    "urllib/parse.py",
    "uuid.py",
    "warnings.py",
    "zipfile.py",
)

# A little plain English, so the prompts the demo and tests use tokenize into sensible pieces
# even on an install whose standard library ships without sources.
_BUILTIN_TEXT = (
    "hello world. Hello, World! The quick brown fox jumps over the lazy dog.",
    "The capital of France is Paris. The future of AI is open.",
    "Once upon a time, there was a small model that answered every question.",
    "Write a short poem about the sea. Tell me a story. What is two plus two?",
)

_MODEL_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    # Qwen3-MoE is the one of the two that implements vLLM's MixtureOfExperts (EPLB) interface.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    # Hybrid attention: gated delta-net (linear attention) layers between full-attention ones.
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}
MODEL_KINDS = tuple(_MODEL_CLASSES)

_MOE_DEFAULTS = {
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    },
    "qwen3_next": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention", "full_attention"] * 2,
    },
}


def _log(message: str) -> None:
    print(f"[tiny_models] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- tokenizer


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    # ast.walk is breadth-first in source order: deterministic for a given file.
    docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, nodes))
    return [doc for doc in docs if doc]


def _zen_of_python(stdlib: Path) -> list[str]:
    # Read this.py rather than import it: importing prints the Zen to stdout.
    path = stdlib / "this.py"
    if not path.is_file():
        return []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and any(isinstance(t, ast.Name) and t.id == "s" for t in node.targets)
        ):
            return [codecs.decode(node.value.value, "rot13")]
    return []


@lru_cache(maxsize=1)
def training_corpus() -> tuple[str, ...]:
    """The tokenizer's training texts: standard-library docstrings, the Zen, a few sentences.

    Docstrings are parsed from the source files (not ``__doc__``), so ``python -OO`` gives the
    same corpus.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts: list[str] = list(_BUILTIN_TEXT)
    texts += _zen_of_python(stdlib)
    for relative in _CORPUS_MODULES:
        path = stdlib / relative
        if path.is_file():
            texts += _docstrings(path.read_text(encoding="utf-8"))
    return tuple(texts)


def corpus_digest() -> str:
    digest = hashlib.sha256()
    for text in training_corpus():
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


@lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=None))
    # Byte level and no prefix space: every string encodes, and decode(encode(s)) == s.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(), trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS)
    # Llama-style: a BOS in front of every encoded prompt.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    return tokenizer.to_str()


def load_trained_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The trained tokenizer as a ``transformers.PreTrainedTokenizerFast`` (not saved)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE tokenizer: it needs at "
            f"least {256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_trained_tokenizer_json(vocab_size)),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tokenizer(out_dir: str | os.PathLike, vocab_size: int = DEFAULT_VOCAB_SIZE):
    """Train the byte-level BPE tokenizer and ``save_pretrained`` it into ``out_dir``.

    ``vocab_size`` is an upper bound: a corpus with too few distinct pairs stops earlier
    (2048 is reached; about 7800 is the most this corpus gives). Returns the tokenizer.
    """
    _log(f"building tokenizer (vocab_size {vocab_size})...")
    tokenizer = load_trained_tokenizer(vocab_size)
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer


# --------------------------------------------------------------------------- model


def _model_config(kind: str, **fields: Any):
    import transformers

    if kind not in _MODEL_CLASSES:
        raise ValueError(f"unknown model kind {kind!r}; expected one of {', '.join(MODEL_KINDS)}")
    config_class = getattr(transformers, _MODEL_CLASSES[kind][0])
    return config_class(**{**_MOE_DEFAULTS.get(kind, {}), **fields})


def build_model(
    out_dir: str | os.PathLike,
    kind: str = "llama",
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    vocab_size: int | None = None,
    dtype: str = "float32",
    seed: int = 0,
    max_position_embeddings: int = 2048,
    **extra: Any,
) -> Path:
    """Random-init a ``kind`` model and save it, with the tokenizer, into ``out_dir``.

    ``vocab_size``: None gives the model the tokenizer's vocabulary (2048); a larger value also
    trains the tokenizer up to that size and pads the embedding to exactly ``vocab_size`` rows.
    ``extra`` goes to the transformers config (e.g. ``num_experts=16``,
    ``tie_word_embeddings=True``, ``initializer_range=0.02``), overriding this module's defaults.
    """
    import torch
    import transformers

    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"hidden_size={hidden_size}, num_heads={num_heads}, num_kv_heads={num_kv_heads}: "
            "hidden_size must be a multiple of num_heads and num_heads of num_kv_heads"
        )
    head_dim = hidden_size // num_heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head_dim = hidden_size / num_heads = {head_dim} is not one of vLLM's CPU attention "
            f"head sizes {VLLM_CPU_HEAD_SIZES}; e.g. hidden_size=128 with num_heads=4 gives 32"
        )
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ValueError(f"dtype={dtype!r} is not a torch floating-point dtype name like 'float32'")

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size or DEFAULT_VOCAB_SIZE)
    model_vocab = len(tokenizer) if vocab_size is None else vocab_size
    if model_vocab < len(tokenizer):
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens"
        )

    fields: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": model_vocab,
        "max_position_embeddings": max_position_embeddings,
        "initializer_range": DEFAULT_INITIALIZER_RANGE,
        "tie_word_embeddings": False,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    if kind == "qwen3_moe":
        fields["head_dim"] = head_dim  # Qwen3 configs carry head_dim (default 128)
    config = _model_config(kind, **{**fields, **extra})

    model_class = getattr(transformers, _MODEL_CLASSES[kind][1])
    torch.manual_seed(seed)
    model = model_class._from_config(config, dtype=torch.float32)
    # Initialise in float32 and cast, so a bf16 build has the float32 build's weights, rounded.
    model = model.to(torch_dtype).eval()
    model.config.dtype = torch_dtype
    num_params = sum(p.numel() for p in model.parameters())
    _log(f"building {kind} model ({num_params:,} params, {dtype})...")
    model.save_pretrained(str(out), safe_serialization=True)
    return out


# --------------------------------------------------------------------------- cache


# Taken once, so build keys do not depend on what build_model is patched with at run time.
_BUILD_SIGNATURE = inspect.signature(build_model)


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_ROOT).expanduser()


def _build_arguments(kind: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """All of build_model's arguments, defaults filled in, so equal builds get equal keys."""
    bound = _BUILD_SIGNATURE.bind("<out_dir>", kind, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    del arguments["out_dir"]
    arguments.update(arguments.pop("extra"))
    return arguments


def build_key(kind: str = "llama", **kwargs: Any) -> str:
    """``<kind>-<hash>``: the cache folder name for these build arguments."""
    import tokenizers
    import torch
    import transformers

    identity = {
        "arguments": _build_arguments(kind, kwargs),
        "build_version": BUILD_VERSION,
        "corpus": corpus_digest(),
        "tokenizers": tokenizers.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__.split("+")[0],
    }
    blob = json.dumps(identity, sort_keys=True, default=repr).encode("utf-8")
    return f"{kind}-{hashlib.sha256(blob).hexdigest()[:12]}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def build_into_cache(final: Path, marker: dict, build: Any) -> None:
    """Run ``build(staging)`` in a temporary folder beside ``final``, write the marker file
    last and rename the folder into place: a half-written folder is never taken for a build."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    try:
        build(staging)
        marker_text = json.dumps(marker, sort_keys=True, indent=2, default=repr) + "\n"
        (staging / COMPLETE_MARKER).write_text(marker_text, encoding="utf-8")
        if final.exists() and not is_complete(final):
            shutil.rmtree(final)  # a folder without the marker is never a build in progress
        try:
            os.rename(staging, final)
        except OSError:
            if not is_complete(final):
                raise
            # Another process finished the same build first; keep its folder.
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_model(kind: str = "llama", **kwargs: Any) -> Path:
    """The folder of a ``build_model(kind=kind, **kwargs)`` build, building it once.

    A build goes into a temporary folder beside the final one, writes its marker file last and is
    renamed into place, so an interrupted build never looks complete and concurrent builders of
    the same key end with one complete folder.
    """
    key = build_key(kind, **kwargs)
    root = cache_root()
    final = root / key
    if is_complete(final):
        return final

    started = time.monotonic()
    marker = {"key": key, "kind": kind, "arguments": _build_arguments(kind, kwargs)}
    build_into_cache(final, marker, lambda staging: build_model(staging, kind, **kwargs))
    _log(f"model ready in {final} ({time.monotonic() - started:.1f} s)")
    return final
