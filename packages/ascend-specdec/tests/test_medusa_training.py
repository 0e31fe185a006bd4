"""Self-distillation: rows line up with the base model's tokens, loss falls, heads learn."""

import json

import pytest
import torch

from ascend_specdec.medusa import TrainOptions, load_heads, save_heads
from ascend_specdec.medusa.training import (
    IGNORE,
    DistillationSet,
    choose_token_map,
    distillation_rows,
    evaluate,
    generate_distillation_data,
    head_losses,
    init_heads,
    served_walk,
    text_prompts,
    to_draft_vocab,
    train_heads,
)

from medusa_cases import ToyBigramLM

QUIET = {"log": lambda message: None}


def test_rows_pair_each_hidden_state_with_the_tokens_two_and_more_ahead():
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])  # prompt 10 11 12, continuation 13..
    hidden = torch.arange(6, dtype=torch.float32).reshape(1, 6, 1)  # hidden t predicts t + 1
    rows = distillation_rows(tokens, hidden, prompt_len=3, num_heads=3)
    # First row: the last prompt position (t=2), whose next token (13) the base chose; head i
    # targets x_{t+2+i}. The last row is t=4 (x_6 is the last token two ahead).
    assert rows.features.flatten().tolist() == [2.0, 3.0, 4.0]
    assert rows.targets.tolist() == [[14, 15, 16], [15, 16, IGNORE], [16, IGNORE, IGNORE]]


def test_generated_rows_hold_out_whole_continuations():
    base = ToyBigramLM()
    options = TrainOptions(heads=2, samples=20, continuation_tokens=8, holdout=0.25,
                           generation_batch=6, min_prompt_tokens=2, max_prompt_tokens=5)
    train, held = generate_distillation_data(base, options, torch.arange(base.vocab_size), None,
                                             **QUIET)
    rows_per_continuation = options.continuation_tokens - 1
    assert len(held) == 5 * rows_per_continuation
    assert len(train) == 15 * rows_per_continuation
    # Every target is what the toy base model produces from the token before.
    step = lambda t: int((base.hidden(torch.tensor(t)) @ base.lm_head.t()).argmax())  # noqa: E731
    first = train.features[0]
    current = int((first @ base.lm_head.t()).argmax())  # the next token the base chose
    assert train.targets[0].tolist() == [step(current), step(step(current))]


def test_token_map_keeps_the_most_frequent_targets():
    targets = torch.tensor([[5, 5], [5, 7], [7, IGNORE], [3, 9]])
    assert choose_token_map(targets, vocab_size=10, size=2).tolist() == [5, 7]
    token_map = torch.tensor([5, 7])
    assert to_draft_vocab(targets, token_map, 10).tolist() == [[0, 0], [0, 1], [1, IGNORE],
                                                                [IGNORE, IGNORE]]


def test_heads_start_as_the_base_lm_head():
    base = ToyBigramLM()
    heads = init_heads(base.lm_head_weight(), TrainOptions(heads=3), token_map=None)
    hidden = base.hidden(torch.arange(10))
    expected = (hidden @ base.lm_head.t()).argmax(-1)
    assert torch.equal(heads.propose(hidden), expected[:, None].expand(10, 3))


def test_acceptance_length_counts_leading_hits_only():
    base = ToyBigramLM(vocab_size=8, hidden_size=8)
    heads = init_heads(base.lm_head_weight(), TrainOptions(heads=3), token_map=None)
    features = base.hidden(torch.tensor([0, 1]))
    drafts = heads.propose(features)
    miss = lambda t: (t + 1) % 8  # noqa: E731
    targets = torch.stack([
        torch.stack([drafts[0, 0], miss(drafts[0, 1]), drafts[0, 2]]),  # 1 leading hit
        torch.stack([drafts[1, 0], drafts[1, 1], drafts[1, 2]]),  # 3 leading hits
    ])
    evaluation = evaluate(heads, DistillationSet(features, targets))
    assert evaluation.top1 == [1.0, 0.5, 1.0]
    assert evaluation.acceptance_length == pytest.approx(1 + (1 + 3) / 2)


@pytest.mark.parametrize("extra", [{}, {"share_lm_head": True, "freeze_lm_head": True},
                                   {"share_lm_head": True, "truncated_vocab": 24}])
def test_training_lowers_the_loss_and_raises_acceptance(extra):
    base = ToyBigramLM()
    options = TrainOptions(heads=3, samples=200, continuation_tokens=12, steps=300,
                           eval_every=100, batch_size=64, min_prompt_tokens=2,
                           max_prompt_tokens=6, **extra)
    train, held = generate_distillation_data(base, options, torch.arange(base.vocab_size), None,
                                             **QUIET)
    result = train_heads(train, held, base.lm_head_weight(), options, **QUIET)
    assert [h["step"] for h in result.history] == [100, 200, 300]
    assert result.final.loss < 0.5 * result.initial.loss
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    # A bigram base model is predictable several steps ahead from its hidden state.
    assert result.final.acceptance_length > 3.0 > 1.5 > result.initial.acceptance_length
    assert all(not p.requires_grad for p in result.heads.parameters())
    if extra.get("freeze_lm_head"):
        assert torch.equal(result.heads.lm_head.weight, base.lm_head_weight())
    if "truncated_vocab" in extra:
        assert result.heads.token_map.numel() == 24


def test_trained_heads_round_trip_through_a_checkpoint(tmp_path):
    base = ToyBigramLM()
    options = TrainOptions(heads=2, samples=60, continuation_tokens=8, steps=50, eval_every=50,
                           batch_size=32, share_lm_head=True, truncated_vocab=30)
    train, held = generate_distillation_data(base, options, torch.arange(base.vocab_size), None,
                                             **QUIET)
    result = train_heads(train, held, base.lm_head_weight(), options, **QUIET)
    save_heads(result.heads, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"]
    assert (config["hidden_size"], config["vocab_size"], config["num_heads"]) == (32, 48, 2)
    assert (config["truncated_vocab_size"], config["original_lm_head"]) == (30, True)
    loaded = load_heads(tmp_path)
    assert evaluate(loaded, held) == evaluate(result.heads, held)
    losses = head_losses(loaded, held.features,
                         to_draft_vocab(held.targets, loaded.token_map, 48))
    assert losses.shape == (2,)


@pytest.mark.parametrize("fields, message", [
    ({"heads": 0}, "--heads must be at least 1"),
    ({"heads": 4, "continuation_tokens": 5}, "needs at least heads \\+ 2 = 6"),
    ({"holdout": 1.0}, "holdout=1.0"),
    ({"min_prompt_tokens": 9, "max_prompt_tokens": 3}, "max_prompt_tokens=3"),
])
def test_bad_options(fields, message):
    with pytest.raises(ValueError, match=message):
        TrainOptions(**fields)


def test_text_prompts_are_windows_of_the_text_with_the_bos_first():
    text = torch.arange(1000, 1300)
    options = TrainOptions(samples=70, min_prompt_tokens=5, max_prompt_tokens=9,
                           generation_batch=32)
    batches = text_prompts(70, options, text, bos_token_id=7,
                           generator=torch.Generator().manual_seed(0))
    assert [b.shape[0] for b in batches] == [32, 32, 6]
    for batch in batches:
        assert (batch[:, 0] == 7).all()
        window = batch[:, 1:]
        assert 5 <= window.shape[1] <= 9
        # Contiguous slices of the text: each row counts up by one from where it starts.
        assert (window - window[:, :1] == torch.arange(window.shape[1])).all()
        assert window.min() >= 1000 and window.max() < 1300


def test_text_prompts_refuse_text_shorter_than_a_prompt():
    options = TrainOptions(min_prompt_tokens=8, max_prompt_tokens=8)
    with pytest.raises(ValueError, match="shorter than a 8-token prompt"):
        text_prompts(4, options, torch.arange(5), None, torch.Generator().manual_seed(0))


def test_distillation_data_from_text_continues_the_given_windows():
    base = ToyBigramLM(vocab_size=64, hidden_size=8)
    options = TrainOptions(samples=8, continuation_tokens=6, min_prompt_tokens=4,
                           max_prompt_tokens=4, generation_batch=8, heads=2, holdout=0.25)
    text = torch.arange(10, 60)
    train, held = generate_distillation_data(base, options, torch.arange(64), None,
                                             text_ids=text, **QUIET)
    assert len(train) > 0 and len(held) > 0


def test_base_dtype_must_be_a_float_type():
    with pytest.raises(ValueError, match="base_dtype='int8'"):
        TrainOptions(base_dtype="int8")


def test_served_walk_steps_past_accepted_drafts():
    """Acceptance as serving meets it: a step that accepts 3 drafts skips the rows of those
    tokens and of the target's own, so the long run is one step, not four rows' worth."""
    leading = torch.tensor([3, 0, 0, 0,
                            0, 1, 0, -1])  # -1: a row without every head's target
    assert served_walk(leading, 4) == pytest.approx(1 + (3 + 0 + 1) / 3)
    # The mean over rows would say 1 + 4 / 7: the walk is what vLLM's counters see.


def test_held_out_rows_are_evaluated_as_served():
    base = ToyBigramLM()
    options = TrainOptions(heads=3, samples=40, continuation_tokens=12, steps=50,
                           batch_size=64, min_prompt_tokens=2, max_prompt_tokens=6)
    train, held = generate_distillation_data(base, options, torch.arange(base.vocab_size), None,
                                             **QUIET)
    assert held.sequence_rows == options.continuation_tokens - 1
    assert len(held) == held.sequence_rows * len(held.prompts) == 4 * held.sequence_rows
    assert all(2 <= len(p) <= 6 for p in held.prompts)
    heads = train_heads(train, held, base.lm_head_weight(), options, **QUIET).heads
    walked = evaluate(heads, held).acceptance_length
    per_row = evaluate(heads, DistillationSet(held.features, held.targets)).acceptance_length
    assert walked > 1.5 and walked != per_row
