"""Against vLLM (imports it): vLLM's suffix proposer loop on our cache, and the config."""

import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

from ascend_core.worker.speculative import install_registered_proposer
from ascend_specdec import register
from ascend_specdec.vllm.suffix_proposer import AscendSuffixProposer


def vllm_config(k=4, depth=24, cached=10000, factor=1.0, min_prob=0.1, max_model_len=128):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            method="suffix", num_speculative_tokens=k, suffix_decoding_max_tree_depth=depth,
            suffix_decoding_max_cached_requests=cached, suffix_decoding_max_spec_factor=factor,
            suffix_decoding_min_token_prob=min_prob),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )


class Batch:
    """The parts of vLLM's InputBatch the suffix proposer reads."""

    def __init__(self, prompts, width=128):
        self.req_ids = list(prompts)
        self.req_id_to_index = {r: i for i, r in enumerate(self.req_ids)}
        self.token_ids_cpu = np.zeros((len(prompts), width), dtype=np.int32)
        self.num_prompt_tokens = np.array([len(p) for p in prompts.values()])
        self.num_tokens_no_spec = self.num_prompt_tokens.copy()
        for i, prompt in enumerate(prompts.values()):
            self.token_ids_cpu[i, :len(prompt)] = prompt

    def append(self, i, tokens):
        n = self.num_tokens_no_spec[i]
        self.token_ids_cpu[i, n:n + len(tokens)] = tokens
        self.num_tokens_no_spec[i] += len(tokens)


def test_vllms_propose_loop_drives_our_cache():
    register()
    runner = SimpleNamespace(vllm_config=vllm_config(), device="cpu", drafter=object())
    assert install_registered_proposer(runner) == "ascend"
    proposer = runner.drafter
    assert isinstance(proposer, AscendSuffixProposer)
    assert isinstance(proposer, SuffixDecodingProposer)  # vLLM's runner asserts it

    period = [11, 12, 13, 14, 15]
    batch = Batch({"r0": period * 3, "r1": [1, 2, 3]})
    # First step after prefill: each request sampled one token.
    batch.append(0, [11])
    batch.append(1, [4])
    drafts = proposer.propose(4, batch, [[11], [4]])
    assert proposer.suffix_cache.active_requests == {"r0", "r1"}
    assert drafts[0] == [12, 13, 14, 15]  # the prompt's period continues
    assert drafts[1] == []  # nothing repeats in r1 yet
    # r1 samples [5, 6] next, then leaves the batch: vLLM's loop stops it; its response
    # [4, 5, 6] stays in the global tree.
    batch.append(0, [12])
    batch.append(1, [5, 6])
    proposer.propose(4, batch, [[12], [5, 6]])
    batch = Batch({"r0": period * 3 + [11, 12]})
    batch.append(0, [13])
    proposer.propose(4, batch, [[13]])
    assert proposer.suffix_cache.active_requests == {"r0"}
    assert proposer.suffix_cache.cached_requests == {"r0", "r1"}
    # A new request sampling 4, 5 drafts r1's continuation from the global tree.
    batch = Batch({"r2": [8, 4]})
    batch.append(0, [5])
    assert proposer.propose(4, batch, [[5]]) == [[6]]
    assert proposer.suffix_cache.active_requests == {"r2"}


def test_draft_lengths_vary_and_respect_max_model_len():
    proposer = AscendSuffixProposer(vllm_config(k=6, max_model_len=40))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    batch = Batch({"a": prompt, "b": [1, 2, 1, 3]})
    batch.append(0, [5, 6])
    batch.append(1, [1])
    drafts = proposer.propose(6, batch, [[5, 6], [1]])
    # "a": room for 40 - 34 - 1 = 5 tokens; "b": [1] was followed by 2 and 3, p = 1/2 each.
    assert drafts[0] == [7, 8, 9, 10, 11]
    assert drafts[1] == [2]


SNIPPET = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config import SpeculativeConfig
try:
    config = SpeculativeConfig(method="suffix", suffix_decoding_max_tree_depth=16)
    print("ACCEPTED", config.num_speculative_tokens)
except ImportError as err:
    print("REFUSED", err)
"""


def run_snippet(target):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ASCEND_TARGET"}
    if target:
        env["VLLM_ASCEND_TARGET"] = target
    proc = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True,
                          text=True, timeout=300)
    return proc.stdout.strip().splitlines()[-1]


def test_vllm_accepts_suffix_without_arctic_inference_only_where_our_platform_serves_it():
    # Our host target: accepted, vLLM's own defaults and checks applied (k = tree depth).
    assert run_snippet("host") == "ACCEPTED 16"
    # Plugin inactive: stock vLLM's refusal stands (its proposer would need arctic-inference).
    assert run_snippet(None).startswith("REFUSED Arctic Inference is required")
