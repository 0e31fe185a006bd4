"""vLLM's linear-layer hook for ascend-quant's schemes: ``AscendQuantLinearMethod``.

``create_weights`` registers the scheme's checkpoint tensors as vLLM parameters (with
loading checks, see ``params``); ``process_weights_after_loading`` refuses missing
tensors, runs the scheme's ``process`` and replaces the checkpoint parameters by the
runtime ones (registered as ``ascend_<name>``, so resident memory is what the scheme
keeps; ``ascend_nz_weights`` names those the npu runner may cast to FRACTAL_NZ); ``apply``
calls the scheme -- while vLLM's compilation traces the model on the npu
target (PIECEWISE graphs), through ``ascend_quant.traced_ops.linear``, one opaque node.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
    register_weight_loader_v2_supported_method,
)

from ascend_quant import traced_ops
from ascend_quant.schemes.base import Kind, LayerShapes, LinearScheme, ParamSpec, Placement
from ascend_quant.vllm.params import QKV_SHARDS, LoadLedger, make_parameter

RUNTIME_PREFIX = "ascend_"


def checkpoint_output_sizes(layer: torch.nn.Module) -> list[int]:
    """The un-sharded output rows of each checkpoint matrix a layer fuses."""
    if isinstance(layer, QKVParallelLinear):
        return [layer.total_num_heads * layer.head_size,
                layer.total_num_kv_heads * layer.head_size,
                layer.total_num_kv_heads * layer.v_head_size]
    sizes = getattr(layer, "output_sizes", None)
    return list(sizes) if sizes else [layer.output_size]


def shard_index(loaded_shard_id) -> int | None:
    if loaded_shard_id is None:
        return None
    if isinstance(loaded_shard_id, str):
        return QKV_SHARDS[loaded_shard_id]
    return int(loaded_shard_id)


def placement_of(layer: torch.nn.Module) -> Placement:
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
        return Placement(input_is_sharded=True, owns_bias=layer.tp_rank == 0)
    return Placement()


def runtime_weights(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: getattr(layer, RUNTIME_PREFIX + name) for name in layer.ascend_quant_runtime}


def install_runtime(layer: torch.nn.Module, checkpoint_names: Sequence[str],
                    runtime: dict[str, torch.Tensor]) -> None:
    """Drop the checkpoint parameters and register the runtime tensors in their place."""
    for name in checkpoint_names:
        if name in layer._parameters:
            del layer._parameters[name]
    for name, tensor in runtime.items():
        layer.register_parameter(RUNTIME_PREFIX + name,
                                 torch.nn.Parameter(tensor, requires_grad=False))
    layer.ascend_quant_runtime = tuple(runtime)


@register_weight_loader_v2_supported_method
class AscendQuantLinearMethod(LinearMethodBase):
    """Serves one linear layer with an ascend-quant scheme."""

    def __init__(self, scheme: LinearScheme, shard_names: Sequence[str]) -> None:
        self.scheme = scheme
        self.shard_names = list(shard_names)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int, output_size: int,
                       params_dtype: torch.dtype, **extra_weight_attrs) -> None:
        scheme = self.scheme
        vllm_loader = extra_weight_attrs["weight_loader"]
        full_outputs = checkpoint_output_sizes(layer)
        if len(full_outputs) != len(self.shard_names):
            # A fused layer whose checkpoint names the model does not list: use the
            # layer's own shards.
            self.shard_names = [f"{layer.prefix}[{i}]" for i in range(len(full_outputs))]
        specs = {s.name: s for s in scheme.checkpoint_params(sum(output_partition_sizes),
                                                             input_size_per_partition)}
        ledger = LoadLedger(scheme.layer_name or layer.prefix, scheme.name, self.shard_names,
                            specs)
        num_shards = len(output_partition_sizes)
        for spec in specs.values():
            shape = spec.shape
            if spec.kind == Kind.PER_SHARD:
                shape = (num_shards,)
            elif spec.kind == Kind.SHAPE:
                shape = (num_shards, 2)
            loader = self._checked_loader(spec, ledger, vllm_loader, full_outputs, input_size)
            layer.register_parameter(spec.name, make_parameter(spec, shape, loader))
        layer.ascend_quant_ledger = ledger
        layer.ascend_quant_scheme = scheme.name
        layer.ascend_quant_shapes = LayerShapes(list(output_partition_sizes),
                                                input_size_per_partition, self.shard_names)
        layer.ascend_quant_logical_numel = sum(output_partition_sizes) * input_size_per_partition

    def _checked_loader(self, spec: ParamSpec, ledger: LoadLedger, vllm_loader,
                        full_outputs: list[int], full_input: int):
        scheme = self.scheme
        shard_names = self.shard_names

        def loader(param, loaded_weight: torch.Tensor, *args, **kwargs):
            shard_id = args[0] if args else kwargs.get("loaded_shard_id")
            index = shard_index(shard_id)
            shards = range(len(full_outputs)) if index is None else [index]
            rows = sum(full_outputs[i] for i in shards)
            where = ".".join([shard_names[index] if index is not None and
                              len(shard_names) > 1 else ledger.layer, spec.name])
            expected = {s.name: s for s in scheme.checkpoint_params(rows, full_input)}
            ledger.check(spec, where, loaded_weight, expected[spec.name].shape)
            if spec.kind == Kind.PER_SHARD:
                for i in shards:
                    param.data[i] = loaded_weight.reshape(()).to(param.dtype)
            elif spec.kind == Kind.SHAPE:
                stored = tuple(int(v) for v in loaded_weight.reshape(-1).tolist())
                if stored != (rows, full_input):
                    raise ledger.fail(f"{where} says the weight is {stored}, but the layer's "
                                      f"matrix is {(rows, full_input)}")
                for i in shards:
                    param.data[i] = loaded_weight.reshape(-1).to(param.dtype)
            else:
                vllm_loader(param, loaded_weight, *args, **kwargs)
            ledger.record(spec.name, shards)

        return loader

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        ledger: LoadLedger = layer.ascend_quant_ledger
        ledger.refuse_missing(list(enumerate(self.shard_names)))
        loaded = {name: getattr(layer, name).data for name, spec in ledger.specs.items()
                  if name in ledger.arrived}
        runtime = self.scheme.process(loaded, layer.ascend_quant_shapes, placement_of(layer))
        install_runtime(layer, list(ledger.specs), runtime)
        # Cast to FRACTAL_NZ by the npu runner after loading, as weight_nz_mode says.
        layer.ascend_nz_weights = tuple(RUNTIME_PREFIX + name for name in self.scheme.nz_weights
                                        if name in runtime)
        del layer.ascend_quant_ledger
        layer.ascend_quant_traced = traced_ops.register_layer(
            layer.prefix, self.scheme, layer.ascend_quant_runtime,
            layer.ascend_quant_shapes.out_features)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.compiler.is_compiling() and x.device.type == "npu":
            # vLLM's compilation on the npu target: the npu form as one opaque node.
            weights = [getattr(layer, RUNTIME_PREFIX + name) for name in
                       layer.ascend_quant_runtime]
            return traced_ops.linear(x, weights, bias, layer.ascend_quant_traced)
        return self.scheme.apply(runtime_weights(layer), x, bias)
