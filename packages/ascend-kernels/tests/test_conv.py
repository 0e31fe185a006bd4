"""causal_conv1d / causal_conv1d_update: the reference against the convolution written out
tap by tap in float64, states carried across calls (a prompt split in chunks equals it
whole), the decode form equal to one-token sequences of the general one, bad input."""

import pytest
import torch

from ascend_kernels.conv import causal_conv1d, causal_conv1d_update, causal_conv1d_verify

from conftest import assert_close, needs_triton


def _inputs(tokens, dim=6, width=4, slots=5, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, dim, generator=generator).to(dtype)
    weight = torch.randn(dim, width, generator=generator).to(dtype)
    bias = torch.randn(dim, generator=generator).to(dtype)
    # vLLM's cache is [slots, W - 1, dim] viewed as [slots, dim, W - 1]: not contiguous.
    states = torch.randn(slots, width - 1, dim, generator=generator).to(dtype).transpose(1, 2)
    return x, weight, bias, states


def _by_hand(x, weight, bias, state, silu):
    """One sequence from ``state`` ([dim, W-1]): output rows and the final state."""
    inputs = torch.cat([state.double(), x.double().T], dim=1)
    width = weight.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for c in range(x.shape[1]):
            total = float(bias[c])
            for j in range(width):
                total += float(weight[c, j]) * float(inputs[c, t + j])
            out[t, c] = total
    if silu:
        out = torch.nn.functional.silu(out)
    return out, inputs[:, -(width - 1):]


@pytest.mark.parametrize("activation", ["silu", None])
def test_reference_is_the_convolution_written_out(activation):
    x, weight, bias, states = _inputs(8)
    cu = torch.tensor([0, 5, 5, 6, 8])
    slots = torch.tensor([3, 0, 1, 4])
    has_initial = torch.tensor([True, True, False, True])
    before = states.clone()
    out = causal_conv1d(x, weight, bias, states, cu, slots, has_initial, activation)
    for n, (start, end) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if start == end:
            continue
        initial = before[slots[n]] if has_initial[n] else torch.zeros_like(before[0])
        want, final = _by_hand(x[start:end], weight, bias, initial, activation == "silu")
        torch.testing.assert_close(out[start:end].double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[slots[n]].double(), final)
    # The empty sequence's slot (0) and the unnamed one (2) are left alone.
    assert torch.equal(states[[0, 2]], before[[0, 2]])


def test_a_short_sequence_keeps_part_of_its_old_state():
    # Two tokens with a kernel of 4: the new state is the old state's last input, then both.
    x, weight, bias, states = _inputs(2)
    old = states[1].clone()
    causal_conv1d(x, weight, bias, states, torch.tensor([0, 2]), torch.tensor([1]))
    torch.testing.assert_close(states[1], torch.cat([old[:, 2:], x.T], dim=1))


def test_chunks_of_a_prompt_equal_the_prompt_whole():
    x, weight, bias, states = _inputs(11, seed=1)
    whole_states, chunk_states = states.clone(), states.clone()
    slot, fresh = torch.tensor([2]), torch.tensor([False])
    whole = causal_conv1d(x, weight, bias, whole_states, torch.tensor([0, 11]), slot, fresh)
    first = causal_conv1d(x[:4], weight, bias, chunk_states, torch.tensor([0, 4]), slot, fresh)
    rest = causal_conv1d(x[4:10], weight, bias, chunk_states, torch.tensor([0, 6]), slot,
                         torch.tensor([True]))
    last = causal_conv1d_update(x[10:], weight, bias, chunk_states, slot)
    torch.testing.assert_close(torch.cat([first, rest, last]), whole)
    torch.testing.assert_close(chunk_states, whole_states)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_form_equals_one_token_sequences(dtype):
    x, weight, bias, states = _inputs(3, dtype=dtype, seed=2)
    slots = torch.tensor([4, 0, 2])
    general, decode = states.clone(), states.clone()
    want = causal_conv1d(x, weight, bias, general, torch.arange(4), slots)
    got = causal_conv1d_update(x, weight, bias, decode, slots)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(decode, general)


@pytest.mark.parametrize(("change", "match"), [
    ({"x": torch.zeros(3, 6, 1)}, r"x must be \[tokens, dim\]"),
    ({"weight": torch.zeros(5, 4)}, r"weight must be \[dim=6, width >= 2\]"),
    ({"bias": torch.zeros(4)}, r"bias must be \[dim=6\]"),
    ({"conv_states": torch.zeros(5, 6, 4)}, r"conv_states must be \[slots, dim=6, width - 1=3\]"),
    ({"activation": "gelu"}, "activation must be one of"),
])
def test_bad_inputs_are_named(change, match):
    x, weight, bias, states = _inputs(3)
    args = {"x": x, "weight": weight, "bias": bias, "conv_states": states,
            "cu_seqlens": torch.tensor([0, 3]), **change}
    with pytest.raises(ValueError, match=match):
        causal_conv1d(**args)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("dim", "width"), [(6, 4), (300, 3)])
def test_triton_matches_reference(dtype, dim, width):
    x, weight, bias, states = _inputs(12, dim=dim, width=width, slots=6, dtype=dtype, seed=4)
    cu = torch.tensor([0, 1, 6, 6, 8, 12])  # a one-token sequence, an empty one, short ones
    slots = torch.tensor([5, 0, 3, 1, 2])
    has_initial = torch.tensor([True, False, True, True, False])
    ref_states, tri_states = states.clone(), states.clone()
    ref = causal_conv1d(x, weight, bias, ref_states, cu, slots, has_initial,
                        backend="reference")
    out = causal_conv1d(x, weight, bias, tri_states, cu, slots, has_initial, backend="triton")
    assert out.dtype == dtype
    assert_close(out, ref, dtype)
    torch.testing.assert_close(tri_states, ref_states)
    ref = causal_conv1d_update(x[:3], weight, None, ref_states, slots[:3], None,
                               backend="reference")
    out = causal_conv1d_update(x[:3], weight, None, tri_states, slots[:3], None,
                               backend="triton")
    assert_close(out, ref, dtype)
    torch.testing.assert_close(tri_states, ref_states)


def _verify_by_hand(x, weight, bias, buffer, accepted):
    """One sequence's verification step over its rolling buffer ([dim, state_len]): the
    window starts at column ``accepted - 1``; returns the outputs and the new buffer."""
    width = weight.shape[1]
    history = buffer[:, accepted - 1:accepted - 1 + width - 1]
    out, _ = _by_hand(x, weight, bias, history, silu=True)
    rolled = buffer.clone()
    rolled[:, :width - 2 + x.shape[0]] = torch.cat([history[:, 1:], x.T], dim=1)
    return out, rolled


def test_verify_form_is_the_rolling_buffer_written_out():
    width, drafts = 4, 3
    x, weight, bias, _ = _inputs(4 + 2 + 1, width=width)
    generator = torch.Generator().manual_seed(3)
    states = torch.randn(5, width - 1 + drafts, 6, generator=generator).transpose(1, 2)
    cu = torch.tensor([0, 4, 6, 6, 7])  # a sequence of 4 tokens, of 2, none, of 1
    slots = torch.tensor([3, 0, 1, 4])
    accepted = torch.tensor([2, 4, 1, 1])
    got_states = states.clone()
    got = causal_conv1d_verify(x, weight, bias, got_states, cu, slots, accepted)
    want_states = states.clone()
    for n in (0, 1, 3):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        out, want_states[slots[n]] = _verify_by_hand(x[rows], weight, bias,
                                                     states[slots[n]], int(accepted[n]))
        torch.testing.assert_close(got[rows].double(), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_states, want_states)  # slot 1 (no tokens) untouched


def test_verify_steps_equal_decoding_the_accepted_tokens():
    # Step 1 verifies 4 tokens from a prefill's state; 2 are accepted. Step 2's first token
    # must see the same window as decoding those 2 tokens and then it, one at a time.
    width, drafts = 4, 3
    x, weight, bias, states = _inputs(8, width=width)
    buffer = torch.zeros(1, 6, width - 1 + drafts)
    buffer[0, :, :width - 1] = states[0]
    slot, cu = torch.tensor([0]), torch.tensor([0, 4])
    causal_conv1d_verify(x[:4], weight, bias, buffer, cu, slot, torch.tensor([1]))
    second = causal_conv1d_verify(x[4:], weight, bias, buffer, cu, slot, torch.tensor([2]))
    decode_state = states[:1].clone()
    for t in (0, 1, 4):
        last = causal_conv1d_update(x[t:t + 1], weight, bias, decode_state, slot)
    torch.testing.assert_close(second[:1], last)


def test_verify_rows_past_the_sequences_go_to_the_zero_length_padding_sequence():
    # A captured graph's batch: one real sequence of 3 tokens, a padding sequence (no
    # tokens, vLLM's null slot 0) and 3 padding rows.
    width, drafts = 4, 2
    x, weight, bias, _ = _inputs(6, width=width)
    states = torch.randn(3, 6, width - 1 + drafts, generator=torch.Generator().manual_seed(5))
    cu, slots, accepted = torch.tensor([0, 3, 3]), torch.tensor([2, 0]), torch.tensor([2, 1])
    padded = states.clone()
    got = causal_conv1d_verify(x, weight, bias, padded, cu, slots, accepted)
    exact = states.clone()
    want = causal_conv1d_verify(x[:3], weight, bias, exact, cu[:2], slots[:1], accepted[:1])
    torch.testing.assert_close(got[:3], want)
    torch.testing.assert_close(padded[1:], exact[1:])  # only the null slot took the padding


def test_verify_refuses_a_buffer_shorter_than_the_window():
    x, weight, bias, states = _inputs(2)  # states [5, 6, 3]: W - 1 = 3 columns is the least
    with pytest.raises(ValueError, match=r"conv_states must be \[slots, dim=6, state_len >= 3\]"):
        causal_conv1d_verify(x, weight, bias, states[..., :2], torch.tensor([0, 2]),
                             torch.tensor([0]), torch.tensor([1]))
