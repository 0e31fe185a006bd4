"""Our EAGLE / EAGLE-3 / MTP proposer, in the place of vLLM's ``EagleProposer`` in core's runners.

vLLM's model runner drives one proposer class for the three methods (``use_eagle()``): it
builds it in its ``__init__``, calls ``load_model(target)``, ``initialize_attn_backend``,
``dummy_run`` and, every step, ``prepare_next_token_ids_padded`` → ``prepare_inputs_padded`` →
``propose``; it checks ``isinstance(drafter, EagleProposer)`` on that path, hence the subclass.
The draft models themselves (``EagleLlamaForCausalLM``, ``Eagle3LlamaForCausalLM``,
``DeepSeekMTPModel``, ...) stay vLLM's.

What this subclass does differently:
- start-up checks vLLM lacks: a draft whose hidden size does not match the target's fails at
  start-up, naming both sizes (vLLM fails at the first drafted step with a shape error);
- the per-request bookkeeping of every step (next token and valid counts, where each draft
  reads its hidden state, positions / KV slots / lengths of each drafted token) runs as
  ``ascend_kernels.spec_decode`` torch ops, which run on an NPU, where vLLM's Triton kernels
  (and its CPU backend's C++ fallbacks) do not;
- dummy runs (warm-up, graph capture) give the draft layers padding KV slots (-1), as vLLM's
  runner does for the target, not the zeros the unwritten slot buffer holds (vLLM's kernels
  tolerate many writes to slot 0; the NPU's paged KV scatter takes unique slots only);
- greedy drafting over a truncated draft vocabulary (EAGLE-3 ``d2t``) takes the argmax over
  the draft's own logits and maps the winner, instead of scattering the logits into a
  full-vocabulary tensor of -inf first.

``ascend_counters`` counts each of those calls, so tests can see them run inside vLLM.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.spec_decode.eagle import EagleProposer

from ascend_kernels.spec_decode import (
    PAD_SLOT_ID,
    next_token_ids_padded,
    sample_indices_padded,
    step_positions_and_slots,
)
from ascend_specdec.eagle import check_draft_against_target, check_draft_weights

logger = logging.getLogger(__name__)


def _draft_hidden_sizes(vllm_config: Any) -> tuple[int, int]:
    """(the target hidden size the draft reads, the target's hidden size)."""
    spec_config = vllm_config.speculative_config
    draft_hf = spec_config.draft_model_config.hf_config
    reads = getattr(draft_hf, "target_hidden_size", None) if spec_config.method == "eagle3" \
        else None
    if reads is None:
        reads = spec_config.draft_model_config.get_hidden_size()
    return int(reads), int(vllm_config.model_config.get_hidden_size())


class AscendEagleProposer(EagleProposer):
    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        spec_config = vllm_config.speculative_config
        draft_reads, target_hidden = _draft_hidden_sizes(vllm_config)
        check_draft_against_target(
            method=spec_config.method, draft_reads_hidden_size=draft_reads,
            target_hidden_size=target_hidden,
            where=str(spec_config.draft_model_config.model))
        check_draft_weights(method=spec_config.method,
                            draft_folder=spec_config.draft_model_config.model,
                            target_hidden_size=target_hidden)
        super().__init__(vllm_config, device, runner)
        self.ascend_counters: Counter[str] = Counter()

    # ------------------------------------------------------------------ warm-up

    @torch.inference_mode()
    def dummy_run(self, num_tokens: int, use_cudagraphs: bool = True,
                  is_graph_capturing: bool = False,
                  slot_mappings: dict[str, torch.Tensor] | None = None) -> None:
        # While the target's graphs are captured, vLLM hands the draft layers this proposer's
        # own slot buffer, which no step has written yet (zeros at start-up): every dummy
        # token would write KV slot 0. A dummy run has no real slots, so they are padding
        # (-1), as in the target's dummy runs: a KV write that takes unique slots only (the
        # npu target's npu_scatter_pa_kv_cache) skips them or sends them to the null block.
        self._slot_mapping_buffer.fill_(PAD_SLOT_ID)  # (the padded size may exceed num_tokens)
        self.ascend_counters["dummy_run_padding_slots"] += 1
        super().dummy_run(num_tokens, use_cudagraphs=use_cudagraphs,
                          is_graph_capturing=is_graph_capturing, slot_mappings=slot_mappings)

    # ------------------------------------------------------------------ drafting

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        draft_to_target = getattr(self.model, "draft_id_to_target_id", None)
        if (draft_to_target is None or self.use_local_argmax_reduction
                or self.use_heterogeneous_vocab):
            self.ascend_counters["greedy_full_vocab"] += 1
            return self.model.compute_logits(hidden_states).argmax(dim=-1)
        # The draft ids are sorted by target id, so the first maximum is the one vLLM's
        # scattered argmax finds: the same token, without [rows, vocab] of -inf.
        logits = self.model.logits_processor(self.model.lm_head, hidden_states)
        draft_ids = logits.argmax(dim=-1)
        self.ascend_counters["greedy_truncated_vocab"] += 1
        return draft_ids + draft_to_target[draft_ids]

    # ------------------------------------------------------------------ bookkeeping

    def prepare_next_token_ids_padded(self, sampled_token_ids: torch.Tensor, requests: dict,
                                      gpu_input_batch: Any,
                                      discard_request_mask: torch.Tensor):
        num_reqs = gpu_input_batch.num_reqs
        backup = self.backup_next_token_ids
        for i, req_id in enumerate(gpu_input_batch.req_ids[:num_reqs]):
            # The request's last token before this step's samples.
            backup.np[i] = requests[req_id].get_token_id(
                gpu_input_batch.num_tokens_no_spec[i] - 1)
        backup.copy_to_gpu(num_reqs)
        self.ascend_counters["next_token_ids_padded"] += 1
        return next_token_ids_padded(
            sampled_token_ids, discard_request_mask[: sampled_token_ids.shape[0]],
            backup.gpu[: sampled_token_ids.shape[0]], gpu_input_batch.vocab_size)

    def prepare_inputs_padded(self, common_attn_metadata: CommonAttentionMetadata,
                              spec_decode_metadata: Any, valid_sampled_tokens_count: torch.Tensor):
        num_reqs = common_attn_metadata.num_reqs
        token_indices, num_rejected = sample_indices_padded(
            spec_decode_metadata.cu_num_draft_tokens[:num_reqs],
            valid_sampled_tokens_count[:num_reqs],
            common_attn_metadata.query_start_loc[: num_reqs + 1])
        self.ascend_counters["sample_indices_padded"] += 1
        # Rejected tokens stay in the drafter's query as padding: the layout is unchanged.
        query_start_loc_cpu = common_attn_metadata.query_start_loc_cpu
        total_tokens = int(query_start_loc_cpu[-1])
        query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
        metadata = CommonAttentionMetadata(
            query_start_loc=common_attn_metadata.query_start_loc,
            seq_lens=common_attn_metadata.seq_lens,
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu_upper_bound=common_attn_metadata.seq_lens_cpu_upper_bound,
            num_reqs=num_reqs,
            num_actual_tokens=total_tokens,
            max_query_len=int(query_lens.max()),
            max_seq_len=common_attn_metadata.max_seq_len,
            block_table_tensor=common_attn_metadata.block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping[:total_tokens],
            causal=True,
            dcp_local_seq_lens=common_attn_metadata.dcp_local_seq_lens,
        )
        return metadata, token_indices, num_rejected

    def _update_positions_dependent_metadata(self, positions: torch.Tensor,
                                             common_attn_metadata: Any, batch_size: int,
                                             input_batch_size: int,
                                             block_size: int) -> torch.Tensor:
        if self.uses_mrope:  # M-RoPE drafts keep vLLM's path (three position rows)
            return super()._update_positions_dependent_metadata(
                positions, common_attn_metadata, batch_size, input_batch_size, block_size)
        step_positions_and_slots(
            positions, common_attn_metadata.block_table_tensor,
            common_attn_metadata.seq_lens, block_size=block_size,
            max_model_len=self.max_model_len, out_positions=self.positions[:batch_size],
            out_slot_mapping=self._slot_mapping_buffer[:input_batch_size],
            pad_slot_id=PAD_SLOT_ID)
        self.ascend_counters["step_positions_and_slots"] += 1
        common_attn_metadata.slot_mapping = self._slot_mapping_buffer[:batch_size]
        common_attn_metadata.max_seq_len = min(common_attn_metadata.max_seq_len + 1,
                                               self.max_model_len)
        if common_attn_metadata.seq_lens_cpu_upper_bound is not None:
            common_attn_metadata.seq_lens_cpu_upper_bound += 1
        return self.positions[:batch_size]
