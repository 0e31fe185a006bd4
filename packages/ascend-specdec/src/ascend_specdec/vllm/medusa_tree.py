"""Medusa tree verification at start-up, at admission and in the scheduler (both targets).

The config hook checks ``additional_config["medusa_tree_config"]`` against the configured
heads before anything loads, records whether a tree is served, and puts in the plugin's
scheduler factory, which gives the scheduler ``TreeGrammar``: structured output's grammar
masks per tree row. The request check then refuses, one request at a time, the sampling
options a tree step does not apply.
"""

from __future__ import annotations

import json
from typing import Any

from ascend_specdec.medusa.config import MedusaConfigError, MedusaHeadsConfig
from ascend_specdec.medusa.tree import (
    PATHS_FILE,
    MedusaTree,
    accepted_path_nodes,
    choose_tree,
    parse_tree,
)

# The tree this process serves, set by the config hook (None: none, or chains), and whether
# its scheduler masks structured output per tree row.
_served: list[MedusaTree | None] = [None]
_grammar: list[bool] = [False]


def configured_tree(vllm_config: Any) -> MedusaTree | None:
    """The checked tree of ``medusa_tree_config`` (``paths``, or ``auto``: chosen from the
    heads' measured paths), or None when it asks for none."""
    from ascend_core.config import AscendConfig

    config = AscendConfig.from_dict(vllm_config.additional_config).medusa_tree_config
    if config.paths is None and not config.auto:
        return None
    if config.paths is not None and config.auto:
        raise MedusaConfigError("additional_config medusa_tree_config: give paths or auto, "
                                "not both (auto chooses the paths from the heads' record)")
    spec_config = vllm_config.speculative_config
    method = getattr(spec_config, "method", None)
    if method != "medusa":
        raise MedusaConfigError(
            f"additional_config medusa_tree_config is for speculative method 'medusa', but "
            f"speculative_config method is {method!r}: remove medusa_tree_config, or set "
            "method 'medusa' with Medusa heads")
    from ascend_specdec.vllm.medusa_proposer import heads_folder

    folder = heads_folder(spec_config)
    heads = MedusaHeadsConfig.load(folder)
    nodes = spec_config.num_speculative_tokens
    if config.paths is not None:
        tree = parse_tree(config.paths, num_heads=heads.num_heads, num_nodes=nodes)
    else:
        record = folder / PATHS_FILE
        if not record.is_file():
            raise MedusaConfigError(
                f"medusa_tree_config.auto: the heads in {folder} have no {PATHS_FILE} (the "
                "paths their trainer measured); retrain them with python -m "
                "ascend_specdec.train_medusa, or give medusa_tree_config.paths")
        frequencies = json.loads(record.read_text(encoding="utf-8"))["paths"]
        tree = choose_tree(frequencies, nodes, num_heads=heads.num_heads)
    if max(tree.top_k) > heads.draft_vocab_size:
        raise MedusaConfigError(
            f"medusa_tree_config: the tree takes a head's top {max(tree.top_k)} candidates, "
            f"but the heads in {folder} draft from {heads.draft_vocab_size} tokens: use "
            f"candidate indices below {heads.draft_vocab_size}")
    return tree


def check_config(vllm_config: Any) -> None:
    """Core's CONFIG_HOOKS entry: stop a bad tree at start-up; remember a good one, and give
    its server the scheduler factory that masks structured output per tree row (not where
    another scheduler class is configured, nor with a reasoning parser, whose end of
    reasoning vLLM finds along one chain of drafts)."""
    from ascend_specdec.vllm.draft_length import SCHEDULER

    tree = _served[0] = configured_tree(vllm_config)
    scheduler_config = vllm_config.scheduler_config
    reasoning = getattr(getattr(vllm_config, "structured_outputs_config", None),
                        "reasoning_parser", None)
    _grammar[0] = (tree is not None and not reasoning
                   and scheduler_config.scheduler_cls in (None, SCHEDULER))
    if _grammar[0]:
        scheduler_config.scheduler_cls = SCHEDULER


class TreeGrammar:
    """vLLM's ``StructuredOutputManager`` as the scheduler of a tree server uses it.

    vLLM fills one grammar mask per row of a chain: row ``i`` is the grammar's state after
    the first ``i`` drafts. In a tree step a node's row follows the node's own path from the
    root, not the nodes before it in breadth-first order, so row ``1 + j`` (node ``j``) is
    the state after the drafts of node ``j``'s ancestors and of node ``j``. vLLM also cuts a
    request's drafts at the first one its grammar refuses; a tree keeps every node (one the
    grammar refuses is never accepted: its parent's row masks its token, and its own row
    and its descendants' then never sample). Everything else is the manager's own."""

    def __init__(self, manager: Any, tree: MedusaTree) -> None:
        self._manager = manager
        # Each node's path, root first (the row of node j is row j + 1).
        self._paths = [accepted_path_nodes(tree, node + 1) for node in range(tree.num_nodes)]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def validate_tokens(self, request: Any, spec_tokens: list[int]) -> list[int]:
        return spec_tokens

    def grammar_bitmask(self, requests: dict, structured_output_request_ids: list[str],
                        scheduled_spec_decode_tokens: dict[str, list[int]]):
        if not structured_output_request_ids:
            return None
        rows = sum(1 + len(scheduled_spec_decode_tokens.get(r, ()))
                   for r in structured_output_request_ids)
        bitmask = self._manager.backend.allocate_token_bitmask(rows)
        row = 0
        for req_id in structured_output_request_ids:
            grammar = requests[req_id].structured_output_request.grammar
            drafts = scheduled_spec_decode_tokens.get(req_id, ())
            for path in ([], *self._paths[:len(drafts)]):
                tokens = [drafts[node] for node in path]
                # A path the grammar refuses part of: its node is never accepted, and its
                # row (the state after the part it takes) never samples.
                taken = grammar.validate_tokens(tokens) if tokens else []
                if taken:
                    grammar.accept_tokens(req_id, taken)
                if grammar.is_terminated():
                    bitmask[row].fill_(-1)  # every token allowed, as vLLM does
                else:
                    grammar.fill_bitmask(bitmask, row)
                if taken:
                    grammar.rollback(len(taken))
                row += 1
        return bitmask.numpy()


# What a tree step does not apply: (SamplingParams field, whether a value sets it). vLLM
# itself refuses min_p and logit_bias with any speculative method.
_UNSERVED = (
    ("thinking_token_budget", lambda v: v is not None),
    ("logprob_token_ids", lambda v: v is not None),
)


def check_request(params: Any) -> None:
    """Core's REQUEST_CHECKS entry: refuse what a tree step would silently ignore."""
    if _served[0] is None or not hasattr(params, "temperature"):
        return
    unserved = _UNSERVED if _grammar[0] else (
        ("structured_outputs", lambda v: v is not None), *_UNSERVED)
    given = [name for name, is_set in unserved if is_set(getattr(params, name, None))]
    if given:
        raise ValueError(
            f"this server verifies Medusa trees (medusa_tree_config), which apply "
            f"temperature, top_k, top_p, seed, logprobs, penalties, min_tokens, "
            f"allowed_token_ids, bad_words and structured output (without a reasoning "
            f"parser or another scheduler_cls) only; the request sets "
            f"{', '.join(given)}: send it without them, or serve without medusa_tree_config")
