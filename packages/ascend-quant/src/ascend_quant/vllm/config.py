"""vLLM quantization configs that serve checkpoints with ascend-quant's schemes.

``AscendCompressedTensorsConfig`` takes vLLM's ``compressed-tensors`` method name while
the plugin's platform is active (``config.json``'s ``quantization_config`` selects it, as
for stock vLLM); ``AscendModelSlimConfig`` is the ``ascend`` method for msModelSlim
checkpoints (``quant_model_description.json``). Both pick a scheme per layer: linear
layers (fused shards must agree), routed experts, and refuse quantized embeddings. A
layer the checkpoint leaves unquantized gets vLLM's unquantized method; a quantized
layer gets its scheme or start-up fails with QuantConfigError, never a float fallback.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
    UnquantizedFusedMoEMethod,
)
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

from ascend_quant.errors import QuantConfigError
from ascend_quant.formats.compressed_tensors import CompressedTensorsFormat, SchemeChoice
from ascend_quant.formats.modelslim import (
    DESCRIPTION_FILE,
    FLOAT,
    ModelSlimDescription,
    check_against_checkpoint,
    read_checkpoint_headers,
)
from ascend_quant.lookup import scheme_class
from ascend_quant.schemes.base import COMPRESSED_TENSORS, MODELSLIM
from ascend_quant.vllm.linear import AscendQuantLinearMethod
from ascend_quant.vllm.moe import AscendQuantMoEMethod

ASCEND_METHOD = "ascend"


def expert_projection_names(layer: RoutedExperts) -> dict[str, str]:
    """vLLM shard id -> the checkpoint's projection name (gate_proj / up_proj / down_proj)."""
    names = {"w1": layer.ckpt_gate_proj_name, "w2": layer.ckpt_down_proj_name}
    if layer.ckpt_up_proj_name:
        names["w3"] = layer.ckpt_up_proj_name
    return names


def _renamer(mapper):
    def rename(name: str) -> str | None:
        return mapper._map_name(name)

    return rename


class _AscendQuantConfig(QuantizationConfig):
    layout: ClassVar[str]

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    def shard_names(self, prefix: str) -> list[str]:
        """The checkpoint module names a (possibly fused) vLLM layer is made of."""
        base, _, last = prefix.rpartition(".")
        shards = self.packed_modules_mapping.get(last)
        if not shards:
            return [prefix]
        return [f"{base}.{shard}" if base else shard for shard in shards]

    def resolve_linear(self, prefix: str, shards: list[str],
                       layer: torch.nn.Module) -> SchemeChoice | None:
        raise NotImplementedError

    def resolve_experts(self, prefix: str, layer: RoutedExperts) -> SchemeChoice | None:
        raise NotImplementedError

    def embedding_is_quantized(self, prefix: str, layer: torch.nn.Module) -> bool:
        raise NotImplementedError

    def get_quant_method(self, layer: torch.nn.Module, prefix: str
                         ) -> QuantizeMethodBase | None:
        if isinstance(layer, LinearBase):
            shards = self.shard_names(prefix)
            choice = self.resolve_linear(prefix, shards, layer)
            if choice is None:
                return UnquantizedLinearMethod()
            cls = scheme_class(choice.name, self.layout, prefix)
            return AscendQuantLinearMethod(cls(choice.options, prefix), shards)
        if isinstance(layer, RoutedExperts):
            choice = self.resolve_experts(prefix, layer)
            if choice is None:
                return UnquantizedFusedMoEMethod(layer.moe_config)
            cls = scheme_class(choice.name, self.layout, prefix, moe=True)
            return AscendQuantMoEMethod(cls(choice.options, prefix), layer.moe_config,
                                        expert_projection_names(layer))
        if isinstance(layer, VocabParallelEmbedding):
            if self.embedding_is_quantized(prefix, layer):
                raise QuantConfigError(
                    f"layer {prefix!r}: quantized embeddings / LM heads are not supported by "
                    "the ascend plugin; keep them unquantized (compressed-tensors: add the "
                    "layer to 'ignore'; msModelSlim: FLOAT)")
            return None
        return None


class AscendCompressedTensorsConfig(_AscendQuantConfig):
    """compressed-tensors checkpoints (``quantization_config`` in config.json)."""

    layout = COMPRESSED_TENSORS

    def __init__(self, fmt: CompressedTensorsFormat) -> None:
        super().__init__()
        self.format = fmt

    def __repr__(self) -> str:
        return f"AscendCompressedTensorsConfig(groups={list(self.format.target_to_scheme)})"

    @classmethod
    def get_name(cls) -> str:
        return "compressed-tensors"

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendCompressedTensorsConfig:
        return cls(CompressedTensorsFormat.from_dict(config))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        # vLLM refuses built-in method names that override; the checkpoint's
        # quant_method already names this one.
        return None

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        self.format.rename_targets(_renamer(hf_to_vllm_mapper))

    def resolve_linear(self, prefix, shards, layer):
        return self.format.resolve(prefix, shards, layer)

    def resolve_experts(self, prefix, layer):
        names = expert_projection_names(layer)
        modules = [f"{prefix}.{expert}.{names[shard]}"
                   for expert in range(layer.moe_config.num_logical_experts)
                   for shard in sorted(names)]
        return self.format.resolve(prefix, modules, torch.nn.Linear(1, 1, device="meta"))

    def embedding_is_quantized(self, prefix, layer):
        return self.format.scheme_for(prefix, layer) is not None


class AscendModelSlimConfig(_AscendQuantConfig):
    """msModelSlim checkpoints (``quant_model_description.json``), vLLM method ``ascend``."""

    layout = MODELSLIM

    def __init__(self, description: ModelSlimDescription | None = None) -> None:
        super().__init__()
        self.description = description

    def __repr__(self) -> str:
        source = self.description.source if self.description else "not loaded"
        return f"AscendModelSlimConfig({source})"

    @classmethod
    def get_name(cls) -> str:
        return ASCEND_METHOD

    @classmethod
    def get_config_filenames(cls) -> list[str]:
        # Empty: vLLM's own file lookup would fail with "Cannot find the config file";
        # maybe_update_config reads the description with an error that says what to do.
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AscendModelSlimConfig:
        has_tensors = any("." in key for key in config)
        return cls(ModelSlimDescription(config) if has_tensors else None)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None):
        method = (hf_quant_cfg or {}).get("quant_method", "")
        if method == ASCEND_METHOD or (method == "" and user_quant in (None, ASCEND_METHOD)):
            return ASCEND_METHOD
        return None

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        if not os.path.isdir(model_name):
            if self.description is None:
                raise QuantConfigError(
                    f"quantization='ascend' reads {DESCRIPTION_FILE} from a local model "
                    f"folder; {model_name!r} is not one (download it first)")
            return
        if self.description is None:
            path = os.path.join(model_name, DESCRIPTION_FILE)
            if not os.path.isfile(path):
                found = sorted(f for f in os.listdir(model_name) if f.endswith(".json"))
                raise QuantConfigError(
                    f"quantization='ascend' (msModelSlim) needs {DESCRIPTION_FILE} in "
                    f"{model_name}, which holds only {found}. Quantize the model with "
                    "msModelSlim first, or serve it without quantization='ascend'.")
            self.description = ModelSlimDescription.from_file(path)
        check_against_checkpoint(self.description, read_checkpoint_headers(model_name))

    def _description(self) -> ModelSlimDescription:
        if self.description is None:
            raise QuantConfigError(f"no {DESCRIPTION_FILE} was loaded for quantization="
                                   "'ascend'")
        return self.description

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.description is not None:
            self.description.rename(_renamer(hf_to_vllm_mapper))

    def resolve_linear(self, prefix, shards, layer):
        return self._description().resolve(prefix, shards)

    def resolve_experts(self, prefix, layer):
        return self._description().resolve_experts(prefix)

    def embedding_is_quantized(self, prefix, layer):
        entry = self._description().entries.get(f"{prefix}.weight")
        return entry not in (None, FLOAT)
