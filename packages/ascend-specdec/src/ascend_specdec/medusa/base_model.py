"""A transformers causal LM behind the small ``BaseLM`` interface the trainer uses.

transformers is imported when a model is loaded, not with this module (it is the ``train``
extra of ascend-specdec, not a dependency).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


class TransformersBaseLM:
    """Greedy continuation with a KV cache, returning the last hidden state of every step."""

    def __init__(self, model, sample_ids: torch.Tensor, bos_token_id: int | None,
                 tokenizer=None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.decoder = model.get_decoder()
        self.output = model.get_output_embeddings()
        self.hidden_size = int(model.config.hidden_size)
        self.vocab_size = int(self.output.weight.shape[0])
        self.sample_ids = sample_ids
        self.bos_token_id = bos_token_id

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32,
             ) -> TransformersBaseLM:
        try:
            import transformers
        except ImportError as err:
            raise ImportError("training Medusa heads loads the base model with transformers: "
                              "pip install 'ascend-specdec[train]'") from err
        folder = Path(model_dir)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"--base {str(folder)!r} is not a model folder "
                                    "(no config.json)")
        if not any(folder.glob("*.safetensors")):
            raise FileNotFoundError(f"--base {str(folder)!r} has no *.safetensors weights; "
                                    "only safetensors checkpoints are loaded")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, use_safetensors=True)
        model.eval()
        sample_ids, bos, tokenizer = _prompt_vocabulary(folder, model.config)
        return cls(model, sample_ids, bos, tokenizer)

    def encode_text(self, source: str | Path, max_chars: int = 4_000_000) -> torch.Tensor:
        """Token ids [N] of a text file, or of a folder's .py / .txt / .md files (sorted)."""
        if self.tokenizer is None:
            raise ValueError("--prompt-text needs the base model's tokenizer, and its folder "
                             "has none (tokenizer.json / tokenizer_config.json)")
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".txt", ".md"))
        elif path.is_file():
            files = [path]
        else:
            raise FileNotFoundError(f"--prompt-text {str(path)!r} is neither a file nor a folder")
        parts, size = [], 0
        for file in files:
            text = file.read_text(encoding="utf-8", errors="replace")
            parts.append(text)
            size += len(text)
            if size >= max_chars:
                break
        ids = self.tokenizer("".join(parts), add_special_tokens=False).input_ids
        if not ids:
            raise ValueError(f"--prompt-text {str(path)!r} holds no text")
        return torch.tensor(ids, dtype=torch.long)

    def encode_prompts_file(self, source: str | Path) -> list[torch.Tensor]:
        """Token ids of each prompt of a prompts file (see ``read_prompts_file``)."""
        if self.tokenizer is None:
            raise ValueError("--prompts-file needs the base model's tokenizer, and its folder "
                             "has none (tokenizer.json / tokenizer_config.json)")
        return [torch.tensor(self.tokenizer(text, add_special_tokens=False).input_ids,
                             dtype=torch.long)
                for text in read_prompts_file(source, self.tokenizer)]

    def lm_head_weight(self) -> torch.Tensor:
        return self.output.weight.detach()

    @torch.no_grad()
    def greedy_with_hidden(self, prompts: torch.Tensor, num_new_tokens: int,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.decoder(input_ids=prompts, use_cache=True)
        cache = out.past_key_values
        hidden = [out.last_hidden_state]
        tokens = [prompts]
        for step in range(num_new_tokens):
            last = hidden[-1][:, -1]
            next_token = self.output(last).argmax(dim=-1, keepdim=True)
            tokens.append(next_token)
            if step == num_new_tokens - 1:
                break  # the newest token's hidden state would predict past the end
            out = self.decoder(input_ids=next_token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            hidden.append(out.last_hidden_state)
        return torch.cat(tokens, dim=1), torch.cat(hidden, dim=1).float()


def _prompt_vocabulary(folder: Path, config):
    """Token ids to draw random prompts from (no special tokens), the BOS id to prepend, and
    the tokenizer (None if the folder has none)."""
    special: set[int] = set()
    size = int(config.vocab_size)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(config, name, None)
        special.update(value if isinstance(value, list) else [value] if value is not None else [])
    bos = getattr(config, "bos_token_id", None)
    tokenizer = None
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(folder))
        except (OSError, ValueError, json.JSONDecodeError):
            tokenizer = None
        if tokenizer is not None:
            special.update(tokenizer.all_special_ids)
            size = min(size, len(tokenizer))  # rows past the tokenizer are padding
            # Prompts look like what the tokenizer gives vLLM: with a BOS only if it adds one.
            encoded = tokenizer("a").input_ids
            bos = tokenizer.bos_token_id if encoded and encoded[0] == tokenizer.bos_token_id \
                else None
    ids = torch.tensor([i for i in range(size) if i not in special], dtype=torch.long)
    return ids, bos if isinstance(bos, int) else None, tokenizer


def read_prompts_file(source: str | Path, tokenizer=None) -> list[str]:
    """The prompts of a file: one per non-empty line of a text file, or, for ``.jsonl``, one
    per line's JSON object: ``{"prompt": str}`` (a completion) or ``{"messages": [{"role":
    ..., "content": ...}, ...]}`` (a chat, rendered with ``tokenizer``'s chat template and
    the generation prompt, as vLLM's chat endpoint renders it)."""
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts-file {str(path)!r} is not a file")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    if path.suffix != ".jsonl":
        prompts = [line for line in lines if line.strip()]
    else:
        prompts = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as err:
                raise ValueError(f"--prompts-file {path} line {number} is not JSON ({err}); "
                                 "each line must be an object") from None
            if isinstance(record, dict) and isinstance(record.get("prompt"), str):
                prompts.append(record["prompt"])
            elif isinstance(record, dict) and isinstance(record.get("messages"), list):
                if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                    raise ValueError(f"--prompts-file {path} line {number} is a chat, but the "
                                     "base model's tokenizer has no chat template to render "
                                     "it; give completions ({\"prompt\": ...}) instead")
                prompts.append(tokenizer.apply_chat_template(
                    record["messages"], tokenize=False, add_generation_prompt=True))
            else:
                raise ValueError(f"--prompts-file {path} line {number}: expected an object "
                                 f"with \"prompt\" (a string) or \"messages\" (a list), got "
                                 f"{line[:80]!r}")
    if not prompts:
        raise ValueError(f"--prompts-file {path} holds no prompt")
    return prompts
