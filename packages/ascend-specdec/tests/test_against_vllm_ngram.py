"""Against vLLM (imports it): our n-gram proposer drafts what vLLM's NgramProposer drafts."""

from types import SimpleNamespace

import numpy as np
import pytest
from vllm.v1.spec_decode.ngram_proposer import NgramProposer

from ascend_core.registry import SPECULATIVE_PROPOSERS
from ascend_core.worker.speculative import install_registered_proposer
from ascend_specdec import register
from ascend_specdec.vllm.ngram_proposer import AscendNgramProposer


def vllm_config(min_n, max_n, k, max_model_len, max_num_seqs=64):
    # What both proposers read of vLLM's config.
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="ngram", prompt_lookup_min=min_n,
                                           prompt_lookup_max=max_n, num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
    )


def random_batch(rng, batch, max_model_len, vocab):
    token_ids = rng.integers(0, vocab, size=(batch, max_model_len)).astype(np.int32)
    num_tokens = rng.integers(0, max_model_len + 1, size=batch).astype(np.int32)
    # Requests without sampled tokens (partial prefills) draft nothing in both.
    sampled = [[int(t)] if rng.random() < 0.9 else [] for t in token_ids[:, 0]]
    return sampled, num_tokens, token_ids


@pytest.mark.parametrize("vocab", [2, 4, 20])
def test_drafts_equal_vllms_on_random_histories(vocab):
    rng = np.random.default_rng(vocab)
    for _ in range(12):
        min_n = int(rng.integers(1, 5))
        max_n = int(rng.integers(min_n, 12))
        k = int(rng.integers(1, 6))
        max_model_len = int(rng.integers(16, 160))
        config = vllm_config(min_n, max_n, k, max_model_len)
        theirs, ours = NgramProposer(config), AscendNgramProposer(config)
        for _ in range(4):
            batch = random_batch(rng, 48, max_model_len, vocab)
            for num_spec in sorted({1, k}):
                assert ours.propose(num_spec, *batch) == theirs.propose(num_spec, *batch), (
                    min_n, max_n, k, max_model_len, num_spec)


def test_drafts_equal_vllms_on_its_benchmark_setting():
    # vLLM's benchmark: 128 requests x 1500 tokens, vocabulary 20, min_n 3, k 3.
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 20, size=(128, 1503)).astype(np.int32)
    num_tokens = np.full(128, 1500, dtype=np.int32)
    sampled = [[1]] * 128
    for max_n in (5, 10, 20):
        config = vllm_config(3, max_n, 3, 1503, max_num_seqs=128)
        theirs = NgramProposer(config).propose(3, sampled, num_tokens, token_ids)
        ours = AscendNgramProposer(config).propose(3, sampled, num_tokens, token_ids)
        assert ours == theirs
        assert sum(map(len, ours)) > 0


def test_repetitive_histories_equal_vllms():
    rng = np.random.default_rng(5)
    config = vllm_config(2, 8, 4, 400)
    period = rng.integers(1, 7, size=16)
    token_ids = np.stack([np.resize(rng.integers(0, 9, size=p), 400) for p in period])
    token_ids = token_ids.astype(np.int32)
    token_ids[::3, ::17] = 99  # some noise
    num_tokens = rng.integers(50, 400, size=16).astype(np.int32)
    args = ([[1]] * 16, num_tokens, token_ids)
    assert AscendNgramProposer(config).propose(4, *args) == NgramProposer(config).propose(4, *args)


def test_the_runner_installs_ours_as_an_ngram_proposer():
    register()
    runner = SimpleNamespace(vllm_config=vllm_config(3, 5, 3, 64), device="cpu",
                             drafter=object())
    assert install_registered_proposer(runner) == "ascend"
    # vLLM's runner asserts isinstance(drafter, NgramProposer) before proposing.
    assert isinstance(runner.drafter, AscendNgramProposer)
    assert isinstance(runner.drafter, NgramProposer)
    assert SPECULATIVE_PROPOSERS.get("ngram").__module__ == "ascend_specdec.ngram"
