"""Small inputs shared by the Medusa tests: heads with known weights, a toy base model."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ascend_specdec.medusa import MedusaHeads, MedusaHeadsConfig


def random_heads(seed: int = 0, **fields) -> MedusaHeads:
    """Heads with random (non-zero) weights; a truncated vocabulary gets a shuffled map."""
    values = {"hidden_size": 16, "vocab_size": 40, "num_heads": 3, **fields}
    config = MedusaHeadsConfig(**values)
    generator = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(config)
    with torch.no_grad():
        for param in heads.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.5)
    if config.is_truncated:
        heads.token_map = torch.randperm(config.vocab_size, generator=generator)[
            :config.draft_vocab_size].sort().values
    return heads.eval()


class ToyBigramLM:
    """A base model whose next token depends on the current one only (a random map).

    Its continuations follow a functional graph, so heads can learn several steps ahead:
    the hidden state is a normalised embedding, the LM head a random matrix.
    """

    def __init__(self, vocab_size: int = 48, hidden_size: int = 32, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.embedding = torch.randn(vocab_size, hidden_size, generator=generator)
        self.lm_head = torch.randn(vocab_size, hidden_size, generator=generator)

    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.embedding[tokens], dim=-1) * self.hidden_size ** 0.5

    def greedy_with_hidden(self, prompts: torch.Tensor, num_new_tokens: int):
        tokens = prompts
        for _ in range(num_new_tokens):
            last = self.hidden(tokens[:, -1])
            tokens = torch.cat([tokens, (last @ self.lm_head.t()).argmax(-1, keepdim=True)], 1)
        return tokens, self.hidden(tokens[:, :-1])
