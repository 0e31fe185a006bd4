"""Our rejection sampler in place of vLLM's, for both model runners.

A subclass of vLLM's ``RejectionSampler`` with the same call and output: the runner's
sampler still draws the bonus tokens and vLLM's logits processors (bad words, min tokens,
allowed ids, thinking budget) and logprobs code run as before (for Medusa trees, on each
row with its own path's history), while penalties,
temperature, top-k / top-p and the verification itself (greedy and random, recovered
tokens) run on ascend-kernels' ops through :mod:`ascend_specdec.rejection`.
``parse_output`` is vLLM's: the output layout is the same.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor import MinTokensLogitsProcessor
from vllm.v1.sample.ops.bad_words import apply_bad_words_with_drafts
from vllm.v1.sample.rejection_sampler import MAX_SPEC_LEN, RejectionSampler

from ascend_kernels.sampling import apply_penalties
from ascend_specdec.medusa.tree import (
    MedusaTree,
    accepted_path_nodes,
    verify_greedy,
    verify_sampled,
)
from ascend_specdec.rejection import (
    GREEDY_TEMPERATURE,
    PLACEHOLDER_TOKEN_ID,
    apply_sampling_constraints,
    rejection_sample,
    verifies_from_logits,
)


class AscendRejectionSampler(RejectionSampler):
    """``backend`` forces an ascend-kernels backend ("reference", "triton"); None picks one
    per device (reference on the CPU, Triton on npu and cuda). ``from_logits`` picks how
    random rows are verified (see :func:`ascend_specdec.rejection.rejection_sample`; None:
    from the logits on the CPU unless a backend is forced)."""

    def __init__(self, sampler, spec_config=None, device=None, backend: str | None = None,
                 from_logits: bool | None = None):
        if getattr(spec_config, "rejection_sample_method", "standard") == "synthetic":
            raise ValueError("AscendRejectionSampler verifies drafts; rejection_sample_method="
                             "'synthetic' (fixed acceptance rates) is served by vLLM's "
                             "RejectionSampler, which the model runner keeps for it")
        super().__init__(sampler, spec_config, device)
        self.backend = backend
        self.from_logits = from_logits
        # Steps verified, for tests and logs that need to see this class at work.
        self.num_calls = 0
        # Medusa tree verification (set by the model runner when the proposer drafts a tree):
        # the tree, and per request of the last step the accepted nodes, root first.
        self.tree: MedusaTree | None = None
        self.tree_accepted: list[list[int]] = []

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        if metadata.max_spec_len > MAX_SPEC_LEN:
            raise ValueError(f"a request has {metadata.max_spec_len} draft tokens; at most "
                             f"{MAX_SPEC_LEN} are supported (num_speculative_tokens)")
        self.num_calls += 1
        if self.tree is not None:
            return self._verify_tree(metadata, logits, sampling_metadata)
        if metadata.max_spec_len == 0:
            # No request brought drafts (the draft-length controller chose none): the runner
            # computed one logits row per request, its bonus row, and the step is a plain
            # decode step, so vLLM's sampler alone samples it (the verification's gathers and
            # index tensors would only cost time).
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        wants_logprobs = sampling_metadata.max_num_logprobs is not None
        bonus_output = self.sampler(
            logits=logits.index_select(0, metadata.bonus_logits_indices),
            # -1: the bonus rows' logits come back, for the accepted tokens' logprobs below.
            sampling_metadata=replace(sampling_metadata,
                                      max_num_logprobs=-1 if wants_logprobs else None),
            predict_bonus_token=True,
            logprobs_mode_override=("processed_logits" if self.is_processed_logprobs_mode
                                    else "raw_logits"),
        )
        if self._verifies_untouched_rows(logits, sampling_metadata, wants_logprobs):
            # Nothing changes the draft rows but the temperature, which the verification
            # applies as it reads them: no copy of [N, V].
            output_token_ids = rejection_sample(
                metadata.draft_token_ids, metadata.num_draft_tokens,
                metadata.cu_num_draft_tokens, metadata.max_spec_len, draft_probs, logits,
                bonus_output.sampled_token_ids, temperature=sampling_metadata.temperature,
                all_greedy=sampling_metadata.all_greedy,
                all_random=sampling_metadata.all_random,
                generators=sampling_metadata.generators,
                target_rows=metadata.target_logits_indices, temperature_applied=False)
            return SamplerOutput(sampled_token_ids=output_token_ids, logprobs_tensors=None)
        # A copy, so the target rows may be changed in place from here on (index_select: on
        # a CPU several times faster than indexing with a tensor).
        raw_target_logits = logits.index_select(0, metadata.target_logits_indices)
        raw_target_logits = raw_target_logits.to(torch.float32)
        target_logits = raw_target_logits
        if wants_logprobs and not self.is_processed_logprobs_mode:
            target_logits = raw_target_logits.clone()  # raw logprobs read the untouched copy
        target_logits = self.apply_logits_processors(target_logits, sampling_metadata,
                                                     metadata)
        if not sampling_metadata.all_greedy:
            target_logits = apply_sampling_constraints(
                target_logits, metadata.cu_num_draft_tokens, sampling_metadata.temperature,
                sampling_metadata.top_k, sampling_metadata.top_p, backend=self.backend)
        output_token_ids = rejection_sample(
            metadata.draft_token_ids, metadata.num_draft_tokens, metadata.cu_num_draft_tokens,
            metadata.max_spec_len, draft_probs, target_logits,
            bonus_output.sampled_token_ids,
            temperature=sampling_metadata.temperature, all_greedy=sampling_metadata.all_greedy,
            all_random=sampling_metadata.all_random, generators=sampling_metadata.generators,
            use_fp64_gumbel=self.use_fp64_gumbel, backend=self.backend,
            from_logits=self.from_logits)
        logprobs_tensors = None
        if wants_logprobs:
            logprobs_tensors = self._get_logprobs_tensors(
                sampling_metadata.max_num_logprobs, metadata, logits,
                target_logits if self.is_processed_logprobs_mode else raw_target_logits,
                bonus_output.logprobs_tensors.logprobs, output_token_ids)
        return SamplerOutput(sampled_token_ids=output_token_ids,
                             logprobs_tensors=logprobs_tensors)

    def _verify_tree(self, metadata, logits, sampling_metadata) -> SamplerOutput:
        """Verify each request's tree prefix (``ascend_specdec.medusa.tree``): request ``r``
        has ``1 + m_r`` logits rows, its root's and its nodes'. Temperature, top-k, top-p
        and logprobs apply, and penalties, allowed token ids, bad words and min tokens with
        each row's own history (``_process_tree_rows``); the platform refuses the other
        sampling options at admission while a tree is served
        (``ascend_specdec.vllm.medusa_tree``)."""
        tree = self.tree
        counts = list(metadata.num_draft_tokens)
        cu_rows = torch.cumsum(torch.tensor([m + 1 for m in counts]), 0, dtype=torch.int32)
        starts = [0, *cu_rows.tolist()]
        drafts = metadata.draft_token_ids.tolist()
        processed = logits
        if self._changes_rows(sampling_metadata):
            processed = self._process_tree_rows(logits.to(torch.float32, copy=True),
                                                sampling_metadata, counts, drafts)
        greedy = None if sampling_metadata.all_random else processed.argmax(dim=-1).tolist()
        target = probs = None
        if not sampling_metadata.all_greedy:
            target = apply_sampling_constraints(
                processed.to(torch.float32, copy=processed is logits),
                cu_rows.to(logits.device),
                sampling_metadata.temperature, sampling_metadata.top_k,
                sampling_metadata.top_p, backend=self.backend)
            probs = target.softmax(dim=-1, dtype=torch.float32).cpu()
        temperature = (None if sampling_metadata.temperature is None
                       else sampling_metadata.temperature.tolist())
        width = metadata.max_spec_len + 1
        out = torch.full((len(counts), width), PLACEHOLDER_TOKEN_ID, dtype=torch.int32)
        # The logits row each emitted token was drawn from (placeholders: the root's).
        rows = torch.tensor(starts[:-1], dtype=torch.long).unsqueeze(1).repeat(1, width)
        self.tree_accepted = []
        for r, m in enumerate(counts):
            start, first = starts[r], starts[r] - r  # request r's rows; its drafts
            own = drafts[first:first + m]
            if sampling_metadata.all_greedy or (temperature is not None
                                                and temperature[r] == GREEDY_TEMPERATURE):
                tokens, last = verify_greedy(tree, own, greedy[start:start + m + 1])
            else:
                tokens, last = verify_sampled(tree, own, probs[start:start + m + 1],
                                              sampling_metadata.generators.get(r))
            path = accepted_path_nodes(tree, last)
            out[r, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
            rows[r, 1:len(tokens)] += torch.tensor([node + 1 for node in path],
                                                   dtype=torch.long)
            self.tree_accepted.append(path)
        out = out.to(logits.device)
        logprobs_tensors = None
        if sampling_metadata.max_num_logprobs is not None:
            source = logits.to(torch.float32)
            if self.is_processed_logprobs_mode:
                source = processed.to(torch.float32) if target is None else target
            chosen = source[rows.flatten().to(logits.device)]
            if not self.is_logits_logprobs_mode:
                chosen = self.sampler.compute_logprobs(chosen)
            tokens = out.flatten().to(torch.int64).clamp(min=0)
            logprobs_tensors = self.sampler.gather_logprobs(
                chosen, sampling_metadata.max_num_logprobs, tokens)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs_tensors)

    def _process_tree_rows(self, logits, sampling_metadata, counts, drafts) -> torch.Tensor:
        """vLLM's per-row processing of draft rows (``apply_logits_processors``) for a tree
        step's rows, in place: request ``r``'s root row, then a row per node, each with its
        own history, the request's output so far and then the drafts on the path from the
        root to that row's node (siblings' tokens are not in it). Min tokens masks the stop
        tokens of the rows whose next token would come before the minimum: those of a depth
        below it (the root's depth is 0)."""
        tree, metadata = self.tree, sampling_metadata
        outputs = metadata.output_token_ids
        histories, owners, depths, first = [], [], [], 0
        for r, m in enumerate(counts):
            own, done = drafts[first:first + m], list(outputs[r]) if outputs else []
            first += m
            histories.append(done)
            for node in range(m):
                path = accepted_path_nodes(tree, node + 1)
                histories.append(done + [own[n] for n in path])
            owners += [r] * (m + 1)
            depths += [0, *tree.depths[:m]]
        rows = torch.tensor(owners, device=logits.device)
        logits = self.apply_penalties(logits, metadata, None, rows, histories)
        if metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(metadata.allowed_token_ids_mask[rows], float("-inf"))
        if metadata.bad_words_token_ids:
            apply_bad_words_with_drafts(logits, metadata.bad_words_token_ids, histories,
                                        [m + 1 for m in counts])
        for processor in metadata.logitsprocs.non_argmax_invariant:
            if not isinstance(processor, MinTokensLogitsProcessor):
                continue
            for r, (minimum, done, stops, _) in processor.min_toks.items():
                masked = [row for row, (owner, depth) in enumerate(zip(owners, depths, strict=True))
                          if owner == r and depth < minimum - len(done)]
                if masked and stops:
                    logits[torch.tensor(masked).unsqueeze(1),
                           torch.tensor(sorted(stops)).unsqueeze(0)] = float("-inf")
        return logits

    @staticmethod
    def _changes_rows(metadata) -> bool:
        """Whether anything of vLLM's ``apply_logits_processors`` (0.32) changes draft rows
        in this step: penalties, allowed token ids, bad words, min tokens, a thinking
        budget."""
        if (not metadata.no_penalties or metadata.allowed_token_ids_mask is not None
                or metadata.bad_words_token_ids):
            return True
        if any(isinstance(processor, MinTokensLogitsProcessor) and processor.min_toks
               for processor in metadata.logitsprocs.non_argmax_invariant):
            return True
        holder = getattr(metadata, "thinking_budget_state_holder", None)
        return holder is not None and holder.has_tracked_requests()

    def _verifies_untouched_rows(self, logits, sampling_metadata, wants_logprobs) -> bool:
        """Whether the draft rows can be verified where they lie: every request greedy or
        every one random, no top-k / top-p or logprobs, verified from the logits (the CPU
        default), and nothing that vLLM's ``apply_logits_processors`` (0.32) changes rows
        for: penalties, allowed token ids, bad words, min tokens, a thinking budget."""
        metadata = sampling_metadata
        if (not (metadata.all_random or metadata.all_greedy) or metadata.top_k is not None
                or metadata.top_p is not None or wants_logprobs or self.from_logits is False
                or not verifies_from_logits(logits.device, self.backend)):
            return False
        return not self._changes_rows(metadata)

    @staticmethod
    def apply_penalties(logits, sampling_metadata, metadata, repeat_indices,
                        output_token_ids) -> torch.Tensor:
        """vLLM's hook, on ascend-kernels' ``apply_penalties``: ``repeat_indices`` maps
        each draft row to its request, ``output_token_ids`` holds each row's tokens so
        far (the drafts before it included)."""
        if sampling_metadata.no_penalties:
            return logits
        vocab = logits.shape[1]
        longest = max((len(ids) for ids in output_token_ids), default=0)
        outputs = torch.full((len(output_token_ids), longest), vocab, dtype=torch.int64)
        for row, ids in enumerate(output_token_ids):
            outputs[row, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return apply_penalties(
            logits, sampling_metadata.prompt_token_ids[repeat_indices],
            outputs.to(logits.device), sampling_metadata.presence_penalties[repeat_indices],
            sampling_metadata.frequency_penalties[repeat_indices],
            sampling_metadata.repetition_penalties[repeat_indices])
