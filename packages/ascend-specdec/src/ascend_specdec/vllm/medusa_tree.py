"""Medusa tree verification at start-up and at admission (both targets).

The config hook checks ``additional_config["medusa_tree_config"]`` against the configured
heads before anything loads, and records whether a tree is served; the request check then
refuses, one request at a time, the sampling options a tree step does not apply.
"""

from __future__ import annotations

import json
from typing import Any

from ascend_specdec.medusa.config import MedusaConfigError, MedusaHeadsConfig
from ascend_specdec.medusa.tree import PATHS_FILE, MedusaTree, choose_tree, parse_tree

# The tree this process serves, set by the config hook (None: none, or chains).
_served: list[MedusaTree | None] = [None]


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
    """Core's CONFIG_HOOKS entry: stop a bad tree at start-up; remember a good one."""
    _served[0] = configured_tree(vllm_config)


# What a tree step does not apply: (SamplingParams field, whether a value sets it). vLLM
# itself refuses min_p and logit_bias with any speculative method.
_UNSERVED = (
    ("structured_outputs", lambda v: v is not None),
    ("thinking_token_budget", lambda v: v is not None),
    ("logprob_token_ids", lambda v: v is not None),
)


def check_request(params: Any) -> None:
    """Core's REQUEST_CHECKS entry: refuse what a tree step would silently ignore."""
    if _served[0] is None or not hasattr(params, "temperature"):
        return
    given = [name for name, is_set in _UNSERVED if is_set(getattr(params, name, None))]
    if given:
        raise ValueError(
            f"this server verifies Medusa trees (medusa_tree_config), which apply "
            f"temperature, top_k, top_p, seed, logprobs, penalties, min_tokens, "
            f"allowed_token_ids and bad_words only; the request sets "
            f"{', '.join(given)}: send it without them, or serve without medusa_tree_config")
