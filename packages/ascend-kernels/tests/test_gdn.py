"""gated_delta_rule: the reference against the rule written out per head, the Triton backend
(in Triton's interpreter) against the reference; variable-length sequences, grouped value
heads, state slots read and written in place."""

import pytest
import torch

from ascend_kernels import gated_delta_rule
from ascend_kernels.gdn import gated_delta_rule_reference

from conftest import DTYPES, assert_close, needs_triton


def _inputs(lengths, heads=2, value_heads=4, key_dim=8, value_dim=6, slots=5,
            dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=generator)

    q = randn(tokens, heads, key_dim).to(dtype)
    k = randn(tokens, heads, key_dim).to(dtype)
    v = randn(tokens, value_heads, value_dim).to(dtype)
    g = torch.nn.functional.logsigmoid(randn(tokens, value_heads)).to(dtype)
    beta = torch.sigmoid(randn(tokens, value_heads)).to(dtype)
    state = randn(slots, value_heads, value_dim, key_dim) * 0.1
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, state, cu


def _by_hand(q, k, v, g, beta, state, cu, slots, scale, l2norm, eps=1e-6):
    """One sequence, one value head, one token at a time, in float64."""
    state = state.double().clone()
    out = torch.zeros(v.shape, dtype=torch.float64)
    group = v.shape[1] // q.shape[1]
    for n in range(cu.numel() - 1):
        for hv in range(v.shape[1]):
            s = state[slots[n], hv]
            for t in range(int(cu[n]), int(cu[n + 1])):
                qt, kt = q[t, hv // group].double(), k[t, hv // group].double()
                if l2norm:
                    qt, kt = qt / (qt @ qt + eps).sqrt(), kt / (kt @ kt + eps).sqrt()
                s = s * float(g[t, hv].double().exp())
                u = (v[t, hv].double() - s @ kt) * float(beta[t, hv])
                s = s + torch.outer(u, kt)
                out[t, hv] = s @ (qt * scale)
            state[slots[n], hv] = s
    return out, state


@pytest.mark.parametrize("l2norm", [False, True])
def test_reference_is_the_rule_written_out(l2norm):
    q, k, v, g, beta, state, cu = _inputs([3, 1, 4])
    slots = torch.tensor([4, 0, 2])
    want_out, want_state = _by_hand(q, k, v, g, beta, state, cu, slots.tolist(), 0.5, l2norm)
    got_state = state.clone()
    out = gated_delta_rule_reference(q, k, v, g, beta, got_state, cu, slots, 0.5, l2norm)
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_state.double(), want_state, atol=1e-5, rtol=1e-5)
    # Slots no sequence names are left alone.
    assert torch.equal(got_state[[1, 3]], state[[1, 3]])


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize(("lengths", "value_dim"), [([1, 1, 1], 6), ([5, 0, 2], 6),
                                                     ([3], 300)])
def test_triton_matches_reference(dtype, l2norm, lengths, value_dim):
    q, k, v, g, beta, state, cu = _inputs(lengths, value_dim=value_dim, dtype=dtype,
                                          seed=len(lengths))
    slots = torch.arange(len(lengths)).flip(0)
    ref_state, tri_state = state.clone(), state.clone()
    ref = gated_delta_rule(q, k, v, g, beta, ref_state, cu, slots, use_qk_l2norm=l2norm,
                           backend="reference")
    out = gated_delta_rule(q, k, v, g, beta, tri_state, cu, slots, use_qk_l2norm=l2norm,
                           backend="triton")
    assert out.dtype == dtype
    assert_close(out, ref, dtype, scale=2)
    torch.testing.assert_close(tri_state, ref_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("change", "match"), [
    ({"v": torch.zeros(4, 3, 6)}, "multiple of q's 2"),
    ({"g": torch.zeros(4, 2)}, r"g must be \[tokens=4, value heads=4\]"),
    ({"state": torch.zeros(5, 4, 6, 8, dtype=torch.int32)}, "state must be a float"),
    ({"state_indices": torch.tensor([0, 1])}, r"state_indices must be \[1\]"),
])
def test_bad_inputs_are_named(change, match):
    q, k, v, g, beta, state, cu = _inputs([4])
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state, "cu_seqlens": cu,
            **change}
    with pytest.raises(ValueError, match=match):
        gated_delta_rule(**args)


def test_decode_reference_equals_the_general_one():
    from ascend_kernels.gdn import gated_delta_rule_decode_reference

    q, k, v, g, beta, state, cu = _inputs([1, 1, 1, 1])
    slots = torch.tensor([3, 1, 4, 0])
    general, decode = state.clone(), state.clone()
    want = gated_delta_rule_reference(q, k, v, g, beta, general, cu, slots, None, True)
    got = gated_delta_rule_decode_reference(q, k, v, g, beta, decode, cu, slots, None, True)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(decode, general)


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_state_cache_is_read_and_written_in_its_dtype(state_dtype):
    # vLLM's default state cache holds the model's dtype: each sequence computes in float32
    # from the rounded state and rounds its final state once.
    q, k, v, g, beta, state, cu = _inputs([3, 1])
    low = state.to(state_dtype)
    wide = low.float()
    slots = torch.tensor([2, 0])
    want = gated_delta_rule_reference(q, k, v, g, beta, wide, cu, slots)
    got = gated_delta_rule_reference(q, k, v, g, beta, low, cu, slots)
    torch.testing.assert_close(got, want)
    assert low.dtype == state_dtype
    torch.testing.assert_close(low, wide.to(state_dtype))


@needs_triton
def test_triton_reads_padded_low_precision_slots():
    # vLLM's hybrid cache pads each slot to the attention page: slots are not adjacent.
    from ascend_kernels.gdn import gated_delta_rule_decode

    q, k, v, g, beta, state, cu = _inputs([1, 1, 1], dtype=torch.bfloat16)
    padded = torch.zeros(state.shape[0], state[0].numel() + 40, dtype=torch.bfloat16)
    view = padded[:, :state[0].numel()].view(state.shape)
    view.copy_(state)
    ref_state = view.clone()
    slots = torch.tensor([4, 1, 3])
    ref = gated_delta_rule_decode(q, k, v, g, beta, ref_state, slots, use_qk_l2norm=True,
                                  backend="reference")
    out = gated_delta_rule_decode(q, k, v, g, beta, view, slots, use_qk_l2norm=True,
                                  backend="triton")
    assert_close(out, ref, torch.bfloat16, scale=2)
    torch.testing.assert_close(view.float(), ref_state.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(padded[:, state[0].numel():], torch.zeros(5, 40, dtype=torch.bfloat16))


def test_verify_writes_each_tokens_state_and_resumes_after_the_accepted_ones():
    from ascend_kernels.gdn import gated_delta_rule_verify

    # Two sequences of 3 and 2 tokens, state rows of 3 slots each; the first resumes from
    # its second slot (2 accepted last step), the second from its first.
    q, k, v, g, beta, state, cu = _inputs([3, 2], slots=8)
    rows = torch.tensor([[5, 1, 6], [2, 7, 0]])
    accepted = torch.tensor([2, 1])
    got_state = state.clone()
    got = gated_delta_rule_verify(q, k, v, g, beta, got_state, cu, rows, accepted,
                                  use_qk_l2norm=True)
    for n, start in ((0, int(rows[0, 1])), (1, int(rows[1, 0]))):
        lo, hi = int(cu[n]), int(cu[n + 1])
        for t in range(lo, hi):  # the state after each token sits in its own slot
            scratch = state[[start]].clone()
            out = gated_delta_rule_reference(q[lo:t + 1], k[lo:t + 1], v[lo:t + 1],
                                             g[lo:t + 1], beta[lo:t + 1], scratch,
                                             torch.tensor([0, t + 1 - lo]), None, None, True)
            torch.testing.assert_close(got[t], out[-1])
            torch.testing.assert_close(got_state[rows[n, t - lo]], scratch[0])
    torch.testing.assert_close(got_state[[3, 4]], state[[3, 4]])  # slots no row names


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_triton_matches_reference(dtype):
    from ascend_kernels.gdn import gated_delta_rule_verify

    # Sequences of 3, 1, 2 tokens and a padding one (no tokens, slot 0), rows of 3 slots.
    q, k, v, g, beta, state, cu = _inputs([3, 1, 2, 0], slots=11, dtype=dtype)
    rows = torch.tensor([[5, 1, 6], [2, 7, 8], [9, 3, 10], [0, 0, 0]])
    accepted = torch.tensor([2, 3, 1, 1])
    low = state.to(dtype)
    ref_state, tri_state = low.clone(), low.clone()
    ref = gated_delta_rule_verify(q, k, v, g, beta, ref_state, cu, rows, accepted,
                                  use_qk_l2norm=True, backend="reference")
    out = gated_delta_rule_verify(q, k, v, g, beta, tri_state, cu, rows, accepted,
                                  use_qk_l2norm=True, backend="triton")
    assert_close(out, ref, dtype, scale=2)
    assert_close(tri_state, ref_state, dtype, scale=2)
