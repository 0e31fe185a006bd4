"""Medusa tree verification in both model runners: the hooks around vLLM's
runner that a tree step needs. The drafter carries the tree (``drafter.tree``, None for
chains) and the rejection sampler verifies it; see
:mod:`ascend_core.attention.tree_verification` for the step itself.

- ``_prepare_inputs``: nodes get the positions of their depths, and the step's tree
  requests are published for the attention layers;
- ``_sample``: after verification, the accepted paths' keys and values move to the slots
  after their roots;
- ``propose_draft_token_ids``: the next drafts come from the hidden state of each
  request's last accepted node (vLLM's Medusa branch takes the chain's row).
"""

from __future__ import annotations

import logging
from typing import Any

from ascend_core.attention import tree_verification

logger = logging.getLogger(__name__)


class TreeVerificationRunnerMixin:
    """Mixed in before vLLM's model runner class."""

    tree: Any = None
    # Whether the attention kernel ignores tree masks, so that the node rows are recomputed
    # (vLLM's CPU attention); the npu attention backend applies them itself.
    tree_attention_recomputes = True

    def check_tree_layer(self, name: str, impl: Any) -> None:
        """Refuse an attention layer this target's tree path does not serve."""
        tree_verification.check_layer(name, impl)

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        self.tree = getattr(getattr(self, "drafter", None), "tree", None)
        if self.tree is None:
            return
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        mode = self.compilation_config.cudagraph_mode
        if mode is not None and mode.has_full_cudagraphs():
            raise ValueError(
                f"Medusa tree verification (medusa_tree_config) runs without FULL graphs, got "
                f"cudagraph_mode={mode.name}: set compilation_config's cudagraph_mode to "
                "PIECEWISE or NONE, or remove medusa_tree_config")
        if not hasattr(self.rejection_sampler, "tree_accepted"):
            raise ValueError(
                f"Medusa tree verification (medusa_tree_config) needs the plugin's rejection "
                f"sampler, but this runner verifies with "
                f"{type(self.rejection_sampler).__name__} (rejection_sample_method "
                f"{getattr(self.speculative_config, 'rejection_sample_method', None)!r}): use "
                "the standard method, or remove medusa_tree_config")
        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        wrapped = tree_verification.install(layers, recompute=self.tree_attention_recomputes,
                                            check=self.check_tree_layer)
        self.rejection_sampler.tree = self.tree
        logger.info("Medusa tree verification: %d nodes, %d deep, over %d attention layers",
                    len(self.tree.paths), self.tree.depth, wrapped)

    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        tree_verification.set_step(None)
        spec_decode_metadata = result[1]
        if self.tree is not None and spec_decode_metadata is not None:
            num_reqs = self.input_batch.num_reqs
            step = tree_verification.plan_step(
                self.tree, spec_decode_metadata.num_draft_tokens,
                self.query_start_loc.np[:num_reqs + 1],
                self.input_batch.num_computed_tokens_cpu[:num_reqs])
            if step is not None:
                tree_verification.tree_positions(step, self.tree, self.positions)
                tree_verification.set_step(step)
        return result

    def _sample(self, logits: Any, spec_decode_metadata: Any) -> Any:
        output = super()._sample(logits, spec_decode_metadata)
        step = tree_verification.current_step()
        if step is not None:
            tree_verification.compact(step, self.rejection_sampler.tree_accepted)
            tree_verification.set_step(None)
        return output

    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any,
                                sampling_metadata: Any, hidden_states: Any,
                                sample_hidden_states: Any, aux_hidden_states: Any,
                                spec_decode_metadata: Any, common_attn_metadata: Any,
                                slot_mappings: Any) -> Any:
        if self.tree is None or spec_decode_metadata is None:
            return super().propose_draft_token_ids(
                scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                common_attn_metadata, slot_mappings)
        rows, offset = [], 0
        for drafts, path in zip(spec_decode_metadata.num_draft_tokens,
                                self.rejection_sampler.tree_accepted, strict=True):
            rows.append(offset + (path[-1] + 1 if path else 0))
            offset += drafts + 1
        return self.drafter.propose(
            num_speculative_tokens=scheduler_output.num_spec_tokens_to_schedule,
            target_hidden_states=sample_hidden_states[rows],
            sampling_metadata=sampling_metadata, slot_mappings=slot_mappings)
