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
  full-vocabulary tensor of -inf first;
- a step that asks for no drafts (the draft-length controller's length 0) skips the draft
  model: vLLM runs its first pass anyway, only to write the draft's KV for the step's tokens.
  Here each request's inputs of that pass (its tokens, positions and the target's hidden
  states) are kept, and the next step that drafts, or one whose kept inputs would no longer
  fit the proposer's buffers, first runs one catch-up pass over every kept token of the
  batch's requests (their KV slots from the current block table), so the draft attends to
  the same KV as if no pass had been skipped: the same drafts, for a pass over many tokens
  at once instead of one per step (see ``_catch_up``).

``ascend_counters`` counts each of those calls, so tests can see them run inside vLLM.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
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


def catch_up_order(rows: torch.Tensor, positions: torch.Tensor,
                   first: torch.Tensor) -> torch.Tensor:
    """Which kept tokens a catch-up pass runs, in its order: ``rows`` is each token's request
    row in this step's batch (-1: not in it), ``positions`` its position, ``first`` each
    row's first position in this step. A request's tokens before that position, by row then
    position; of a position kept twice (a request recomputed after a preemption) the later
    one; tokens at or after it are this step's again and are left out."""
    positions = positions.long()
    usable = (rows >= 0) & (positions < first[rows.clamp(min=0)])
    # One key per (row, position); a stable sort keeps a position's later token last.
    key = torch.where(usable, rows * (int(positions.max()) + 1) + positions, -1)
    key, order = torch.sort(key, stable=True)
    last = torch.ones_like(usable)
    last[:-1] = key[1:] != key[:-1]
    return order[(key >= 0) & last]


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
        self._runner = runner
        # The draft's first-pass inputs of skipped passes, one entry per step: each token's
        # request (a number from _request_numbers), token id, position and target hidden
        # state; and their token count in all.
        self._kept: list[tuple[torch.Tensor, ...]] = []
        self._kept_tokens = 0
        self._request_numbers: dict[str, int] = {}
        # Skipping needs the plain first pass (one draft input per target token) of a
        # single engine; else every step runs it, as vLLM does.
        self.skips_idle_passes = (
            runner is not None and not self.needs_extra_input_slots
            and not self.parallel_drafting and not self.uses_mrope
            and not self.supports_mm_inputs and self.pass_hidden_states_to_model
            and vllm_config.parallel_config.data_parallel_size == 1)

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

    # ------------------------------------------------------------------ skipped passes

    def propose(self, num_speculative_tokens: int, target_token_ids: torch.Tensor,
                target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
                next_token_ids: torch.Tensor, token_indices_to_sample: torch.Tensor | None,
                common_attn_metadata: CommonAttentionMetadata, sampling_metadata: Any,
                mm_embed_inputs: Any = None, num_rejected_tokens_gpu: torch.Tensor | None = None,
                slot_mappings: Any = None) -> torch.Tensor:
        def drafted() -> torch.Tensor:
            return super(AscendEagleProposer, self).propose(
                num_speculative_tokens, target_token_ids, target_positions,
                target_hidden_states, next_token_ids, token_indices_to_sample,
                common_attn_metadata, sampling_metadata, mm_embed_inputs,
                num_rejected_tokens_gpu, slot_mappings)

        # (A draft sharing the target's MTP indexer, or balancing experts, sets up state in
        # every first pass: those run every pass, as vLLM's.)
        if (not self.skips_idle_passes or self._share_mtp_indices
                or self.eplb_state is not None):
            return drafted()
        req_ids = self._runner.input_batch.req_ids[:common_attn_metadata.num_reqs]
        if (num_speculative_tokens == 0 and self._kept_tokens
                + common_attn_metadata.num_actual_tokens <= self.max_num_tokens):
            self._keep(req_ids, target_token_ids, target_positions, target_hidden_states,
                       next_token_ids, token_indices_to_sample, common_attn_metadata,
                       num_rejected_tokens_gpu)
            self._last_draft_probs = None
            return torch.empty(len(req_ids), 0, dtype=torch.int64, device=self.device)
        self._catch_up(req_ids, target_positions, common_attn_metadata)
        return drafted()

    def _keep(self, req_ids: list[str], target_token_ids: torch.Tensor,
              target_positions: torch.Tensor, target_hidden_states: torch.Tensor,
              next_token_ids: torch.Tensor, token_indices_to_sample: torch.Tensor | None,
              cad: CommonAttentionMetadata, num_rejected_tokens_gpu: torch.Tensor | None
              ) -> None:
        """Keep what the skipped first pass would have fed the draft: vLLM's own input
        layout (tokens shifted by one, the next token at each request's last accepted
        position), each request's tokens up to that position (the rejected ones after it
        are padding)."""
        if self.method in ("eagle3", "dflash"):
            target_hidden_states = self.model.combine_hidden_states(target_hidden_states)
        _, last, cad = self.set_inputs_first_pass(
            target_token_ids, next_token_ids, target_positions, target_hidden_states,
            token_indices_to_sample, cad, num_rejected_tokens_gpu)
        starts = cad.query_start_loc[:len(req_ids)].long()
        counts = last[:len(req_ids)].long() + 1 - starts
        total = int(counts.sum())
        offsets = counts.cumsum(0) - counts
        index = (torch.repeat_interleave(starts - offsets, counts, output_size=total)
                 + torch.arange(total, device=self.device))
        # (numbers stay dense, 0 to len - 1: _catch_up renumbers what it leaves)
        numbers = [self._request_numbers.setdefault(r, len(self._request_numbers))
                   for r in req_ids]
        owner = torch.repeat_interleave(torch.tensor(numbers, device=self.device), counts,
                                        output_size=total)
        self._kept.append((owner, self.input_ids[index],
                           self._get_positions(self.max_num_tokens)[index],
                           self.hidden_states[index]))
        self._kept_tokens += total
        self.ascend_counters["draft_passes_skipped"] += 1

    def _catch_up(self, req_ids: list[str], target_positions: torch.Tensor,
                  cad: CommonAttentionMetadata) -> None:
        """One draft pass over the kept inputs of the batch's requests, for the KV it writes
        (its outputs are not used): each request's kept tokens as one query, attending to
        its draft KV before them, their KV slots from the block table now. A token at or
        after a request's first position in this step (recomputed, after a preemption) is
        dropped, and of one position kept twice the later one counts. Requests not in the
        batch keep their tokens while they run; finished ones lose them."""
        if not self._kept:
            return
        owner, ids, positions, hidden = (torch.cat(t) for t in zip(*self._kept, strict=True))
        self._kept, self._kept_tokens = [], 0
        row_of = torch.full((len(self._request_numbers),), -1, dtype=torch.long,
                            device=self.device)
        for row, req_id in enumerate(req_ids):
            if req_id in self._request_numbers:
                row_of[self._request_numbers[req_id]] = row
        rows = row_of[owner]
        elsewhere = rows < 0
        # Requests not in this batch keep their tokens while they run (numbered afresh,
        # from 0); every other request's number is free again.
        number_of = {n: r for r, n in self._request_numbers.items()}
        self._request_numbers = {}
        if bool(elsewhere.any()):
            numbers, inverse = torch.unique(owner[elsewhere], return_inverse=True)
            runs = [number_of[n] in self._runner.requests for n in numbers.tolist()]
            if any(runs):
                runs_t = torch.tensor(runs, device=self.device)
                dense = runs_t.long().cumsum(0) - 1
                keep = runs_t[inverse]
                self._kept.append((dense[inverse][keep], *(t[elsewhere][keep]
                                                           for t in (ids, positions, hidden))))
                self._kept_tokens = int(keep.sum())
                self._request_numbers = {
                    number_of[n]: d for n, d, r in zip(numbers.tolist(), dense.tolist(), runs,
                                                       strict=True) if r}
        first = target_positions[cad.query_start_loc[:len(req_ids)].long()].long()
        order = catch_up_order(rows, positions, first)
        if order.numel() == 0:
            return
        rows, ids, positions, hidden = rows[order], ids[order], positions[order], hidden[order]
        present, lengths = torch.unique_consecutive(rows, return_counts=True)
        total = ids.shape[0]
        self.input_ids[:total] = ids
        self._set_positions(total, positions)
        self.hidden_states[:total] = hidden
        ends = lengths.cumsum(0)
        query_start_loc = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        seq_lens = (positions[ends - 1].long() + 1).to(torch.int32)
        block_table = cad.block_table_tensor[present]
        request = torch.repeat_interleave(torch.arange(present.numel(), device=self.device),
                                          lengths, output_size=total)
        positions = positions.long()
        slots = (block_table[request, positions // self.block_size].long() * self.block_size
                 + positions % self.block_size)
        metadata = CommonAttentionMetadata(
            query_start_loc=query_start_loc,
            query_start_loc_cpu=query_start_loc.cpu(),
            seq_lens=seq_lens,
            seq_lens_cpu_upper_bound=seq_lens.cpu(),
            num_reqs=present.numel(),
            num_actual_tokens=total,
            max_query_len=int(lengths.max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table,
            slot_mapping=slots,
            causal=True,
        )
        _, per_layer = self.build_per_group_and_layer_attn_metadata(metadata)
        with set_forward_context(per_layer, self.vllm_config, num_tokens=total,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE,
                                 slot_mapping=self._get_slot_mapping(total, slots)):
            self.model(input_ids=self.input_ids[:total], positions=self._get_positions(total),
                       hidden_states=self.hidden_states[:total], inputs_embeds=None)
        self.ascend_counters["draft_catch_up_passes"] += 1
        self.ascend_counters["draft_catch_up_tokens"] += total

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
