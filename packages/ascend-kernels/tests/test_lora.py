"""lora_shrink / lora_expand: the reference against a per-token loop written from the
definition, the Triton backend (Triton's interpreter) against the reference, and the input
checks."""

import pytest
import torch

from ascend_kernels import lora_expand, lora_shrink

from conftest import DTYPES, assert_close, needs_triton

SLOTS, RANK, HIDDEN, WIDTH = 3, 8, 48, 40


def adapters(dtype, rows, cols, unit_dim=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(SLOTS, rows, cols, generator=gen).to(dtype)
    return weights.unsqueeze(1) if unit_dim else weights


def looped_shrink(x, lora_a, token_lora, scale):
    """The definition, one token at a time."""
    weights = lora_a.reshape(SLOTS, RANK, -1).float()
    rows = [scale * (weights[s] @ x[t].float()) if s >= 0 else torch.zeros(RANK)
            for t, s in enumerate(token_lora.tolist())]
    return torch.stack(rows)


def looped_expand(x, lora_b, out, token_lora, offset, add_inputs):
    weights = lora_b.reshape(SLOTS, -1, RANK).float()
    n = weights.shape[1]
    expected = out.clone()
    for t, s in enumerate(token_lora.tolist()):
        if s < 0:
            continue
        value = weights[s] @ x[t].float()
        if add_inputs:
            value = value + out[t, offset:offset + n].float()
        expected[t, offset:offset + n] = value.to(out.dtype)
    return expected


# Tokens of every slot and of none, in no order (as a batch of several requests holds them).
TOKEN_LORA = torch.tensor([2, -1, 0, 0, 1, -1, 2, 1, 1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_dim", [True, False])
def test_shrink_reference_is_the_per_token_definition(dtype, unit_dim):
    x = torch.randn(len(TOKEN_LORA), HIDDEN).to(dtype)
    lora_a = adapters(dtype, RANK, HIDDEN, unit_dim)
    out = torch.full((len(TOKEN_LORA), RANK), 7.0)  # stale values must not survive
    lora_shrink(x, lora_a, out, TOKEN_LORA, 0.5, backend="reference")
    torch.testing.assert_close(out, looped_shrink(x, lora_a, TOKEN_LORA, 0.5),
                               atol=1e-4, rtol=1e-4)
    assert (out[TOKEN_LORA < 0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add_inputs", [True, False])
def test_expand_reference_is_the_per_token_definition(dtype, add_inputs):
    x = torch.randn(len(TOKEN_LORA), RANK)
    n, offset = 24, 10
    lora_b = adapters(dtype, n, RANK)
    out = torch.randn(len(TOKEN_LORA), WIDTH).to(dtype)
    expected = looped_expand(x, lora_b, out, TOKEN_LORA, offset, add_inputs)
    before = out.clone()
    lora_expand(x, lora_b, out, TOKEN_LORA, offset, add_inputs, backend="reference")
    assert_close(out, expected, dtype, scale=4)
    # Tokens without an adapter and columns outside the slice are untouched, bit for bit.
    assert torch.equal(out[TOKEN_LORA < 0], before[TOKEN_LORA < 0])
    assert torch.equal(out[:, :offset], before[:, :offset])
    assert torch.equal(out[:, offset + n:], before[:, offset + n:])


def test_expand_changes_only_the_tokens_of_an_adapter():
    """One adapter's non-zero weights reach its own tokens only."""
    lora_b = torch.zeros(SLOTS, 1, WIDTH, RANK)
    lora_b[1] = 1.0
    x = torch.ones(len(TOKEN_LORA), RANK)
    out = torch.zeros(len(TOKEN_LORA), WIDTH)
    lora_expand(x, lora_b, out, TOKEN_LORA, backend="reference")
    assert torch.equal(out[TOKEN_LORA == 1], torch.full(((TOKEN_LORA == 1).sum(), WIDTH), 8.0))
    assert (out[TOKEN_LORA != 1] == 0).all()


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [HIDDEN, 600])  # 600: several reduction blocks
def test_shrink_triton_matches_reference(dtype, hidden):
    x = torch.randn(len(TOKEN_LORA), hidden).to(dtype)
    lora_a = adapters(dtype, RANK, hidden)
    ours = lora_shrink(x, lora_a, torch.full((len(TOKEN_LORA), RANK), 7.0), TOKEN_LORA, 0.25,
                       backend="triton")
    reference = lora_shrink(x, lora_a, torch.empty(len(TOKEN_LORA), RANK), TOKEN_LORA, 0.25,
                            backend="reference")
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("add_inputs", [True, False])
@pytest.mark.parametrize("n", [24, 300])  # 300: several column blocks
def test_expand_triton_matches_reference(dtype, add_inputs, n):
    x = torch.randn(len(TOKEN_LORA), RANK)
    lora_b = adapters(dtype, n, RANK)
    out = torch.randn(len(TOKEN_LORA), n + 16).to(dtype)
    ours = lora_expand(x, lora_b, out.clone(), TOKEN_LORA, 8, add_inputs, backend="triton")
    reference = lora_expand(x, lora_b, out.clone(), TOKEN_LORA, 8, add_inputs,
                            backend="reference")
    assert_close(ours, reference, dtype, scale=4)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_batches_take_the_tiled_kernel_and_match_reference(dtype):
    """Prefill-sized batches (>= TILED_MIN_TOKENS) run a tile of tokens per program."""
    from ascend_kernels.triton_kernels.lora import TILED_MIN_TOKENS

    tokens = TILED_MIN_TOKENS + 37  # a partial last tile
    token_lora = torch.randint(-1, SLOTS - 1, (tokens,),
                               generator=torch.Generator().manual_seed(0))  # last slot unused
    x = torch.randn(tokens, 100).to(dtype)  # 100: partial reduction blocks
    lora_a = adapters(dtype, RANK, 100)
    ours = lora_shrink(x, lora_a, torch.full((tokens, RANK), 7.0), token_lora, 0.5,
                       backend="triton")
    reference = lora_shrink(x, lora_a, torch.empty(tokens, RANK), token_lora, 0.5,
                            backend="reference")
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
    lora_b = adapters(dtype, 150, RANK)
    out = torch.randn(tokens, 170).to(dtype)
    ours = lora_expand(reference, lora_b, out.clone(), token_lora, 20, backend="triton")
    expected = lora_expand(reference, lora_b, out.clone(), token_lora, 20,
                           backend="reference")
    assert_close(ours, expected, dtype, scale=8)
    assert torch.equal(ours[token_lora < 0], out[token_lora < 0])


def test_empty_batch_is_a_no_op():
    out = torch.empty(0, RANK)
    lora_shrink(torch.empty(0, HIDDEN), adapters(torch.float32, RANK, HIDDEN), out,
                torch.empty(0, dtype=torch.long))
    assert out.shape == (0, RANK)


def test_bad_inputs_are_refused_with_the_values():
    x = torch.randn(4, HIDDEN)
    lora_a = adapters(torch.float32, RANK, HIDDEN)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 48\].*got shape \(4, 47\)"):
        lora_shrink(x[:, :47], lora_a, torch.empty(4, RANK), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token_lora must be \[4\].*got shape \(3,\)"):
        lora_shrink(x, lora_a, torch.empty(4, RANK), torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="token_lora has dtype torch.float32"):
        lora_shrink(x, lora_a, torch.empty(4, RANK), torch.zeros(4))
    with pytest.raises(ValueError, match=r"out must be \[4, 8\]"):
        lora_shrink(x, lora_a, torch.empty(4, RANK + 1), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"offset \+ 24.*offset 20"):
        lora_expand(torch.randn(4, RANK), adapters(torch.float32, 24, RANK),
                    torch.empty(4, WIDTH), torch.zeros(4, dtype=torch.long), offset=20)
    with pytest.raises(ValueError, match=r"lora_b must be \[slots, rows, cols\]"):
        lora_expand(torch.randn(4, RANK), torch.randn(24, RANK), torch.empty(4, WIDTH),
                    torch.zeros(4, dtype=torch.long))
