"""EAGLE, EAGLE-3 and MTP: the registry factory and the draft checks. Imports no vLLM.

The three methods share vLLM's drafting loop (a draft model fed the target's hidden states),
so one proposer class serves them; the factory imports it when a model runner asks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EAGLE_METHODS = ("eagle", "eagle3", "mtp")


class DraftConfigError(ValueError):
    """A draft model that cannot run on this target."""


def check_draft_against_target(*, method: str, draft_reads_hidden_size: int,
                               target_hidden_size: int, where: str) -> None:
    """The draft must read hidden states of the target's width (its ``fc`` / ``eh_proj``)."""
    if draft_reads_hidden_size != target_hidden_size:
        key = "target_hidden_size" if method == "eagle3" else "hidden_size"
        raise DraftConfigError(
            f"speculative method {method!r}: the draft model {where} reads target hidden "
            f"states of size {draft_reads_hidden_size} ({key} in its config.json), but the "
            f"target model's hidden size is {target_hidden_size}. Use a draft trained for "
            "this target model."
        )


def _weight_shapes(folder: Path) -> dict[str, list[int]]:
    """Tensor name -> shape over the folder's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                shapes[name] = list(handle.get_slice(name).get_shape())
    return shapes


def check_draft_weights(*, method: str, draft_folder: str | Path,
                        target_hidden_size: int) -> None:
    """The draft checkpoint must be an EAGLE draft of the kind ``method`` runs.

    EAGLE and EAGLE-3 drafts usually declare a plain architecture (``LlamaForCausalLM``), so
    their weights tell them apart: an EAGLE draft's ``fc`` reads [embedding, hidden state]
    (``2 * hidden``), an EAGLE-3 draft's reads three target hidden states and comes with a
    ``d2t`` token map. A checkpoint with no ``fc`` is not an EAGLE draft at all (a full model
    of some architecture). Without this check vLLM fails later, while loading weights, with
    an error that names neither the method nor the draft. Drafts that are not local
    safetensors folders (hub names) are left to vLLM.
    """
    folder = Path(draft_folder)
    if method not in ("eagle", "eagle3") or not folder.is_dir():
        return
    shapes = _weight_shapes(folder)
    if not shapes:
        return
    fc = next((shape for name, shape in shapes.items()
               if name.split(".")[-2:] == ["fc", "weight"]), None)
    if fc is None:
        raise DraftConfigError(
            f"speculative method {method!r}: {folder} is not an EAGLE draft (its weights have "
            "no fc.weight, which EAGLE drafts use to read the target's hidden states); it "
            "looks like a full model. Pass a draft trained for this target with "
            f"method {method!r}."
        )
    eagle3_like = "d2t" in shapes or fc[-1] == 3 * target_hidden_size
    if method == "eagle" and eagle3_like:
        token_map = ", with a d2t token map" if "d2t" in shapes else ""
        raise DraftConfigError(
            f"speculative method 'eagle': {folder} is an EAGLE-3 draft (fc.weight {fc} reads "
            f"three hidden states of {target_hidden_size}{token_map}); serve it with method "
            "'eagle3'."
        )
    if method == "eagle3" and not eagle3_like:
        raise DraftConfigError(
            f"speculative method 'eagle3': {folder} is an EAGLE (1) draft (fc.weight {fc} reads "
            "an embedding and one hidden state, not three hidden states); serve it with "
            "method 'eagle'."
        )


def eagle_proposer_factory(vllm_config: Any, device: Any, runner: Any) -> Any:
    """What ascend-core's model runners call for "eagle", "eagle3" and "mtp"."""
    from ascend_specdec.vllm.eagle_proposer import AscendEagleProposer

    return AscendEagleProposer(vllm_config, device, runner)
