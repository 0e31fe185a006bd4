"""The npu target's model runner: vLLM's GPU model runner with its device glue on torch.npu.

vLLM's ``GPUModelRunner`` does the scheduling bookkeeping, input preparation, sampling and
speculative decoding for any device; what ties it to CUDA is a handful of names: streams and
events (``torch.cuda.Stream``, ``torch.cuda.Event``, ``torch.Event``,
``torch.cuda.current_stream``, ``torch.cuda.stream``) and device-wide calls through
``torch.accelerator`` (synchronise, empty the cache, memory info). ``npu_device_names``
points those names at torch_npu's documented ``torch.npu`` equivalents while the runner
works, the way vLLM's own ``CPUModelRunner`` swaps them for placeholders. Everything else
-- pinned host buffers, KV-cache allocation in the layout the attention backend declares,
the dummy and profiling runs -- is vLLM's own code running on the ``npu`` device.

Graph capture: the runner plans the decode batch sizes to capture
(``plan_decode_capture_sizes``, from ``max_num_seqs`` and the speculative tokens) and checks
them against the KV cache once it is allocated (``check_capture_sizes_fit_cache``). When the
platform has turned on FULL decode graphs (``CUDAGraphMode.FULL_DECODE_ONLY``, see
``ascend_core.platform.npu``), capture and replay are vLLM's own machinery -- its
``CudagraphDispatcher`` picks the padded decode size, ``CUDAGraphWrapper`` around the model
captures one graph per size and replays it -- with ``torch.cuda.CUDAGraph`` /
``torch.cuda.graph`` pointed at ``torch.npu.NPUGraph`` / ``torch.npu.graph`` by
``npu_device_names``, and vLLM's ``graph_capture`` (CUDA/XPU communicators only) pointed at
``npu_graph_capture`` (HCCL collectives are captured as steps, so tensor parallel works).
For FULL decode graphs the model stays eager; for PIECEWISE / FULL_AND_PIECEWISE the
platform turns on vLLM's compilation with the eager backend (no Inductor for NPUs): Dynamo's
graph split at the attention ops, each piece wrapped by ``CUDAGraphWrapper`` and captured the
same way. What a captured step needs from the rest of the runner: KV slots that are valid
for padding tokens too (``_get_slot_mappings``) and, for the fused attention ops captured in
graph task groups, an update of their host sequence lengths before each replay: the runner's
graph class comes from ``npu_graph_tasks.graph_cls_with_task_updates``, which does it from
the step's attention metadata in vLLM's forward context. ``graph_replays``
counts replays in this process, ``graph_counts`` wrappers, graphs, replays and task groups
per mode.

The speculative proposer and rejection sampler come from core's registries through the same
hooks the host runner uses (``ascend_core.worker.speculative``); quantization and EPLB run
through vLLM's model loading and ``EplbState``, which this runner inherits unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import vllm.compilation.cuda_graph as cuda_graph_module
import vllm.v1.worker.gpu_model_runner as gpu_model_runner_module
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ascend_core.attention import ASCEND_ATTN_NAME
from ascend_core.attention.npu_graph_tasks import graph_cls_with_task_updates, task_counts
from ascend_core.distributed.npu_communicator import npu_graph_capture
from ascend_core.lora.checks import CheckedLoRARunnerMixin
from ascend_core.worker.speculative import (
    install_registered_proposer,
    install_registered_rejection_sampler,
    vllm_proposer_deferred,
)
from ascend_core.worker.tree_runner import TreeVerificationRunnerMixin
from ascend_core.worker.weight_format import cast_weights_to_nz, nz_mode
from ascend_kernels.dispatch import torch_npu_module

logger = logging.getLogger(__name__)

# Request counts of the decode batches planned for graph capture: 1, 2, 4, then steps of 8
# up to 256, then steps of 16 -- the grid vLLM uses for CUDA graphs, in requests.
_SMALL_REQUEST_COUNTS = (1, 2, 4)
_MEDIUM_STEP, _MEDIUM_LIMIT, _LARGE_STEP = 8, 256, 16


def _strong_refs(tensors: Any) -> Any:
    """Stand-in for vLLM's ``weak_ref_tensors`` (a vllm._C op, built for CUDA and the CPU
    only): a captured graph's outputs are kept as they are. The graph keeps the tensors it
    captured alive anyway (its pool), so nothing more is held."""
    return tensors


def _npu_name_map() -> dict[tuple[Any, str], Any]:
    """(owner, attribute) -> the torch.npu object that stands in for it."""
    npu = torch.npu
    return {
        (cuda_graph_module, "weak_ref_tensors"): _strong_refs,
        # vLLM's graph_capture() takes CUDA/XPU communicators only.
        (gpu_model_runner_module, "graph_capture"): npu_graph_capture,
        (torch.cuda, "Stream"): npu.Stream,
        (torch.cuda, "Event"): npu.Event,
        (torch.cuda, "current_stream"): npu.current_stream,
        (torch.cuda, "stream"): npu.stream,
        (torch.cuda, "CUDAGraph"): _counting_npu_graph_cls(),
        (torch.cuda, "graph"): npu.graph,
        (torch, "Event"): _NPUEvent,
        (torch.accelerator, "synchronize"): npu.synchronize,
        (torch.accelerator, "empty_cache"): npu.empty_cache,
        (torch.accelerator, "get_memory_info"): npu.mem_get_info,
        (torch.accelerator, "memory_allocated"): npu.memory_allocated,
        (torch.accelerator, "memory_reserved"): npu.memory_reserved,
        (torch.accelerator, "max_memory_allocated"): npu.max_memory_allocated,
        (torch.accelerator, "reset_peak_memory_stats"): npu.reset_peak_memory_stats,
        (torch.accelerator, "device_count"): npu.device_count,
    }


_graph_replays = [0]


@functools.cache
def _counting_npu_graph_cls() -> type:
    """``torch.npu.NPUGraph`` that counts its replays (``NPUModelRunner.graph_replays``) and
    updates the fused-attention task groups captured in it before each replay
    (``npu_graph_tasks``); made on first use, since ``torch.npu`` exists only once torch_npu
    is imported."""

    class CountingNPUGraph(graph_cls_with_task_updates()):
        replays = 0

        def replay(self) -> None:
            super().replay()
            self.replays += 1
            _graph_replays[0] += 1

    return CountingNPUGraph


class _NPUEvent:
    """``torch.Event`` (device-generic) answered by ``torch.npu.Event``.

    A class, not a function: code that torch.compile traces while the runner works (vLLM's
    logprobs counting, for one) makes dynamo check ``isinstance(value, torch.Event)``, which
    needs a type there.
    """

    def __new__(cls, device: Any = None, *, enable_timing: bool = False,
                blocking: bool = False, interprocess: bool = False) -> Any:
        if device is not None and torch.device(device).type != "npu":
            raise ValueError(f"torch.Event on {device!r} inside the npu model runner; the "
                             "runner's events are NPU events.")
        return torch.npu.Event(enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)


@contextlib.contextmanager
def npu_device_names() -> Iterator[None]:
    """Point the CUDA stream/event names and ``torch.accelerator``'s device calls that
    vLLM's GPU runner uses at ``torch.npu`` for the duration (re-entrant)."""
    replacements = _npu_name_map()
    saved = {key: getattr(*key) for key in replacements}
    for (owner, name), value in replacements.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in saved.items():
            setattr(owner, name, value)


def _on_npu(method: Callable) -> Callable:
    """Run a GPUModelRunner entry point with ``npu_device_names`` in force."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with npu_device_names():
            return method(self, *args, **kwargs)

    return wrapper


# --- graph capture sizes ---------------------------------------------------------------------


def plan_decode_capture_sizes(
    max_num_seqs: int, num_speculative_tokens: int, max_num_batched_tokens: int
) -> list[int]:
    """Token counts of the decode batches to capture as graphs, ascending.

    A decode step carries ``1 + num_speculative_tokens`` tokens per request (the verified
    token and the drafts), so sizes are request counts -- 1, 2, 4, 8, 16, ... up to
    ``max_num_seqs``, which is always included -- times that query length, dropping those
    above ``max_num_batched_tokens`` (such a batch is never scheduled).
    """
    for name, value, least in (("max_num_seqs", max_num_seqs, 1),
                               ("num_speculative_tokens", num_speculative_tokens, 0),
                               ("max_num_batched_tokens", max_num_batched_tokens, 1)):
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r}: expected an integer >= {least}.")
    query_len = 1 + num_speculative_tokens
    counts = {n for n in _SMALL_REQUEST_COUNTS if n <= max_num_seqs}
    counts.update(range(_MEDIUM_STEP, min(max_num_seqs, _MEDIUM_LIMIT - 1) + 1, _MEDIUM_STEP))
    counts.update(range(_MEDIUM_LIMIT, max_num_seqs + 1, _LARGE_STEP))
    counts.add(max_num_seqs)
    return sorted(n * query_len for n in counts if n * query_len <= max_num_batched_tokens)


def blocks_for_capture_size(size: int, query_len: int, block_size: int) -> int:
    """KV-cache blocks a captured decode batch of ``size`` tokens holds at the least: each of
    its ``size / query_len`` requests has its own blocks, enough for its query tokens."""
    requests = math.ceil(size / query_len)
    return requests * math.ceil(query_len / block_size)


def check_capture_sizes_fit_cache(
    sizes: list[int], query_len: int, num_blocks: int, block_size: int
) -> None:
    """Raise ``ValueError`` for the first capture size the KV cache cannot hold.

    Block 0 of vLLM's cache is its null block, so ``num_blocks - 1`` blocks hold requests.
    """
    usable = num_blocks - 1
    blocks_per_request = math.ceil(query_len / block_size)
    for size in sorted(sizes):
        needed = blocks_for_capture_size(size, query_len, block_size)
        if needed > usable:
            raise ValueError(
                f"Graph capture size {size} ({math.ceil(size / query_len)} requests of "
                f"{query_len} tokens) needs at least {needed} KV-cache blocks of "
                f"{block_size} tokens, but the cache has {usable} usable blocks "
                f"({num_blocks} minus vLLM's null block). Lower max_num_seqs to at most "
                f"{usable // blocks_per_request}, give the KV cache more memory "
                "(gpu_memory_utilization or kv_cache_memory_bytes), or pass enforce_eager=True."
            )


# --- the runner ------------------------------------------------------------------------------


class NPUModelRunner(TreeVerificationRunnerMixin, CheckedLoRARunnerMixin, GPUModelRunner):
    # Medusa trees: the fused attention op applies the tree mask (npu_attention's
    # tree_attention_mask), so node rows need no recomputing.
    tree_attention_recomputes = False

    def __init__(self, vllm_config, device: torch.device):
        if device.type != "npu":
            raise ValueError(f"NPUModelRunner runs on an npu device, got {device}.")
        self._dummy_run_depth = 0
        with npu_device_names(), vllm_proposer_deferred(vllm_config):
            super().__init__(vllm_config, device)
        self.proposer_source = install_registered_proposer(self)
        self.rejection_sampler_source = install_registered_rejection_sampler(self)
        self.decode_query_len = 1 + (self.num_spec_tokens or 0)
        self.graph_capture_sizes = self._plan_graph_capture_sizes()

    @property
    def full_decode_graphs(self) -> bool:
        """Whether decode batches run as captured FULL graphs (the platform's choice)."""
        mode = self.compilation_config.cudagraph_mode
        return mode is not None and mode.has_full_cudagraphs()

    @property
    def graph_replays(self) -> int:
        """NPU graph replays in this process so far."""
        return _graph_replays[0]

    @property
    def graph_counts(self) -> dict[str, dict[str, int]]:
        """Per runtime mode (``FULL``, ``PIECEWISE``) of vLLM's graph wrappers in this
        process: how many wrappers (one around the model for FULL, one per piece between
        attention ops for PIECEWISE), graphs captured and replays of those graphs, fused
        attention task groups captured in those graphs (one per attention layer in a FULL
        graph) and the task-group updates issued before their replays."""
        counts: dict[str, dict[str, int]] = {}
        for wrapper in list(cuda_graph_module.CUDAGraphWrapper._all_instances):
            mode = counts.setdefault(wrapper.runtime_mode.name,
                                     {"wrappers": 0, "graphs": 0, "replays": 0,
                                      "task_groups": 0, "task_updates": 0})
            mode["wrappers"] += 1
            for entry in wrapper.concrete_cudagraph_entries.values():
                if entry.cudagraph is not None:
                    mode["graphs"] += 1
                    mode["replays"] += getattr(entry.cudagraph, "replays", 0)
                    groups, updates = task_counts(entry.cudagraph)
                    mode["task_groups"] += groups
                    mode["task_updates"] += updates
        return counts

    def _plan_graph_capture_sizes(self) -> list[int]:
        """The decode sizes graph mode will capture; empty when the model runs eagerly."""
        if self.model_config.enforce_eager:
            return []
        return plan_decode_capture_sizes(
            self.scheduler_config.max_num_seqs,
            self.decode_query_len - 1,
            self.scheduler_config.max_num_batched_tokens,
        )

    # vLLM's device synchronisation, for the steps that wait on the device.
    def _sync_device(self) -> None:
        torch.npu.synchronize(self.device)

    def check_tree_layer(self, name: str, impl: Any) -> None:
        from ascend_core.attention.npu_attention import AscendAttentionImpl

        if not isinstance(impl, AscendAttentionImpl):
            raise ValueError(f"Medusa tree verification (medusa_tree_config) on npu serves "
                             f"the {ASCEND_ATTN_NAME} backend's layers; layer {name} runs "
                             f"{type(impl).__name__}: remove medusa_tree_config")

    @_on_npu
    def load_model(self, *args, **kwargs):
        result = super().load_model(*args, **kwargs)
        # weight_nz_mode / VLLM_ASCEND_ENABLE_NZ, before anything is compiled or captured.
        self.nz_weights = cast_weights_to_nz(self.get_model(), nz_mode(), torch_npu_module())
        return result

    @_on_npu
    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs):
        result = super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        from ascend_core.worker.triton_fallbacks import register_kv_allocation

        for cache in self.kv_caches:
            for tensor in cache if isinstance(cache, (list, tuple)) else (cache,):
                register_kv_allocation(tensor)
        if self.graph_capture_sizes and not kwargs.get("is_profiling", False):
            check_capture_sizes_fit_cache(
                self.graph_capture_sizes,
                self.decode_query_len,
                kv_cache_config.num_blocks,
                self.cache_config.block_size,
            )
        return result

    def _init_kv_zero_meta(self) -> None:
        """The attention layers' caches, viewed by vLLM's blocks, whose newly allocated
        blocks vLLM zeroes each step where other states share the pages (hybrid models).
        vLLM does that with a Triton kernel over raw device addresses; here it is an
        index_fill_ per layer, as for vLLM, mamba-state layers are left alone."""
        from vllm.v1.kv_cache_interface import AttentionSpec

        context = self.compilation_config.static_forward_context
        self._zero_views = [
            context[name].kv_cache
            for group in self._kv_cache_spec_attn_group_iterator()
            if isinstance(group.kv_cache_spec, AttentionSpec)
            for name in group.layer_names
            if name not in self.runner_only_attn_layers
            and isinstance(context[name].kv_cache, torch.Tensor)
        ]

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        views = getattr(self, "_zero_views", None)
        if not block_ids or not views:
            return
        blocks = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
        for view in views:
            view.index_fill_(0, blocks, 0)

    @_on_npu
    def execute_model(self, *args, **kwargs):
        return super().execute_model(*args, **kwargs)

    @_on_npu
    def sample_tokens(self, *args, **kwargs):
        return super().sample_tokens(*args, **kwargs)

    @_on_npu
    def take_draft_token_ids(self, *args, **kwargs):
        return super().take_draft_token_ids(*args, **kwargs)

    @_on_npu
    def profile_run(self, *args, **kwargs):
        return super().profile_run(*args, **kwargs)

    @_on_npu
    def _dummy_run(self, *args, **kwargs):
        self._dummy_run_depth += 1
        try:
            return super()._dummy_run(*args, **kwargs)
        finally:
            self._dummy_run_depth -= 1

    def _get_slot_mappings(self, num_tokens_padded, num_reqs_padded, num_tokens_unpadded,
                           ubatch_slices=None):
        """vLLM pads slot mappings with -1 (padding tokens, and every token of a dummy run)
        for CUDA kernels that skip negative slots; ``npu_scatter_pa_kv_cache`` takes only
        valid slots. The attention layers therefore get the real tokens' slots, and none in
        a dummy run (which then writes no KV, as vLLM intends with its -1s)."""
        by_group, by_layer = super()._get_slot_mappings(
            num_tokens_padded, num_reqs_padded, num_tokens_unpadded, ubatch_slices
        )
        sizes = self.compilation_config.cudagraph_capture_sizes or []
        if isinstance(by_layer, dict) and self.full_decode_graphs and (
                num_tokens_padded <= max(sizes, default=0)):
            # A captured graph writes the KV of every padded token through the slot tensor
            # it saw at capture: up to the largest captured size (at most one KV block of
            # tokens), the attention layers get vLLM's whole padded view of its slot
            # buffer and send its -1s (padding, dummy runs) to the null block
            # (AscendAttentionImpl.do_kv_cache_update).
            pass
        elif isinstance(by_layer, dict):
            if self._dummy_run_depth:
                by_layer = {}
            else:
                by_layer = {name: slots[:num_tokens_unpadded] for name, slots in by_layer.items()}
        return by_group, by_layer

    @_on_npu
    def _dummy_sampler_run(self, *args, **kwargs):
        return super()._dummy_sampler_run(*args, **kwargs)

    @_on_npu
    def shutdown(self, *args, **kwargs):
        return super().shutdown(*args, **kwargs)

    @_on_npu
    def capture_model(self) -> int:
        """Capture the graphs the platform chose (vLLM's loop, on NPU graphs): FULL decode
        graphs and/or PIECEWISE graphs of the compiled model's pieces; eager otherwise."""
        mode = self.compilation_config.cudagraph_mode
        if mode is None or mode == mode.NONE:
            logger.info("npu target: no graph capture (cudagraph_mode %s); every batch runs "
                        "eagerly.", mode)
            return 0
        logger.info("npu target: capturing %s graphs (NPUGraph) for %s tokens.", mode.name,
                    self.compilation_config.cudagraph_capture_sizes)
        return super().capture_model()
