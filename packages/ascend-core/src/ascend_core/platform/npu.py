"""The npu target: vLLM's out-of-tree platform for Ascend NPUs, through torch_npu.

Importing this module imports torch_npu, which registers the ``npu`` device and
``torch.npu``; without torch_npu (or without the CANN libraries it loads) the import fails
with a ``RuntimeError`` that says what to install, and that ``VLLM_ASCEND_TARGET=host`` runs
the plugin on the CPU instead. ``ascend_core.platform.detect.npu_is_visible`` asks the same
question without raising, for ``VLLM_ASCEND_TARGET=auto``.

Device calls go through torch_npu's documented ``torch.npu`` API, so the tests run this
module against the reference torch_npu (``testing/reference_torch_npu``).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, ClassVar

import torch
from vllm.platforms.interface import Platform, PlatformEnum

from ascend_core import envs
from ascend_core.config import init_ascend_config
from ascend_core.platform.common import AscendPlatformMixin
from ascend_core.worker.weight_format import nz_mode

try:
    import torch_npu  # noqa: F401 - registers the npu device and torch.npu
except Exception as error:  # CANN missing surfaces as ImportError, OSError or RuntimeError
    raise RuntimeError(
        f"The Ascend npu target could not import torch_npu ({type(error).__name__}: {error}). "
        "It needs `pip install ascend-plugin[npu]` (torch-npu matching your torch) and the "
        "CANN toolkit, with CANN's set_env.sh sourced so that its libraries (libhccl.so, ...) "
        "load. To run the plugin on this machine's CPU instead, set VLLM_ASCEND_TARGET=host."
    ) from error

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

logger = logging.getLogger(__name__)

NPU_WORKER = "ascend_core.worker.npu_worker.NPUWorker"
NPU_COMMUNICATOR = "ascend_core.distributed.npu_communicator.NPUCommunicator"

# The block size Ascend's paged-attention kernels are tuned for.
DEFAULT_BLOCK_SIZE = 128

# Expandable segments let the NPU caching allocator grow a segment instead of keeping
# fragments of fixed-size ones, which matters for a KV cache sized to most of the HBM.
ALLOC_CONF_VAR = "PYTORCH_NPU_ALLOC_CONF"
DEFAULT_ALLOC_CONF = "expandable_segments:True"
V2_MODEL_RUNNER_VAR = "VLLM_USE_V2_MODEL_RUNNER"

# aclnn kernels on Atlas 300I (Ascend 310P) take float16 and float32 only.
_NO_BFLOAT16_CHIPS = ("310P",)


class AscendPlatform(AscendPlatformMixin, Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "npu"
    device_type: str = "npu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "NPU"
    dist_backend: str = "hccl"
    device_control_env_var: str = "ASCEND_RT_VISIBLE_DEVICES"
    ray_noset_device_env_vars: ClassVar[list[str]] = [
        "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"
    ]
    # torch.compile's Inductor has no NPU backend.
    simple_compile_backend: str = "eager"

    ascend_target = "npu"

    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's compiled kernels (vllm._C) are built for CUDA or the CPU; the npu target's
        # ops come from ascend-kernels through the custom-op replacements.
        return

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # With triton-ascend, vLLM's own Triton kernels run on the NPU. Without a Triton
        # backend the model runner's kernels need torch versions.
        from vllm.triton_utils import HAS_TRITON

        if HAS_TRITON:
            return
        from vllm.triton_utils.dispatcher import register_kernels

        from ascend_core.worker.triton_fallbacks import TRITON_FALLBACKS

        register_kernels(TRITON_FALLBACKS)

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # Two layers of one index (Qwen3-Next's MTP layer "mtp.layers.0" beside the model's
        # layer 0): NPUModelRunner reads its list of KV caches only to register each
        # allocation (triton_fallbacks), in any order; layers find their caches by name.
        return None

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        # vLLM's hybrid KV-cache manager: attention pages and gated delta-net states share
        # the block pool (the attention backend reads the block-compact layout it needs).
        return True

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        # NPUGraph capture of whole decode steps and of the pieces between attention ops;
        # check_and_update_config decides which a given configuration gets.
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        # vLLM's own wrapper; the runner points torch.cuda.CUDAGraph / torch.cuda.graph at
        # torch.npu.NPUGraph / torch.npu.graph while it works (npu_device_names).
        return "vllm.compilation.cuda_graph.CUDAGraphWrapper"

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # Attention (and its KV-cache write) as vLLM's opaque custom ops: Dynamo does not
        # trace into the backend, and PIECEWISE graphs split the model there.
        return True

    @classmethod
    def use_custom_op_collectives(cls) -> bool:
        # vLLM's collectives as its torch.ops.vllm.* custom ops: Dynamo keeps them opaque, so
        # PIECEWISE graphs trace (and capture) models with tensor parallelism.
        return True

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.npu.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.npu.get_device_properties(device_id).total_memory

    def is_sleep_mode_available(self) -> bool:
        # The npu worker releases and restores the weights and the KV cache itself
        # (ascend_core.worker.npu_sleep), without CUDA's cumem pool.
        return True

    @classmethod
    def inference_mode(cls):
        return torch.inference_mode(mode=True)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.npu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.npu.manual_seed_all(seed)

    @classmethod
    def empty_cache(cls) -> None:
        torch.npu.empty_cache()

    @classmethod
    def synchronize(cls) -> None:
        torch.npu.synchronize()

    @classmethod
    def mem_get_info(cls, device: torch.types.Device | None = None) -> tuple[int, int]:
        """``(free, total)`` bytes of the NPU (the current one when ``device`` is None)."""
        return torch.npu.mem_get_info(device)

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        # As on CUDA: bytes held by tensors now, after dropping what the allocator caches.
        torch.npu.empty_cache()
        torch.npu.reset_peak_memory_stats(device)
        return torch.npu.max_memory_allocated(device)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        name = cls.get_device_name()
        if dtype == torch.bfloat16 and any(chip in name for chip in _NO_BFLOAT16_CHIPS):
            raise ValueError(
                f"{name} does not support bfloat16; pass --dtype float16 (or float32)."
            )
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(
                f"The npu target runs models in bfloat16, float16 or float32, not {dtype}."
            )

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return NPU_COMMUNICATOR

    @classmethod
    def get_mla_prefill_backend_cls(cls, mla_selector_config):
        """MLA prefills run in the Ascend MLA backend itself (dense MHA through
        ``npu_fused_infer_attention_score``'s TND form, ``AscendMLAImpl.forward_mha``);
        vLLM's selector still asks for a prefill backend, which refuses if it is ever
        called."""
        from ascend_core.attention.npu_mla import NPUMLAPrefillBackend

        return NPUMLAPrefillBackend

    @classmethod
    def get_attn_backend_cls(
        cls,
        selected_backend: AttentionBackendEnum,
        attn_selector_config: AttentionSelectorConfig,
        num_heads: int | None = None,
    ) -> str:
        from ascend_core.attention import (
            ASCEND_ATTN_BACKEND,
            configuration_problems,
            register_attention_backends,
        )
        from ascend_core.attention.npu_attention import AscendAttentionBackend

        config = attn_selector_config
        if config.use_mla:
            from ascend_core.attention import ASCEND_MLA_BACKEND
            from ascend_core.attention.npu_mla import select_mla_backend

            register_attention_backends()
            return select_mla_backend(selected_backend, config, ASCEND_MLA_BACKEND)
        ours = AscendAttentionBackend.get_name()
        if selected_backend is not None and selected_backend.name != ours:
            logger.info("npu target: attention backend %s is not available; using %s.",
                        selected_backend.name, ours)
        reasons = configuration_problems(AscendAttentionBackend, config)
        if reasons:
            raise ValueError(
                f"The Ascend attention backend cannot run this model's attention ({config}): "
                f"{'; '.join(reasons)}. It takes float16/bfloat16 decoder attention with head "
                "sizes 16 to 512 in steps of 16 and block sizes that are multiples of 128."
            )
        register_attention_backends()
        return ASCEND_ATTN_BACKEND

    @classmethod
    def update_block_size_for_backend(cls, vllm_config: VllmConfig) -> None:
        """vLLM picks the block size the attention backends prefer after the model loads
        (e.g. 16 for the MLA backend, where check_and_update_config saw 128); the graph
        capture sizes, capped at one block of tokens, follow it."""
        super().update_block_size_for_backend(vllm_config)
        # Kept when vLLM runs the config's checks again (check_and_update_config).
        vllm_config.cache_config._ascend_backend_block_size = vllm_config.cache_config.block_size
        _cap_capture_sizes_at_one_block(vllm_config)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        import vllm

        cls.log_activation(vllm.__version__)
        cls.run_config_hooks(vllm_config)
        init_ascend_config(vllm_config.additional_config, target="npu")
        cls.refuse_hybrid_speculation_with_prefix_caching(vllm_config)
        envs.warn_removed()
        nz_mode()  # a bad VLLM_ASCEND_ENABLE_NZ stops the start here, not in each worker

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = NPU_WORKER
        cls.use_ascend_ray_executor(parallel_config)
        # NPUModelRunner subclasses vLLM's V1 runner; the engine's scheduler must agree
        # (VllmConfig.use_v2_model_runner reads this variable).
        os.environ.setdefault(V2_MODEL_RUNNER_VAR, "0")

        cache_config = vllm_config.cache_config
        backend_block_size = getattr(cache_config, "_ascend_backend_block_size", None)
        if backend_block_size is not None:
            # The attention backends' choice (update_block_size_for_backend), made after the
            # model loaded: vLLM re-runs these checks on the same config once the engine is up.
            cache_config.block_size = backend_block_size
        elif cache_config.block_size is None or not getattr(
            cache_config, "user_specified_block_size", False
        ):
            cache_config.block_size = DEFAULT_BLOCK_SIZE

        _configure_graphs(vllm_config)

        if ALLOC_CONF_VAR not in os.environ:
            os.environ[ALLOC_CONF_VAR] = DEFAULT_ALLOC_CONF

        from ascend_core.ops.vllm_custom_ops import enable_in_compilation_config, register

        register()
        enable_in_compilation_config(vllm_config.compilation_config)


def _configure_graphs(vllm_config: VllmConfig) -> None:
    """Graph mode from the user's ``cudagraph_mode`` (``enforce_eager`` off), on NPUGraph
    through vLLM's ``CUDAGraphWrapper``:

    - FULL / FULL_DECODE_ONLY: FULL graphs of uniform decode batches
      (``FULL_DECODE_ONLY``), the model eager (no torch.compile); other batches eager;
    - PIECEWISE / FULL_AND_PIECEWISE: vLLM's compilation (``VLLM_COMPILE``) with the
      ``eager`` backend -- Dynamo's FX graph split at the attention ops, each piece run as
      traced (there is no Inductor backend for NPUs) and captured per size as a PIECEWISE
      graph; attention runs eagerly between the pieces. FULL_AND_PIECEWISE adds FULL
      graphs for uniform decode batches. With tensor parallelism the collectives are
      vLLM's opaque custom ops (``use_custom_op_collectives``), captured inside the pieces;
    - anything else, or ``enforce_eager``: every batch eager.

    FULL graphs take any tensor parallel size: the HCCL collectives are captured as graph
    steps (the runner's ``npu_graph_capture`` stands in for vLLM's ``graph_capture``).

    Capture sizes are ``plan_decode_capture_sizes`` (requests times 1 + speculative
    tokens) up to one KV block of tokens.
    """
    from vllm.config import CompilationMode, CUDAGraphMode

    from ascend_core.worker.npu_model_runner import plan_decode_capture_sizes

    compilation_config = vllm_config.compilation_config
    asked = compilation_config.cudagraph_mode
    model_config = vllm_config.model_config
    enforce_eager = model_config is None or model_config.enforce_eager
    wants_full = asked in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY)
    wants_piecewise = asked in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)
    if (wants_full or wants_piecewise) and not enforce_eager:
        speculative = vllm_config.speculative_config
        spec_tokens = (speculative.num_speculative_tokens or 0) if speculative else 0
        scheduler = vllm_config.scheduler_config
        # Padding tokens of a captured batch write their KV into vLLM's null block, one
        # slot each (AscendAttentionImpl.do_kv_cache_update): at most one block of tokens.
        block_size = vllm_config.cache_config.block_size
        planned = plan_decode_capture_sizes(scheduler.max_num_seqs, spec_tokens,
                                            scheduler.max_num_batched_tokens)
        sizes = [size for size in planned if size <= block_size]
        if len(sizes) < len(planned):
            logger.info("npu target: batches above %d tokens (one KV block) run eagerly; "
                        "not captured: %s.", block_size, planned[len(sizes):])
        compilation_config.cudagraph_capture_sizes = sizes
        compilation_config.max_cudagraph_capture_size = max(sizes)
        if wants_piecewise:
            compilation_config.mode = CompilationMode.VLLM_COMPILE
            compilation_config.backend = "eager"
            compilation_config.ir_enable_torch_wrap = False
            # vLLM's fusion passes rewrite the graph for CUDA/ROCm kernels (and are built
            # from CUDA-only modules); the eager backend runs the graph as traced.
            pass_config = compilation_config.pass_config
            for name, value in vars(pass_config).items():
                if name.startswith(("fuse_", "enable_")) and value is not False:
                    setattr(pass_config, name, False)
            logger.info("npu target: %s graphs (NPUGraph; torch.compile with the eager "
                        "backend, split at attention) for %s tokens.", asked.name, sizes)
            return
        _no_compilation(compilation_config)
        compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        logger.info("npu target: FULL decode graphs (NPUGraph) for %s tokens; other batches "
                    "run eagerly.", sizes)
        return
    _no_compilation(compilation_config)
    if asked not in (None, CUDAGraphMode.NONE):
        logger.info(
            "npu target: cudagraph_mode %s%s; running eagerly. Pass "
            "compilation_config={'cudagraph_mode': 'FULL_DECODE_ONLY'} (or PIECEWISE, "
            "FULL_AND_PIECEWISE) without enforce_eager for graphs.", asked,
            " with enforce_eager" if enforce_eager else " on more than one NPU")
    compilation_config.cudagraph_mode = CUDAGraphMode.NONE
    compilation_config.cudagraph_capture_sizes = []


def _cap_capture_sizes_at_one_block(vllm_config: VllmConfig) -> None:
    """Drop the graph capture sizes above the (final) KV block size: padding tokens of a
    captured batch write their KV into vLLM's null block, one slot each, so a captured batch
    holds at most one block of tokens. Without any size left, every batch runs eagerly."""
    from vllm.config import CUDAGraphMode

    compilation_config = vllm_config.compilation_config
    mode = compilation_config.cudagraph_mode
    sizes = list(compilation_config.cudagraph_capture_sizes or [])
    block_size = vllm_config.cache_config.block_size
    if mode in (None, CUDAGraphMode.NONE) or not sizes or block_size is None:
        return
    kept = [size for size in sizes if size <= block_size]
    if kept == sizes:
        return
    logger.info("npu target: the KV block size is %d tokens; batches above it run eagerly, "
                "not captured: %s.", block_size, [size for size in sizes if size > block_size])
    compilation_config.cudagraph_capture_sizes = kept
    if kept:
        compilation_config.max_cudagraph_capture_size = max(kept)
    else:
        logger.info("npu target: no decode batch fits one KV block of %d tokens; every batch "
                    "runs eagerly.", block_size)
        compilation_config.cudagraph_mode = CUDAGraphMode.NONE


def _no_compilation(compilation_config) -> None:
    """The model runs as written: no torch.compile (Inductor has no NPU backend)."""
    from vllm.config import CompilationMode

    if compilation_config.mode != CompilationMode.NONE:
        logger.info("npu target: compilation mode %s is not supported without PIECEWISE "
                    "graphs (no Inductor backend for NPUs); running the model eagerly.",
                    compilation_config.mode)
        compilation_config.mode = CompilationMode.NONE
