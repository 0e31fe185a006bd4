"""npu_recurrent_gated_delta_rule against its page's formula written out per token and head
in float64: batches of 1 to 8 tokens, grouped value heads, each token's state written to its
own index, the initial state taken at num_accepted_tokens, and what the page rules out."""

import pytest
import torch

NK, NV, DK, DV = 2, 4, 16, 8


def _inputs(lengths, blocks=12, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    query = torch.nn.functional.normalize(randn(tokens, NK, DK), dim=-1).bfloat16()
    key = torch.nn.functional.normalize(randn(tokens, NK, DK), dim=-1).bfloat16()
    value = randn(tokens, NV, DV).bfloat16()
    beta = torch.sigmoid(randn(tokens, NV)).bfloat16()
    g = torch.nn.functional.logsigmoid(randn(tokens, NV))
    state = (randn(blocks, NV, DV, DK) * 0.2).bfloat16()
    return dict(query=query, key=key, value=value, state=state, beta=beta, g=g,
                actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32))


def _by_hand(args, indices, accepted, scale):
    state = args["state"].double().clone()
    out = torch.zeros(args["value"].shape, dtype=torch.float64)
    first = 0
    for length, taken in zip(args["actual_seq_lengths"].tolist(), accepted, strict=True):
        for h in range(NV):
            s = state[indices[first + taken - 1], h].clone()
            for t in range(first, first + length):
                q, k = args["query"][t, h // 2].double(), args["key"][t, h // 2].double()
                s = s * float(args["g"][t, h].double().exp())
                s = s + torch.outer(args["beta"][t, h].double()
                                    * (args["value"][t, h].double() - s @ k), k)
                out[t, h] = scale * (s @ q)
                state[indices[t], h] = s
        first += length
    return out, state


@pytest.mark.parametrize("speculative", [False, True])
def test_the_op_is_its_formula(torch_npu, speculative):
    lengths = [3, 1, 4] if speculative else [1, 1, 1]
    args = _inputs(lengths)
    indices = [5, 6, 7, 2, 8, 9, 10, 11] if speculative else [4, 0, 9]
    accepted = [2, 1, 3] if speculative else [1, 1, 1]
    extra = {"num_accepted_tokens": torch.tensor(accepted, dtype=torch.int32)} \
        if speculative else {}
    want_out, want_state = _by_hand(args, indices, accepted, 0.25)
    out = torch_npu.npu_recurrent_gated_delta_rule(
        **args, scale=0.25, ssm_state_indices=torch.tensor(indices, dtype=torch.int32),
        **extra)
    assert out.dtype == torch.bfloat16 and out.shape == (sum(lengths), NV, DV)
    torch.testing.assert_close(out.double(), want_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(args["state"].double(), want_state, atol=2e-2, rtol=2e-2)
    untouched = [i for i in range(12) if i not in indices]
    assert torch.equal(args["state"][untouched], _inputs(lengths)["state"][untouched])


@pytest.mark.parametrize(("change", "match"), [
    ({"query": torch.zeros(3, NK, DK)}, "query has dtype torch.float32"),
    ({"g": torch.zeros(3, NV, dtype=torch.bfloat16)}, "g has dtype torch.bfloat16"),
    ({"actual_seq_lengths": torch.tensor([9], dtype=torch.int32)}, "each 1 to 8"),
    ({"scale": None}, "scale is required"),
    ({"state": torch.zeros(2, NV, DV, DK, dtype=torch.bfloat16)}, "BlockNum=2 must be at least"),
    ({"value": torch.zeros(3, 3, DV, dtype=torch.bfloat16)}, "N_v a multiple of N_k"),
])
def test_what_the_page_rules_out_is_refused(torch_npu, change, match):
    args = {**_inputs([1, 1, 1]), "scale": 0.5,
            "ssm_state_indices": torch.tensor([0, 1, 2], dtype=torch.int32), **change}
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_recurrent_gated_delta_rule(**args)


def test_gk_is_not_modelled(torch_npu):
    args = {**_inputs([1]), "scale": 0.5, "ssm_state_indices": torch.tensor([0], dtype=torch.int32)}
    with pytest.raises(NotImplementedError, match="gk"):
        torch_npu.npu_recurrent_gated_delta_rule(**args, gk=torch.zeros(1, NV))


def _chunk_inputs(lengths, seed=1):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(
        query=torch.nn.functional.normalize(randn(tokens, 2, 128), dim=-1).bfloat16(),
        key=torch.nn.functional.normalize(randn(tokens, 2, 128), dim=-1).bfloat16(),
        value=randn(tokens, 4, 128).bfloat16(),
        beta=torch.sigmoid(randn(tokens, 4)).bfloat16(),
        g=torch.nn.functional.logsigmoid(randn(tokens, 4)),
        initial_state=(randn(len(lengths), 4, 128, 128) * 0.1).bfloat16(),
        actual_seq_lengths=torch.tensor(lengths, dtype=torch.int32))


def test_the_chunk_op_is_the_recurrence_from_each_batchs_initial_state(torch_npu):
    # Against the recurrent op over the same batches: batch b's first token reads and writes
    # slot b (its initial state), later tokens write their own slots.
    args = _chunk_inputs([5, 2])
    out, final = torch_npu.npu_chunk_gated_delta_rule(**args, scale=0.125)
    assert out.shape == (7, 4, 128) and final.shape == (2, 4, 128, 128)
    state = torch.cat([args["initial_state"],
                       torch.zeros(5, 4, 128, 128, dtype=torch.bfloat16)])
    recurrent = torch_npu.npu_recurrent_gated_delta_rule(
        args["query"], args["key"], args["value"], state, beta=args["beta"], g=args["g"],
        scale=0.125, actual_seq_lengths=args["actual_seq_lengths"],
        ssm_state_indices=torch.tensor([0, 2, 3, 4, 5, 1, 6], dtype=torch.int32))
    assert torch.equal(out, recurrent)
    assert torch.equal(final, state[[5, 6]])


def test_the_chunk_op_starts_from_zeros_and_scale_one_by_default(torch_npu):
    args = _chunk_inputs([3])
    given = {**args, "initial_state": torch.zeros(1, 4, 128, 128, dtype=torch.bfloat16)}
    out, final = torch_npu.npu_chunk_gated_delta_rule(**given, scale=1.0)
    without = {k: v for k, v in args.items() if k != "initial_state"}
    out_default, final_default = torch_npu.npu_chunk_gated_delta_rule(**without)
    assert torch.equal(out, out_default) and torch.equal(final, final_default)


@pytest.mark.parametrize(("change", "match"), [
    ({"value": torch.zeros(3, 4, 64, dtype=torch.bfloat16)}, "both must be 128"),
    ({"actual_seq_lengths": torch.tensor([2, 0, 1], dtype=torch.int32)}, "each at least 1"),
    ({"initial_state": torch.zeros(2, 4, 128, 128, dtype=torch.bfloat16)}, "must be"),
    ({"beta": torch.zeros(3, 4)}, "beta has dtype torch.float32"),
])
def test_what_the_chunk_page_rules_out_is_refused(torch_npu, change, match):
    args = {**_chunk_inputs([3]), **change}
    with pytest.raises(RuntimeError, match=match):
        torch_npu.npu_chunk_gated_delta_rule(**args)
