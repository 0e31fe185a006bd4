"""Batched draft verification on ascend-kernels' ops. Imports no vLLM.

One call verifies every request of a step, greedy and random ones together, in vLLM's
ragged layout: request ``b`` owns draft tokens ``[cu[b-1], cu[b])`` of the ``N``
flattened ones, and the target's logits have one row per draft token (``[N, V]``).

- greedy rows (temperature 0) emit the target's argmax at each position and stop after
  the first position where the draft differs from it;
- random rows accept draft token ``x`` when ``u <= min(1, p(x) / q(x))`` (``p`` the target
  after temperature / top-k / top-p, ``q`` the draft's distribution, ``q = 1`` when the
  drafter gives no probabilities, as n-gram and argmax drafters), and at the first
  rejection emit a sample of ``normalize(max(p - q, 0))``;
- a row whose drafts were all accepted gets the bonus token (sampled by the caller from
  the target's row after the last draft);
- every draw comes from the default generator, except for requests with their own
  ``torch.Generator`` (seeded requests), which draw only from theirs, so their tokens do
  not depend on the rest of the batch.

Output: ``[B, max_spec_len + 1]`` int32, unused places ``PLACEHOLDER_TOKEN_ID`` (-1).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ascend_kernels.dispatch import TRITON, triton_unusable_reason
from ascend_kernels.rejection import (
    PLACEHOLDER_TOKEN_ID,
    generate_recovery_noise,
    generate_uniform_probs,
    rejection_greedy_sample,
    rejection_random_sample,
    request_of_token,
    sample_recovered_tokens,
)
from ascend_kernels.rejection_logits import (
    generate_recovery_uniforms,
    rejection_sample_from_logits,
    row_argmax,
)
from ascend_kernels.sampling import apply_top_k_top_p

__all__ = ["PLACEHOLDER_TOKEN_ID", "apply_sampling_constraints", "rejection_sample",
           "rejection_sampler_factory"]

GREEDY_TEMPERATURE = 0.0


def apply_sampling_constraints(target_logits: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                               temperature: torch.Tensor | None, top_k: torch.Tensor | None,
                               top_p: torch.Tensor | None, *,
                               backend: str | None = None) -> torch.Tensor:
    """Temperature, then top-k / top-p, each request's values applied to its draft rows.

    ``target_logits [N, V]`` float32 is divided in place; ``temperature``, ``top_k`` and
    ``top_p`` are per request (``[B]``), None when no request uses them. Greedy requests
    (temperature 0) keep temperature 1: their argmax is all that is read.
    """
    tokens = target_logits.shape[0]
    if temperature is None and top_k is None and top_p is None:
        return target_logits
    rows = request_of_token(cu_num_draft_tokens, tokens)
    if temperature is not None:
        scale = torch.where(temperature == GREEDY_TEMPERATURE, 1.0, temperature.float())
        # On the CPU the check is free and saves a pass over [N, V] when no row needs it.
        if scale.device.type != "cpu" or bool((scale != 1.0).any()):
            target_logits.div_(scale[rows].unsqueeze(1))
    if top_k is None and top_p is None:
        return target_logits
    return apply_top_k_top_p(target_logits, None if top_k is None else top_k[rows],
                             None if top_p is None else top_p[rows], backend=backend)


def rejection_sample(draft_token_ids: torch.Tensor, num_draft_tokens: Sequence[int],
                     cu_num_draft_tokens: torch.Tensor, max_spec_len: int,
                     draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                     bonus_token_ids: torch.Tensor, *, temperature: torch.Tensor | None,
                     all_greedy: bool, all_random: bool,
                     generators: Mapping[int, torch.Generator] | None = None,
                     use_fp64_gumbel: bool = False,
                     backend: str | None = None,
                     from_logits: bool | None = None,
                     target_rows: torch.Tensor | None = None,
                     temperature_applied: bool = True) -> torch.Tensor:
    """Verify the drafts of a whole step (see the module docstring).

    ``target_logits [N, V]``: the target's logits at the draft positions, after
    :func:`apply_sampling_constraints`. ``draft_probs [N, V]`` or None.
    ``bonus_token_ids [B]`` or ``[B, 1]``. ``temperature [B]`` (0 marks a greedy request)
    may be None only when ``all_greedy``.

    When every request is greedy, or every one is random and the rows are verified from the
    logits, the caller may skip copying and scaling the draft rows: ``target_rows [N]``
    gives each draft token's row of ``target_logits`` (the runner's whole logits), and
    ``temperature_applied=False`` says they are not yet divided by the temperatures (no
    top-k / top-p either).

    Random rows take one of two exact ways: ``from_logits`` (the default on the CPU, without
    a forced backend) verifies straight from the logits and draws a recovered token only
    where a request rejected (:mod:`ascend_kernels.rejection_logits`); otherwise the
    target's softmax goes through the per-position ops of :mod:`ascend_kernels.rejection`
    (Triton on devices), with randomness drawn in vLLM's order (the uniform draws, then the
    recovery noise), so a seeded request consumes its generator as under vLLM's sampler.
    """
    if len(num_draft_tokens) != cu_num_draft_tokens.shape[0]:
        raise ValueError(f"rejection_sample: {len(num_draft_tokens)} draft counts but "
                         f"cu_num_draft_tokens has {cu_num_draft_tokens.shape[0]} entries; "
                         "give one of each per request")
    if not all_greedy and temperature is None:
        raise ValueError("rejection_sample: temperature is None but not every request is "
                         "greedy; pass the per-request temperatures (0 for greedy ones)")
    if target_rows is not None and not (all_greedy or all_random):
        raise ValueError("rejection_sample: target_rows serves a batch that is all greedy or "
                         "all random; copy the draft rows of a mixed batch first")
    device = target_logits.device
    batch = len(num_draft_tokens)
    out = torch.full((batch, max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int32,
                     device=device)
    is_greedy = None if all_greedy else temperature == GREEDY_TEMPERATURE
    uniform_probs = None
    if not all_greedy:
        uniform_probs = generate_uniform_probs(num_draft_tokens, generators, device)
    if not all_random:
        target_argmax = row_argmax(target_logits)
        if target_rows is not None:
            target_argmax = target_argmax[target_rows.long()]
        rejection_greedy_sample(cu_num_draft_tokens, draft_token_ids, target_argmax,
                                bonus_token_ids, max_spec_len, is_greedy, out=out,
                                backend=backend)
        if all_greedy:
            return out
    if from_logits is None:
        from_logits = verifies_from_logits(device, backend)
    if (target_rows is not None or not temperature_applied) and not from_logits:
        raise ValueError("rejection_sample: target_rows / temperature_applied=False serve "
                         "random rows verified from the logits (from_logits) only; copy the "
                         "draft rows and apply the temperature first")
    if from_logits:
        recovery_uniform = generate_recovery_uniforms(num_draft_tokens, generators, device)
        return rejection_sample_from_logits(
            cu_num_draft_tokens, draft_token_ids, draft_probs, target_logits, bonus_token_ids,
            uniform_probs, recovery_uniform, max_spec_len, is_greedy, target_rows=target_rows,
            temperature=None if temperature_applied else temperature, out=out)
    target_probs = target_logits.softmax(dim=-1, dtype=torch.float32)
    inv_q = generate_recovery_noise(num_draft_tokens, target_probs.shape[1], generators, device,
                                    torch.float64 if use_fp64_gumbel else torch.float32)
    recovered = sample_recovered_tokens(cu_num_draft_tokens, draft_token_ids, draft_probs,
                                        target_probs, inv_q, backend=backend)
    return rejection_random_sample(cu_num_draft_tokens, draft_token_ids, draft_probs,
                                   target_probs, bonus_token_ids, recovered, uniform_probs,
                                   max_spec_len, is_greedy, out=out, backend=backend)


def verifies_from_logits(device: torch.device, backend: str | None) -> bool:
    """Whether random rows are verified from the logits by default: on the CPU, unless a
    backend is forced."""
    return torch.device(device).type == "cpu" and backend is None


def configured_backend(device) -> str | None:
    """The backend that ``additional_config`` ``rejection_sampler_config.backend`` forces on
    ``device``: None for "auto" (each op picks per device). A forced "triton" that cannot run
    there fails now, at start-up, rather than at the first verified draft."""
    from ascend_core.config import get_ascend_config

    name = get_ascend_config().rejection_sampler_config.backend
    if name == "auto":
        return None
    if name == TRITON:
        why = triton_unusable_reason(torch.empty(0, device=device))
        if why is not None:
            raise ValueError(
                f"additional_config key 'rejection_sampler_config.backend' is \"triton\", "
                f"which cannot run on {device} here: {why}; set it to \"auto\" or "
                "\"reference\".")
    return name


def rejection_sampler_factory(sampler, spec_config, device):
    """What ascend-core's model runners call (through ``REJECTION_SAMPLERS["ascend"]``) to
    build the rejection sampler, with the backend ``rejection_sampler_config`` sets; None
    for what only vLLM's serves (synthetic acceptance rates, a benchmarking mode with no
    verification to do). vLLM is imported here."""
    if getattr(spec_config, "rejection_sample_method", "standard") == "synthetic":
        return None
    from ascend_specdec.vllm.rejection_sampler import AscendRejectionSampler

    return AscendRejectionSampler(sampler, spec_config, device,
                                  backend=configured_backend(device))
