"""Self-distillation of Medusa heads from a base model's own greedy continuations.

The base model continues random token prefixes greedily; at every continuation position ``t``
its hidden state ``h_t`` becomes a training row whose target for head ``i`` is the token the
base model itself produced ``i + 2`` places later (``x_{t+2+i}``). Because the targets are the
base model's greedy choices, a head's top-1 accuracy on held-out rows is the rate at which the
base model accepts that head's draft, and the mean number of leading correct heads is the
acceptance length greedy verification would see. No dataset is needed.

The base model is anything with the small interface of ``BaseLM`` (the transformers adapter in
``ascend_specdec.medusa.base_model`` is one); this module imports neither vLLM nor transformers.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch.nn import functional as F

from ascend_specdec.medusa.config import MedusaHeadsConfig
from ascend_specdec.medusa.heads import MedusaHeads

IGNORE = -100


class BaseLM(Protocol):
    hidden_size: int
    vocab_size: int

    def lm_head_weight(self) -> torch.Tensor:
        """[vocab, hidden] LM-head weight (applied to the last hidden state)."""

    def greedy_with_hidden(self, prompts: torch.Tensor, num_new_tokens: int,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """prompts [B, P] -> (tokens [B, P + n], last-layer hidden states [B, P + n - 1, H]).

        Greedy continuation, EOS ignored; hidden state ``t`` is the one that predicted token
        ``t + 1`` (after the final norm, what the LM head reads).
        """


@dataclass(frozen=True)
class TrainOptions:
    heads: int = 3
    steps: int = 1500
    samples: int = 1500           # greedy continuations generated from the base model
    continuation_tokens: int = 64
    min_prompt_tokens: int = 4
    max_prompt_tokens: int = 24
    layers: int = 1               # residual blocks per head
    batch_size: int = 256
    lr: float = 1e-2
    weight_decay: float = 0.0
    share_lm_head: bool = False   # one LM head for all heads (vLLM's original_lm_head)
    freeze_lm_head: bool = False  # keep the LM head(s) equal to the base model's
    truncated_vocab: int | None = None  # keep only the most frequent draft tokens
    holdout: float = 0.1          # share of continuations kept for evaluation
    eval_every: int = 150
    generation_batch: int = 64
    seed: int = 0
    # Prompts from text (a file, or a folder of .py / .txt / .md files) instead of random
    # tokens: a trained model continues real text the way it will be served.
    prompt_text: str | None = None
    # Prompts from your traffic: one per line of a text file, or a JSONL file of
    # {"prompt": ...} completions or {"messages": [...]} chats (rendered with the model's
    # chat template). Each is used once; the held-out estimate comes from held-out prompts.
    prompts_file: str | None = None
    # The dtype the base model runs in while generating (None: the checkpoint's, which is what
    # vLLM serves): the heads learn the hidden states they will see.
    base_dtype: str | None = None

    def __post_init__(self) -> None:
        positive = ("heads", "steps", "samples", "layers", "batch_size", "generation_batch",
                    "eval_every", "min_prompt_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, "
                                 f"got {getattr(self, name)}")
        if self.continuation_tokens < self.heads + 2:
            raise ValueError(
                f"continuation_tokens={self.continuation_tokens} leaves no target for head "
                f"{self.heads}: it needs at least heads + 2 = {self.heads + 2}"
            )
        if self.max_prompt_tokens < self.min_prompt_tokens:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} < "
                             f"min_prompt_tokens={self.min_prompt_tokens}")
        if not 0.0 < self.holdout < 1.0:
            raise ValueError(f"holdout={self.holdout} must be between 0 and 1")
        if self.truncated_vocab is not None and self.truncated_vocab < 1:
            raise ValueError(f"truncated_vocab={self.truncated_vocab} must be at least 1")
        if self.prompt_text and self.prompts_file:
            raise ValueError("--prompt-text and --prompts-file are two sources of prompts; "
                             "give one")
        if self.base_dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"base_dtype={self.base_dtype!r}: use float32, bfloat16 or "
                             "float16 (or leave it out for the checkpoint's dtype)")


@dataclass
class DistillationSet:
    """Training rows: hidden states [N, H] and per-head targets [N, K] (IGNORE where none).

    ``sequence_rows``: rows per continuation, in order, when every continuation has as many
    (0: unknown), which lets ``evaluate`` walk each one as serving does; ``prompts``: the
    token ids of the prompts those continuations came from (kept for the held-out set)."""

    features: torch.Tensor
    targets: torch.Tensor
    sequence_rows: int = 0
    prompts: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return self.features.shape[0]


@dataclass
class Evaluation:
    top1: list[float]             # per head, over rows that have that head's target
    acceptance_length: float      # 1 + accepted drafts per verification step
    loss: float

    def describe(self) -> str:
        heads = " ".join(f"h{i + 1} {acc:.3f}" for i, acc in enumerate(self.top1))
        return (f"held-out top-1 {heads} | acceptance length {self.acceptance_length:.2f} | "
                f"held-out loss {self.loss:.3f}")


@dataclass
class TrainResult:
    heads: MedusaHeads
    history: list[dict] = field(default_factory=list)
    initial: Evaluation | None = None
    final: Evaluation | None = None
    seconds: dict[str, float] = field(default_factory=dict)


# ---------------------------------------------------------------------------------- data


def _prompt_batches(count: int, options: TrainOptions, bos_token_id: int | None,
                    generator: torch.Generator, pick) -> list[torch.Tensor]:
    """``count`` prompts as batches [b, P] of equal length (one random length per batch);
    ``pick(size, length)`` gives a batch's token ids [size, length]."""
    batches = []
    remaining = count
    while remaining:
        size = min(options.generation_batch, remaining)
        length = int(torch.randint(options.min_prompt_tokens, options.max_prompt_tokens + 1,
                                   (1,), generator=generator))
        prompts = pick(size, length)
        if bos_token_id is not None:
            bos = torch.full((size, 1), bos_token_id, dtype=prompts.dtype)
            prompts = torch.cat([bos, prompts], dim=1)
        batches.append(prompts)
        remaining -= size
    return batches


def random_prompts(count: int, options: TrainOptions, sample_ids: torch.Tensor,
                   bos_token_id: int | None, generator: torch.Generator,
                   ) -> list[torch.Tensor]:
    """Prompts of random tokens drawn from ``sample_ids``."""
    def pick(size: int, length: int) -> torch.Tensor:
        return sample_ids[torch.randint(0, sample_ids.numel(), (size, length),
                                        generator=generator)]

    return _prompt_batches(count, options, bos_token_id, generator, pick)


def text_prompts(count: int, options: TrainOptions, text_ids: torch.Tensor,
                 bos_token_id: int | None, generator: torch.Generator) -> list[torch.Tensor]:
    """Prompts that are windows of ``text_ids`` [N] at random offsets."""
    def pick(size: int, length: int) -> torch.Tensor:
        if text_ids.numel() <= length:
            raise ValueError(f"prompt text of {text_ids.numel()} tokens is shorter than a "
                             f"{length}-token prompt; give more text or lower "
                             "--max-prompt-tokens")
        starts = torch.randint(0, text_ids.numel() - length, (size,), generator=generator)
        return text_ids[starts[:, None] + torch.arange(length)]

    return _prompt_batches(count, options, bos_token_id, generator, pick)


def distillation_rows(tokens: torch.Tensor, hidden: torch.Tensor, prompt_len: int,
                      num_heads: int) -> DistillationSet:
    """Rows from continuation positions: h_t -> (x_{t+2}, ..., x_{t+1+K}).

    ``tokens`` [B, T], ``hidden`` [B, T-1, H] (hidden t predicted token t+1). Rows start at the
    last prompt position, the first one whose next token the base model chose itself.
    """
    batch, total = tokens.shape
    first, last = prompt_len - 1, total - 3  # the last row still has x_{t+2}
    if last < first:
        raise ValueError(f"{total - prompt_len} continuation tokens give no training rows")
    positions = torch.arange(first, last + 1)
    features = hidden[:, positions]  # [B, R, H]
    offsets = positions[:, None] + 2 + torch.arange(num_heads)[None, :]  # [R, K]
    valid = offsets < total
    targets = tokens[:, offsets.clamp(max=total - 1)]  # [B, R, K]
    targets = targets.masked_fill(~valid, IGNORE)
    return DistillationSet(features.reshape(-1, hidden.shape[-1]).float(),
                           targets.reshape(-1, num_heads).long(), sequence_rows=len(positions))


def concat(sets: list[DistillationSet]) -> DistillationSet:
    per_sequence = {s.sequence_rows for s in sets}
    return DistillationSet(torch.cat([s.features for s in sets]),
                           torch.cat([s.targets for s in sets]),
                           sequence_rows=per_sequence.pop() if len(per_sequence) == 1 else 0,
                           prompts=[p for s in sets for p in s.prompts])


def file_prompt_batches(prompts: list[torch.Tensor], options: TrainOptions,
                        bos_token_id: int | None, generator: torch.Generator,
                        ) -> tuple[list[torch.Tensor], int]:
    """(batches, held-out count) from a prompts file's token ids, each prompt used once.

    ``min(samples, len(prompts))`` prompts are drawn in a seeded order; the first
    ``max(1, round(count * holdout))`` of them are held out and come first (their
    continuations are the held-out rows), then the training prompts. Within each part,
    prompts are sorted by length and batched; a batch keeps its shortest prompt's length
    (at most ``max_prompt_tokens``) of every prompt's last tokens, after one BOS.
    """
    count = min(options.samples, len(prompts))
    num_held = max(1, round(count * options.holdout))
    if count - num_held < 1:
        raise ValueError(f"--prompts-file gave {len(prompts)} prompts and --samples "
                         f"{options.samples}: with holdout={options.holdout} none is left for "
                         "training; give at least 2 prompts")
    order = torch.randperm(len(prompts), generator=generator)[:count].tolist()

    def bodies(indices: list[int]) -> list[torch.Tensor]:
        out = []
        for i in indices:
            ids = prompts[i]
            if bos_token_id is not None and len(ids) and int(ids[0]) == bos_token_id:
                ids = ids[1:]  # a chat template that writes BOS itself: one BOS in all
            if len(ids):
                out.append(ids)
        return sorted(out, key=len)

    def batches(indices: list[int]) -> list[torch.Tensor]:
        chosen, result = bodies(indices), []
        for start in range(0, len(chosen), options.generation_batch):
            group = chosen[start:start + options.generation_batch]
            length = min(min(len(ids) for ids in group), options.max_prompt_tokens)
            batch = torch.stack([ids[len(ids) - length:] for ids in group])
            if bos_token_id is not None:
                bos = torch.full((len(group), 1), bos_token_id, dtype=batch.dtype)
                batch = torch.cat([bos, batch], dim=1)
            result.append(batch)
        return result

    held = batches(order[:num_held])
    return held + batches(order[num_held:]), sum(len(b) for b in held)


def generate_distillation_data(base: BaseLM, options: TrainOptions, sample_ids: torch.Tensor,
                               bos_token_id: int | None,
                               log: Callable[[str], None] = print,
                               text_ids: torch.Tensor | None = None,
                               file_prompts: list[torch.Tensor] | None = None,
                               held_out_only: bool = False,
                               ) -> tuple[DistillationSet | None, DistillationSet]:
    """(train, held-out) rows from ``options.samples`` greedy continuations.

    Prompts come from ``file_prompts`` (a prompts file's token ids, each used once, held-out
    prompts apart) when given, else windows of ``text_ids``, else random tokens of
    ``sample_ids``. ``held_out_only``: every continuation is held out (train is None), to
    measure heads trained before.
    """
    generator = torch.Generator().manual_seed(options.seed)
    num_held = max(1, round(options.samples * options.holdout))
    if file_prompts is not None:
        batches, num_held = file_prompt_batches(file_prompts, options, bos_token_id, generator)
    elif text_ids is not None:
        batches = text_prompts(options.samples, options, text_ids, bos_token_id, generator)
    else:
        batches = random_prompts(options.samples, options, sample_ids, bos_token_id, generator)
    total = sum(len(batch) for batch in batches)
    if held_out_only:
        num_held = total
    train_sets, held_sets = [], []
    done = 0
    started = time.monotonic()
    for prompts in batches:
        with torch.no_grad():
            tokens, hidden = base.greedy_with_hidden(prompts, options.continuation_tokens)
        rows = distillation_rows(tokens, hidden, prompts.shape[1], options.heads)
        rows_per_seq = len(rows) // prompts.shape[0]  # rows are sequence-major
        # The first num_held continuations are held out whole: evaluation uses unseen prompts.
        held = min(max(num_held - done, 0), prompts.shape[0])
        if held:
            split = held * rows_per_seq
            held_sets.append(DistillationSet(rows.features[:split], rows.targets[:split],
                                             rows_per_seq, prompts[:held].tolist()))
            rows = DistillationSet(rows.features[split:], rows.targets[split:], rows_per_seq)
        if len(rows):
            train_sets.append(rows)
        done += prompts.shape[0]
        log(f"generating greedy continuations: {done}/{total} "
            f"({time.monotonic() - started:.1f} s)")
    if held_out_only:
        return None, concat(held_sets)
    if not train_sets:
        raise ValueError(f"samples={options.samples} with holdout={options.holdout} leaves no "
                         "continuation for training; raise --samples")
    return concat(train_sets), concat(held_sets)


# ---------------------------------------------------------------------------------- model


def token_frequencies(targets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    kept = targets[targets != IGNORE]
    return torch.bincount(kept, minlength=vocab_size)[:vocab_size]


def choose_token_map(targets: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target tokens (ties by id), sorted by id."""
    if size > vocab_size:
        raise ValueError(f"truncated vocabulary of {size} is larger than the vocabulary "
                         f"({vocab_size})")
    counts = token_frequencies(targets, vocab_size).double()
    # Stable order: frequency first, then the lower id.
    order = torch.argsort(counts - torch.arange(vocab_size).double() / (2 * vocab_size),
                          descending=True)
    return order[:size].sort().values


def to_draft_vocab(targets: torch.Tensor, token_map: torch.Tensor | None,
                   vocab_size: int) -> torch.Tensor:
    """Base-vocabulary targets -> draft-vocabulary rows (IGNORE if not in the map)."""
    if token_map is None:
        return targets
    lookup = torch.full((vocab_size,), IGNORE, dtype=torch.long)
    lookup[token_map] = torch.arange(token_map.numel())
    return torch.where(targets == IGNORE, targets, lookup[targets.clamp(min=0)])


def init_heads(base_lm_head: torch.Tensor, options: TrainOptions,
               token_map: torch.Tensor | None) -> MedusaHeads:
    vocab_size, hidden_size = base_lm_head.shape
    config = MedusaHeadsConfig(
        hidden_size=hidden_size, vocab_size=vocab_size, num_heads=options.heads,
        num_hidden_layers=options.layers,
        truncated_vocab_size=None if token_map is None else token_map.numel(),
        original_lm_head=options.share_lm_head, medusa_fc_bias=True,
    )
    heads = MedusaHeads(config)
    heads.zero_init_blocks()
    rows = base_lm_head.float() if token_map is None else base_lm_head.float()[token_map]
    with torch.no_grad():
        for i in range(1 if options.share_lm_head else options.heads):
            heads.head_weight(i).copy_(rows)
    if token_map is not None:
        heads.token_map = token_map.clone()
    return heads


def head_losses(heads: MedusaHeads, features: torch.Tensor, targets: torch.Tensor,
                ) -> torch.Tensor:
    """Cross-entropy per head [K] over the rows that have a target for it."""
    logits = heads.logits(features)  # [N, K, V']
    # Flattened rows: cross_entropy over a [N, V', K] view is several times slower on CPU.
    per_row = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              ignore_index=IGNORE, reduction="none").view_as(targets)  # [N, K]
    counts = (targets != IGNORE).sum(dim=0).clamp(min=1)
    return per_row.sum(dim=0) / counts


@torch.no_grad()
def evaluate(heads: MedusaHeads, data: DistillationSet, chunk: int = 4096) -> Evaluation:
    """Top-1 accuracy per head and the greedy acceptance length, in base-vocabulary terms.

    With the continuations' boundaries known (``data.sequence_rows``), the acceptance length
    is that of serving: each continuation walked from its first row, every verification
    step accepting its leading correct drafts and moving past them and the target's own
    token. Otherwise it is the mean over every row, which overstates serving wherever easy
    stretches (long accepted runs) are crossed in few steps."""
    k = heads.num_heads
    correct = torch.zeros(k)
    present = torch.zeros(k)
    accepted_sum = 0.0
    complete_rows = 0
    leading_runs = []
    loss_sum = torch.zeros(k)
    vocab = heads.config.vocab_size
    for start in range(0, len(data), chunk):
        features = data.features[start:start + chunk]
        targets = data.targets[start:start + chunk]
        drafts = heads.propose(features)  # [n, K] base ids
        has = targets != IGNORE
        hits = (drafts == targets) & has
        correct += hits.sum(dim=0)
        present += has.sum(dim=0)
        complete = has.all(dim=1)
        # Leading run of hits: accepted draft tokens under greedy verification.
        leading = hits.long().cumprod(dim=1).sum(dim=1)
        accepted_sum += float(leading[complete].sum())
        complete_rows += int(complete.sum())
        leading_runs.append(leading.masked_fill(~complete, -1))
        draft_targets = to_draft_vocab(targets, heads.token_map, vocab)
        loss_sum += head_losses(heads, features, draft_targets) * has.sum(dim=0)
    top1 = (correct / present.clamp(min=1)).tolist()
    loss = float((loss_sum / present.clamp(min=1)).mean())
    length = 1.0 + accepted_sum / max(complete_rows, 1)
    if data.sequence_rows and leading_runs:
        length = served_walk(torch.cat(leading_runs), data.sequence_rows)
    return Evaluation(top1=top1, acceptance_length=length, loss=loss)


def served_walk(leading: torch.Tensor, sequence_rows: int) -> float:
    """1 + accepted drafts per step over continuations of ``sequence_rows`` rows each, walked
    as a verifier does; ``leading`` [N]: accepted drafts at each row, -1 where the row lacks
    targets for every head (a continuation's end), where its walk stops."""
    accepted = steps = 0
    for sequence in leading.view(-1, sequence_rows).tolist():
        row = 0
        while row < sequence_rows and sequence[row] >= 0:
            accepted += sequence[row]
            steps += 1
            row += sequence[row] + 1
    return 1.0 + accepted / max(steps, 1)


def candidate_ranks(heads: MedusaHeads, data: DistillationSet, chunk: int = 4096
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and head, the rank of the true token among the head's ``MAX_TOP_K`` best
    candidates (``MAX_TOP_K``: not among them), and which rows have a true token for every
    head (a continuation's last rows do not)."""
    from ascend_specdec.medusa.tree import MAX_TOP_K

    ranks, complete = [], []
    width = [MAX_TOP_K] * heads.num_heads
    for start in range(0, len(data), chunk):
        targets = data.targets[start:start + chunk]
        candidates = torch.stack(heads.propose_top_k(data.features[start:start + chunk],
                                                     width), dim=1)  # [n, heads, K]
        hits = candidates == targets.unsqueeze(-1)
        rank = torch.where(hits.any(-1), hits.long().argmax(-1), MAX_TOP_K)
        ranks.append(rank)
        complete.append((targets != IGNORE).all(dim=1))
    return torch.cat(ranks), torch.cat(complete)


def tree_estimates(heads: MedusaHeads, held_out: DistillationSet, dtype: torch.dtype,
                   budgets: tuple[int, ...] = (4, 8, 16, 32)) -> dict:
    """The heads' measured paths (``path_frequencies``) on the held-out rows, in the
    served dtype, and for each node budget the best tree with its served acceptance
    length (the continuations walked as a verifier does, as ``evaluate``)."""
    import copy

    from ascend_specdec.medusa.tree import (
        accepted_per_row,
        choose_tree,
        parse_tree,
        path_frequencies,
    )

    served = copy.deepcopy(heads).to(dtype)
    ranks, complete = candidate_ranks(served, DistillationSet(held_out.features.to(dtype),
                                                              held_out.targets))
    frequencies = path_frequencies(ranks[complete])

    def served(tree) -> float:
        leading = accepted_per_row(ranks, tree).masked_fill(~complete, -1)
        return (served_walk(leading, held_out.sequence_rows) if held_out.sequence_rows
                else 1.0 + float(leading[complete].float().mean()))

    chain = [[0] * depth for depth in range(1, heads.num_heads + 1)]
    trees = {}
    for budget in budgets:
        if budget > len(frequencies):
            break
        tree = choose_tree(frequencies, budget, num_heads=heads.num_heads)
        trees[budget] = {"acceptance_length": served(tree),
                         "paths": [list(p) for p in tree.paths]}
    return {"rows": int(complete.sum()),
            "chain_acceptance_length": served(parse_tree(chain, num_heads=heads.num_heads,
                                                         num_nodes=len(chain))),
            "paths": [[list(path), frequency] for path, frequency in frequencies],
            "trees": trees}


def served_estimate(heads: MedusaHeads, held_out: DistillationSet,
                    dtype: torch.dtype) -> Evaluation:
    """``evaluate`` for the heads as they will be served: a copy cast to ``dtype``, on the
    held-out hidden states in ``dtype`` (training itself runs in float32)."""
    import copy

    return evaluate(copy.deepcopy(heads).to(dtype),
                    DistillationSet(held_out.features.to(dtype), held_out.targets,
                                    held_out.sequence_rows))


def train_heads(train: DistillationSet, held_out: DistillationSet, base_lm_head: torch.Tensor,
                options: TrainOptions, log: Callable[[str], None] = print) -> TrainResult:
    """Fit one residual block per head (and its LM head unless frozen) to the targets."""
    torch.manual_seed(options.seed)
    vocab_size = base_lm_head.shape[0]
    token_map = None
    if options.truncated_vocab is not None and options.truncated_vocab < vocab_size:
        token_map = choose_token_map(train.targets, vocab_size, options.truncated_vocab)
    heads = init_heads(base_lm_head, options, token_map)
    targets = to_draft_vocab(train.targets, token_map, vocab_size)

    lm_params = [p for n, p in heads.named_parameters() if "lm_head" in n]
    block_params = [p for n, p in heads.named_parameters() if "lm_head" not in n]
    groups = [{"params": block_params}]
    if options.freeze_lm_head:
        for p in lm_params:
            p.requires_grad_(False)
    else:
        # The LM head starts at the base model's: move it more gently than the fresh blocks.
        groups.append({"params": lm_params, "lr": options.lr * 0.3})
    optimizer = torch.optim.AdamW(groups, lr=options.lr, weight_decay=options.weight_decay)
    warmup = max(1, options.steps // 20)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, options.steps - warmup)
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    result = TrainResult(heads=heads)
    result.initial = evaluate(heads, held_out)
    log(f"step 0/{options.steps}: {result.initial.describe()}")
    generator = torch.Generator().manual_seed(options.seed + 1)
    started = time.monotonic()
    running = None
    heads.train()
    for step in range(1, options.steps + 1):
        batch = torch.randint(0, len(train), (options.batch_size,), generator=generator)
        losses = head_losses(heads, train.features[batch], targets[batch])
        loss = losses.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        value = loss.item()
        running = value if running is None else 0.9 * running + 0.1 * value
        if step % options.eval_every == 0 or step == options.steps:
            heads.eval()
            evaluation = evaluate(heads, held_out)
            heads.train()
            result.history.append({"step": step, "train_loss": running,
                                   "held_out_top1": evaluation.top1,
                                   "acceptance_length": evaluation.acceptance_length,
                                   "held_out_loss": evaluation.loss})
            log(f"step {step}/{options.steps}: train loss {running:.3f} | "
                f"{evaluation.describe()} ({time.monotonic() - started:.1f} s)")
            result.final = evaluation
    heads.eval()
    for p in heads.parameters():
        p.requires_grad_(False)
    result.seconds["train"] = time.monotonic() - started
    return result
