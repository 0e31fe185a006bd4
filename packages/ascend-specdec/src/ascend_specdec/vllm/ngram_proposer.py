"""Our n-gram proposer, in the place of vLLM's ``NgramProposer`` in ascend-core's runners.

vLLM's model runner calls, for method "ngram": ``propose(num_speculative_tokens,
sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=)`` after bookkeeping, with
``token_ids_cpu`` the input batch's [max_num_reqs, max_model_len] history buffer, and expects one
draft list per request; it asserts ``isinstance(drafter, NgramProposer)`` first, hence the
subclass. Drafting is ``ascend_specdec.ngram`` (numpy, whole batch at once); vLLM's numba kernel
and its JIT warm-up at start-up are not used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from vllm.v1.spec_decode.ngram_proposer import NgramProposer

from ascend_specdec.ngram import NgramConfig, propose_batch


class AscendNgramProposer(NgramProposer):
    def __init__(self, vllm_config: Any, device: Any = None, runner: Any = None) -> None:
        # NgramProposer.__init__ is not called: it only sizes numba buffers and warms the JIT.
        spec_config = vllm_config.speculative_config
        self.min_n = spec_config.prompt_lookup_min
        self.max_n = spec_config.prompt_lookup_max
        self.k = spec_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.config = NgramConfig(min_n=self.min_n, max_n=self.max_n, k=self.k,
                                  max_model_len=self.max_model_len)

    def propose(self, num_speculative_tokens: int, sampled_token_ids: list[list[int]],
                num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray,
                slot_mappings: Any = None) -> list[list[int]]:
        num_requests = len(sampled_token_ids)
        # Requests that sampled nothing (partial prefills) or are full do not draft.
        rows = [i for i, sampled in enumerate(sampled_token_ids)
                if sampled and num_tokens_no_spec[i] < self.max_model_len]
        drafts: list[list[int]] = [[] for _ in range(num_requests)]
        if rows and num_speculative_tokens > 0:  # 0: the draft-length controller chose none
            values, lengths = propose_batch(self.config, token_ids_cpu, num_tokens_no_spec,
                                            rows, k=num_speculative_tokens)
            for j, row in enumerate(rows):
                if lengths[j]:
                    drafts[row] = values[j, : lengths[j]].tolist()
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load."""
