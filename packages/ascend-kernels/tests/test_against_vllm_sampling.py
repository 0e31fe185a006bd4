"""The sampling references against vLLM's own functions on random inputs.

Runs where vLLM is installed (the host session); the other kernel tests never import it.
vLLM's CPU top-k / top-p is ``apply_top_k_top_p_pytorch`` (its Triton version needs a
GPU). It sorts with torch's default, unstable, sort, so which of several tied tokens at
the top-p cut survive is unspecified there; with ties the test compares how many tokens of
each value survive, which both must agree on, and without ties the whole result.
"""

import pytest
import torch
import vllm  # noqa: E402,F401  (this file runs where vLLM is installed)
from vllm.model_executor.layers.utils import apply_penalties as vllm_apply_penalties  # noqa: E402
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch  # noqa: E402

from ascend_kernels.sampling import apply_penalties, apply_top_k_top_p  # noqa: E402


def _k_p(batch: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(1, vocab + 1, (batch,), generator=g)
    k[0] = vocab
    p = torch.rand(batch, generator=g).clamp(min=0.02)
    p[1] = 1.0
    return k, p


@pytest.mark.parametrize("which", ["k", "p", "both"])
@pytest.mark.parametrize("vocab", [50, 1000])
def test_top_k_top_p_agrees_with_vllm(which, vocab):
    torch.manual_seed(vocab)
    logits = torch.randn(24, vocab) * 3
    k, p = _k_p(24, vocab, vocab)
    k = k if which != "p" else None
    p = p if which != "k" else None
    ours = apply_top_k_top_p(logits, k, p)
    theirs = apply_top_k_top_p_pytorch(logits.clone(), k, p)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("which", ["k", "p", "both"])
def test_top_k_top_p_with_ties_keeps_as_many_as_vllm(which):
    torch.manual_seed(7)
    logits = torch.randint(-3, 4, (24, 300)).float()
    k, p = _k_p(24, 300, 7)
    k = k if which != "p" else None
    p = p if which != "k" else None
    ours = apply_top_k_top_p(logits, k, p)
    theirs = apply_top_k_top_p_pytorch(logits.clone(), k, p)
    assert torch.equal(ours.sort(dim=1).values, theirs.sort(dim=1).values)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_penalties_agree_with_vllm_bit_for_bit(seed):
    g = torch.Generator().manual_seed(seed)
    batch, vocab = 8, 700
    logits = torch.randn(batch, vocab, generator=g) * 4
    prompt = torch.randint(0, vocab + 1, (batch, 40), generator=g)  # vocab = padding
    output = torch.randint(0, vocab + 1, (batch, 25), generator=g)
    output[:, :10] = torch.randint(0, 30, (batch, 10), generator=g)  # repeated tokens
    presence = torch.rand(batch, generator=g) * 2 - 1
    frequency = torch.rand(batch, generator=g) * 2 - 1
    repetition = torch.rand(batch, generator=g) * 1.5 + 0.5
    ours = apply_penalties(logits, prompt, output, presence, frequency, repetition)
    theirs = vllm_apply_penalties(logits.clone(), prompt, output, presence, frequency,
                                  repetition)
    assert torch.equal(ours, theirs)
