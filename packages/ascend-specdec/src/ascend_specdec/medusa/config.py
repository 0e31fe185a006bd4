"""The Medusa heads' ``config.json``, in the format vLLM's ``MedusaConfig`` reads.

Field names are vLLM's (and the FasterDecoding reference's): ``num_heads`` draft heads, each a
stack of ``num_hidden_layers`` residual blocks, then an LM head over ``truncated_vocab_size``
tokens of the base model's ``vocab_size`` (a ``token_map`` tensor in the weights lists them).
``original_lm_head`` means one LM head shared by every head; ``medusa_fc_bias`` that the
residual blocks' linear layers carry a bias (absent: no bias, as vLLM reads it).

The raw file is the truth: vLLM rewrites ``num_heads`` to ``num_speculative_tokens`` and
``vocab_size`` to the base model's when it builds its own config, which would hide exactly the
mismatches that ``check_against_base`` reports.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
ARCHITECTURE = "MedusaModel"
MODEL_TYPE = "medusa"


class MedusaConfigError(ValueError):
    """Medusa heads that cannot serve the configured base model or speculation settings."""


@dataclass(frozen=True)
class MedusaHeadsConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_hidden_layers: int = 1
    truncated_vocab_size: int | None = None
    original_lm_head: bool = False
    medusa_fc_bias: bool = False  # vLLM's default
    logit_scale: float = 1.0
    # Anything else the file carries (training provenance, FasterDecoding fields), kept verbatim.
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_hidden_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise MedusaConfigError(f"Medusa config: {name} must be a positive integer, "
                                        f"got {value!r}")
        if self.truncated_vocab_size is None:
            object.__setattr__(self, "truncated_vocab_size", self.vocab_size)
        if not 1 <= self.truncated_vocab_size <= self.vocab_size:
            raise MedusaConfigError(
                f"Medusa config: truncated_vocab_size={self.truncated_vocab_size} must be between "
                f"1 and vocab_size={self.vocab_size}"
            )

    @property
    def draft_vocab_size(self) -> int:
        """Rows of each LM head: the truncated vocabulary, or the whole one."""
        return int(self.truncated_vocab_size)

    @property
    def is_truncated(self) -> bool:
        return self.draft_vocab_size < self.vocab_size

    # ------------------------------------------------------------------ (de)serialisation

    def to_json_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        extra = fields.pop("extra")
        # Only num_heads and num_hidden_layers may contain "num": vLLM renames every key that
        # holds "num" and "heads" (or "layers") to those two, so another would overwrite them.
        clashing = [key for key in extra if "num" in key and ("heads" in key or "layers" in key)]
        if clashing:
            raise MedusaConfigError(f"Medusa config: extra keys {clashing} would be read by vLLM "
                                    "as num_heads / num_hidden_layers; rename them")
        return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **extra, **fields}

    @classmethod
    def from_json_dict(cls, raw: dict[str, Any]) -> MedusaHeadsConfig:
        data = dict(raw)
        # The same renaming vLLM's MedusaConfig.from_pretrained applies, so that FasterDecoding
        # checkpoints ("medusa_num_heads", "medusa_num_layers") read the same here and there.
        for key in list(data):
            if "num" in key and key not in ("num_heads", "num_hidden_layers"):
                if "heads" in key:
                    data["num_heads"] = data.pop(key)
                elif "layers" in key:
                    data["num_hidden_layers"] = data.pop(key)
        missing = [name for name in ("hidden_size", "vocab_size", "num_heads") if name not in data]
        if missing:
            raise MedusaConfigError(f"Medusa config: missing {missing} (have {sorted(data)})")
        known = {name: data.pop(name) for name in list(data)
                 if name in cls.__dataclass_fields__ and name != "extra"}
        for name in ("architectures", "model_type"):
            data.pop(name, None)
        return cls(**known, extra=data)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_FILE
        path.write_text(json.dumps(self.to_json_dict(), indent=2, sort_keys=True) + "\n",
                        encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> MedusaHeadsConfig:
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            raise MedusaConfigError(f"Medusa heads folder {str(directory)!r} has no {CONFIG_FILE}")
        raw = json.loads(path.read_text(encoding="utf-8"))
        architectures = raw.get("architectures") or [ARCHITECTURE]
        if ARCHITECTURE not in architectures and raw.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise MedusaConfigError(
                f"{path} describes {architectures} (model_type {raw.get('model_type')!r}), not "
                f"Medusa heads; expected architectures [{ARCHITECTURE!r}]"
            )
        return cls.from_json_dict(raw)

    # ------------------------------------------------------------------ checks

    def check_against_base(self, *, hidden_size: int, vocab_size: int,
                           num_speculative_tokens: int | None = None, where: str = "") -> None:
        """Raise MedusaConfigError unless these heads can draft for that base model."""
        source = f" ({where})" if where else ""
        if self.hidden_size != hidden_size:
            raise MedusaConfigError(
                f"Medusa heads{source} have hidden_size={self.hidden_size}, but the base model's "
                f"hidden size is {hidden_size}: the heads read the base model's last hidden "
                "state, so they must be trained for this base model "
                "(python -m ascend_specdec.train_medusa --base MODEL_DIR --out HEADS_DIR)"
            )
        if self.vocab_size != vocab_size:
            raise MedusaConfigError(
                f"Medusa heads{source} have vocab_size={self.vocab_size}, but the base model's "
                f"vocabulary has {vocab_size} tokens: draft token ids would not be the base "
                "model's; train heads for this base model"
            )
        if num_speculative_tokens is not None and num_speculative_tokens > self.num_heads:
            raise MedusaConfigError(
                f"num_speculative_tokens={num_speculative_tokens} is more than the "
                f"{self.num_heads} Medusa heads{source} (head i drafts the token i+1 places "
                f"after the next one): set num_speculative_tokens <= {self.num_heads}, or train "
                "more heads (--heads)"
            )
        if num_speculative_tokens is not None and num_speculative_tokens < 1:
            raise MedusaConfigError(
                f"num_speculative_tokens={num_speculative_tokens}: Medusa needs at least 1"
            )
