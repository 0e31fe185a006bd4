"""Medusa heads: residual blocks over the base model's last hidden state, then an LM head.

Head ``i`` (0-based) reads the hidden state ``h_t`` of the last accepted token ``x_t`` and
predicts ``x_{t+2+i}``: the base model's own LM head already gives ``x_{t+1}``, so head 0 drafts
the token one place after it. Parameter names are the ones vLLM's ``Medusa`` model loads
(``blocks.{head}.layers.{layer}.weight|bias``, ``lm_heads.{head}.weight`` or ``lm_head.weight``
when one LM head is shared, and ``token_map``), so a ``state_dict`` is a checkpoint vLLM reads.

Imports no vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from ascend_specdec.medusa.config import MedusaConfigError, MedusaHeadsConfig


class ResidualBlock(nn.Module):
    """``x <- x + SiLU(W x + b)``, ``num_layers`` times."""

    def __init__(self, hidden_size: int, num_layers: int, bias: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias)
                                    for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x

    def zero_init(self) -> None:
        """Make the block the identity, so a fresh head starts as its LM head alone."""
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaHeadsConfig) -> None:
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(
            ResidualBlock(config.hidden_size, config.num_hidden_layers, config.medusa_fc_bias)
            for _ in range(config.num_heads)
        )
        rows = config.draft_vocab_size
        if config.original_lm_head:
            self.lm_head = nn.Linear(config.hidden_size, rows, bias=False)
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, rows, bias=False)
                                          for _ in range(config.num_heads))
        # token_map[j] = the base-vocabulary id of draft-vocabulary row j (identity if None).
        token_map = (torch.arange(rows, dtype=torch.long) if config.is_truncated else None)
        self.register_buffer("token_map", token_map)
        self.row_offset = 0  # the first draft-vocabulary row this rank's LM heads hold

    def shard_lm_heads(self, rank: int, world_size: int) -> None:
        """Keep only tensor-parallel rank ``rank``'s share of every LM head's rows, as vLLM's
        vocab-parallel LM head does (contiguous, sizes differing by at most one row). The
        residual blocks stay whole. ``propose`` then needs ``gather`` to find the best row
        across the ranks."""
        rows = self.config.draft_vocab_size
        if not 0 <= rank < world_size or world_size > rows or rows >= 2 ** 24:
            raise MedusaConfigError(f"cannot shard {rows} LM-head rows for tensor-parallel "
                                    f"rank {rank} of {world_size}")
        base, extra = divmod(rows, world_size)
        start = rank * base + min(rank, extra)
        end = start + base + (rank < extra)
        for head in [self.lm_head] if self.config.original_lm_head else self.lm_heads:
            head.weight = nn.Parameter(head.weight.data[start:end].clone(),
                                       requires_grad=False)
            head.out_features = end - start
        self.row_offset = start

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def head_weight(self, head: int) -> torch.Tensor:
        """The LM-head weight [draft_vocab, hidden] that head ``head`` uses."""
        return self.lm_head.weight if self.config.original_lm_head else self.lm_heads[head].weight

    def hidden(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, heads, hidden]: each head's residual blocks."""
        k = self._heads_to_run(num_heads)
        return torch.stack([self.blocks[i](hidden_states) for i in range(k)], dim=1)

    def logits(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """[tokens, hidden] -> [tokens, heads, draft_vocab] (scaled by logit_scale)."""
        per_head = self.hidden(hidden_states, num_heads)
        if self.config.original_lm_head:
            # One shared LM head: a single matmul over every head's rows reads its weight once.
            logits = per_head @ self.lm_head.weight.t()
        else:
            logits = torch.stack([self.lm_heads[i](per_head[:, i])
                                  for i in range(per_head.shape[1])], dim=1)
        if self.config.logit_scale != 1.0:
            logits = logits * self.config.logit_scale
        return logits

    def draft_vocab_to_base(self, indices: torch.Tensor) -> torch.Tensor:
        return indices if self.token_map is None else self.token_map[indices]

    def propose(self, hidden_states: torch.Tensor, num_heads: int | None = None,
                gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Top-1 chain: [requests, hidden] -> base-vocabulary token ids [requests, heads].

        Sharded heads (``shard_lm_heads``) pass ``gather``: every rank's tensor stacked on a
        new first axis, in rank order (an all-gather). Each rank offers its best row and its
        logit in one float32 tensor (one collective; row ids are exact in float32 below
        2**24); the highest logit wins, the lower row among equal ones, as an argmax over the
        whole vocabulary would pick."""
        logits = self.logits(hidden_states, num_heads)
        best = logits.argmax(dim=-1)
        if gather is None:
            return self.draft_vocab_to_base(best + self.row_offset)
        offer = torch.stack([logits.gather(-1, best.unsqueeze(-1)).squeeze(-1).float(),
                             (best + self.row_offset).float()])
        values, rows = gather(offer).unbind(dim=1)  # [ranks, requests, heads] each
        winner = values.argmax(dim=0, keepdim=True)  # the first of equal maxima: lower rows
        return self.draft_vocab_to_base(rows.gather(0, winner).squeeze(0).long())

    def propose_top_k(self, hidden_states: torch.Tensor, top_k: Sequence[int],
                      gather: Callable[[torch.Tensor], torch.Tensor] | None = None
                      ) -> list[torch.Tensor]:
        """Each head's best candidates, for a tree: head ``h`` offers ``top_k[h]`` base-
        vocabulary token ids ``[requests, top_k[h]]``, best first (heads past
        ``len(top_k)`` do not run). Sharded heads gather every rank's best ``top_k[h]``
        logits and rows and keep the best of those, ties to the lower row."""
        logits = self.logits(hidden_states, len(top_k))
        width = max(top_k)
        values, best = logits.topk(min(width, logits.shape[-1]), dim=-1, sorted=True)
        rows = best + self.row_offset
        if gather is not None:
            offer = torch.stack([values.float(), rows.float()])  # [2, requests, heads, k]
            gathered = gather(offer)  # [ranks, 2, requests, heads, k]
            values = torch.cat(gathered[:, 0].unbind(0), dim=-1)
            rows = torch.cat(gathered[:, 1].unbind(0), dim=-1).long()
            # Highest logit first, the lower row among equal ones: sort by row, then stably
            # by value.
            by_row = rows.argsort(dim=-1)
            values, rows = values.gather(-1, by_row), rows.gather(-1, by_row)
            order = values.argsort(dim=-1, descending=True, stable=True)[..., :width]
            rows = rows.gather(-1, order)
        return [self.draft_vocab_to_base(rows[:, head, :k]) for head, k in enumerate(top_k)]

    def forward(self, hidden_states: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        return self.propose(hidden_states, num_heads)

    def zero_init_blocks(self) -> None:
        for block in self.blocks:
            block.zero_init()

    def _heads_to_run(self, num_heads: int | None) -> int:
        if num_heads is None:
            return self.num_heads
        if not 1 <= num_heads <= self.num_heads:
            raise MedusaConfigError(
                f"asked for {num_heads} draft tokens from {self.num_heads} Medusa heads; "
                f"at most {self.num_heads}"
            )
        return num_heads


def last_accepted_rows(num_draft_tokens: list[int], num_sampled_tokens: list[int]) -> list[int]:
    """Row of each request's last accepted token in the verified step's hidden states.

    The target model scores ``num_draft_tokens[r] + 1`` rows per request (its drafts and the
    bonus position) and ``num_sampled_tokens[r]`` of them were kept (accepted drafts plus the
    next token); the hidden state that predicts past the kept ones is the last kept row. A
    request that had no drafts this step has one row, which is then its row.
    """
    if len(num_draft_tokens) != len(num_sampled_tokens):
        raise ValueError(f"{len(num_draft_tokens)} draft counts but {len(num_sampled_tokens)} "
                         "sampled counts: one of each per request")
    rows, offset = [], 0
    for drafts, sampled in zip(num_draft_tokens, num_sampled_tokens, strict=True):
        if not 0 <= sampled <= drafts + 1:
            raise ValueError(f"{sampled} sampled tokens for {drafts} drafts: at most drafts + 1")
        # A request with nothing sampled (a partial prefill) still gets a row, its last one;
        # its drafts are discarded.
        rows.append(offset + max(sampled, 1) - 1)
        offset += drafts + 1
    return rows
