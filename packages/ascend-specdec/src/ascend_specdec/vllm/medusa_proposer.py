"""Our Medusa proposer, in the place of vLLM's ``MedusaProposer`` in ascend-core's runners.

vLLM's model runner calls, for method "medusa": ``load_model(target_model)`` after loading the
target, ``propose(num_speculative_tokens=, target_hidden_states=, sampling_metadata=,
slot_mappings=)`` with one hidden-state row per request (the row of its last accepted token,
which the runner selects), expecting draft ids ``[requests, num_speculative_tokens]``, and
``dummy_run(num_tokens)``; it asserts ``isinstance(drafter, MedusaProposer)`` before proposing,
hence the subclass. Nothing of vLLM's implementation is used: the heads are
``ascend_specdec.medusa.MedusaHeads``, loaded from safetensors.

Differences from vLLM's proposer, each a start-up error there or a silent fault:
- the heads' ``config.json`` is checked against the base model (hidden size, vocabulary) and
  against ``num_speculative_tokens`` (vLLM overwrites ``num_heads`` with it, leaving the extra
  heads uninitialised, and ``vocab_size`` with the base model's);
- a truncated vocabulary is drafted by indexing the token map, without building full-vocabulary
  logits; a shared LM head runs once over every head's rows.

Under tensor parallelism each rank keeps its share of the LM heads' rows (as vLLM's
vocab-parallel LM head does) and the ranks all-gather each head's best row and logit.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from vllm.v1.spec_decode.medusa import MedusaProposer

from ascend_specdec.medusa.checkpoint import load_heads
from ascend_specdec.medusa.config import MedusaConfigError, MedusaHeadsConfig
from ascend_specdec.medusa.heads import MedusaHeads
from ascend_specdec.medusa.tree import MedusaTree

logger = logging.getLogger(__name__)


def heads_folder(speculative_config: Any) -> Path:
    """The local folder of the configured heads (downloading a hub id, as vLLM would)."""
    name = speculative_config.model
    if name is None:
        raise MedusaConfigError('speculative method "medusa" needs "model": the folder of the '
                                "Medusa heads (config.json + *.safetensors)")
    folder = Path(name).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, revision=getattr(speculative_config, "revision", None),
                                  allow_patterns=["*.json", "*.safetensors"]))


class AscendMedusaProposer(MedusaProposer):
    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        # MedusaProposer.__init__ is not called: it only prepares vLLM's own heads model.
        spec_config = vllm_config.speculative_config
        self.vllm_config = vllm_config
        self.spec_config = spec_config
        self.device = device
        self.dtype = vllm_config.model_config.dtype
        self.num_speculative_tokens = spec_config.num_speculative_tokens
        self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.heads_dir = heads_folder(spec_config)
        self.heads_config = MedusaHeadsConfig.load(self.heads_dir)
        # Tree verification (additional_config "medusa_tree_config"): num_speculative_tokens
        # counts the tree's nodes, not heads.
        from ascend_specdec.vllm.medusa_tree import configured_tree

        self.tree: MedusaTree | None = configured_tree(vllm_config)
        model_config = vllm_config.model_config
        self.heads_config.check_against_base(
            hidden_size=model_config.get_hidden_size(),
            vocab_size=model_config.get_vocab_size(),
            num_speculative_tokens=None if self.tree else self.num_speculative_tokens,
            where=str(self.heads_dir),
        )
        self.hidden_size = self.heads_config.hidden_size
        self.model: MedusaHeads | None = None
        self._gather = None  # all-gather over the tensor-parallel group, when sharded

    def load_model(self, target_model: torch.nn.Module) -> None:
        from vllm.distributed import parallel_state

        self.model = load_heads(self.heads_dir, dtype=self.dtype, device=self.device)
        config = self.heads_config
        # No tensor-parallel group (a proposer built outside a worker): the heads stay whole.
        group = (parallel_state.get_tp_group() if parallel_state.model_parallel_is_initialized()
                 else None)
        if group is not None and group.world_size > 1:
            self.model.shard_lm_heads(group.rank_in_group, group.world_size)
            self._gather = lambda tensor: group.all_gather(tensor.unsqueeze(0), dim=0)
        rows = self.model.head_weight(0).shape[0]
        logger.info("Medusa heads %s: %d heads (%d used), %s LM head, draft vocabulary %d of %d"
                    " (rows %d-%d on this rank)", self.heads_dir, config.num_heads,
                    self.num_speculative_tokens,
                    "one shared" if config.original_lm_head else "per-head",
                    config.draft_vocab_size, config.vocab_size, self.model.row_offset,
                    self.model.row_offset + rows - 1)

    @torch.inference_mode()
    def propose(self, num_speculative_tokens: int, target_hidden_states: torch.Tensor,
                sampling_metadata: Any = None, slot_mappings: Any = None) -> torch.Tensor:
        """[requests, hidden] -> draft token ids [requests, num_speculative_tokens]."""
        if self.model is None:
            raise RuntimeError("AscendMedusaProposer.propose before load_model")
        hidden = target_hidden_states.to(self.dtype)
        if num_speculative_tokens == 0:  # the draft-length controller chose none this step
            return torch.empty((hidden.shape[0], 0), dtype=torch.long, device=hidden.device)
        if self.tree is not None:  # the tree's first nodes, breadth first
            candidates = self.model.propose_top_k(hidden, self.tree.top_k, self._gather)
            return self.tree.node_tokens(candidates, num_speculative_tokens)
        return self.model.propose(hidden, num_speculative_tokens, self._gather)

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, **_: Any) -> None:
        if self.model is None:
            return
        hidden = torch.zeros((num_tokens, self.hidden_size), dtype=self.dtype,
                             device=self.device)
        self.propose(self.num_speculative_tokens, hidden)
