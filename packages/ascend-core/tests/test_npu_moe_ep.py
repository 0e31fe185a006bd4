"""The npu MoE method's expert-parallel kernel (ascend_core.ops.moe_ep) in one process: vLLM's
expert placement read into our placement, the kernel's prepare/experts/finalize through
vLLM's ``FusedMoEKernel`` on the reference torch_npu against the method's one-NPU path, which
layers take it, and bad input. Across ranks the same dispatch/combine is tested in
test_moe_comm.py (``dispatch_replicated``) and end to end in tests/e2e/test_npu_moe_ep.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    FusedMoEQuantConfig,
)
from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

from ascend_core.distributed.moe_comm import ALL_GATHER, ExpertPlacement, MoECommunication
from ascend_core.ops.moe import fused_moe, route
from ascend_core.ops.moe_ep import (
    AscendDispatchedExperts,
    AscendMoECommPrepareFinalize,
    placement_from_vllm,
    uses_moe_comm,
)

from npu_reference import reference_torch_npu


@pytest.fixture(scope="module")
def reference_npu():
    with reference_torch_npu() as module:
        yield module


# --- placement ----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["linear", "round_robin"])
@pytest.mark.parametrize(("num_experts", "ep_size"), [(8, 2), (7, 2), (10, 4), (3, 3)])
def test_placement_is_vllms_on_every_rank(strategy, num_experts, ep_size):
    for rank in range(ep_size):
        _, expert_map, _ = determine_expert_map(ep_size, rank, num_experts, strategy)
        placement = placement_from_vllm(num_experts, ep_size, rank, strategy, expert_map)
        assert placement.num_experts == num_experts and placement.ep_size == ep_size
        mine = placement.owner == rank
        assert torch.equal(mine, expert_map >= 0)
        assert torch.equal(placement.local_index[mine], expert_map[mine].long())
    # Uneven counts are served (7 experts on 2 ranks: 4 and 3), no expert left out.
    assert sum(placement.num_local_experts(r) for r in range(ep_size)) == num_experts


def test_placement_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"over 4 ranks \(data parallel x tensor parallel\) "
                                         r"needs at least one expert per rank, but the layer "
                                         r"has 3 experts.*at most 3"):
        placement_from_vllm(3, 4, 0, "linear", None)
    _, round_robin_map, _ = determine_expert_map(2, 0, 8, "round_robin")
    with pytest.raises(ValueError, match=r"EP rank 0: the layer's expert_map .* is not "
                                         r"vLLM's 'linear' placement"):
        placement_from_vllm(8, 2, 0, "linear", round_robin_map)
    with pytest.raises(ValueError, match="Unsupported expert placement strategy 'spread'"):
        placement_from_vllm(8, 2, 0, "spread", None)


# --- which layers take the per-batch path --------------------------------------------------------


def _config(use_ep=True, ep_size=2, dp_size=1, pcp_size=1, sp=False, skip=False):
    parallel = SimpleNamespace(use_ep=use_ep, ep_size=ep_size, dp_size=dp_size,
                               pcp_size=pcp_size, is_sequence_parallel=sp)
    return SimpleNamespace(moe_parallel_config=parallel, skip_final_all_reduce=skip)


@pytest.mark.parametrize(("config", "expected"), [
    (_config(), True),
    (_config(use_ep=False, ep_size=1), False),
    (_config(ep_size=1), False),
    # Data parallel in front: the kernel takes each DP rank's own tokens.
    (_config(dp_size=2), True),
    # Without expert parallelism vLLM gathers every DP rank's tokens (its naive dispatch).
    (_config(use_ep=False, ep_size=1, dp_size=2), False),
    (_config(pcp_size=2), False),
    (_config(sp=True), False),
    # vLLM's sequence-parallel MoE (DP and TP): each rank's chunk is its own.
    (_config(dp_size=2, sp=True), True),
    # The model all-reduces the MoE output itself; an already summed output would be summed
    # again.
    (_config(skip=True), False),
])
def test_expert_parallel_takes_the_per_batch_kernel(config, expected):
    assert uses_moe_comm(config) is expected



# --- the kernel through vLLM's FusedMoEKernel ------------------------------------------------------

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 6, 2


def _moe_config() -> FusedMoEConfig:
    return FusedMoEConfig(
        num_experts=EXPERTS, experts_per_token=TOP_K, hidden_dim=HIDDEN,
        intermediate_size=INTER, num_local_experts=EXPERTS, num_logical_experts=EXPERTS,
        activation=MoEActivation.SILU, device="npu", routing_method=None,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16)


def _kernel(threshold: int = 0):
    placement = ExpertPlacement.linear(EXPERTS, 1)
    comm = MoECommunication(None, placement, all2all_min_tokens=threshold)
    prepare_finalize = AscendMoECommPrepareFinalize(
        comm, lambda logits: route(logits, top_k=TOP_K, renormalize=True), "layers.0.mlp")
    experts = AscendDispatchedExperts(_moe_config(), FusedMoEQuantConfig.make(),
                                      prepare_finalize)
    return mk.FusedMoEKernel(prepare_finalize, experts), prepare_finalize


def _weights(seed: int):
    generator = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(EXPERTS, HIDDEN, 2 * INTER, generator=generator) / 4).bfloat16()
    w2 = (torch.randn(EXPERTS, INTER, HIDDEN, generator=generator) / 4).bfloat16()
    return w13.to("npu"), w2.to("npu")


@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_kernel_equals_the_one_npu_path_and_counts_its_batches(reference_npu, tokens):
    kernel, prepare_finalize = _kernel()
    assert kernel.is_monolithic and kernel.output_is_reduced()
    w13, w2 = _weights(tokens)
    generator = torch.Generator().manual_seed(100 + tokens)
    x = torch.randn(tokens, HIDDEN, generator=generator).bfloat16().to("npu")
    logits = torch.randn(tokens, EXPERTS, generator=generator).to("npu")
    out = kernel.apply_monolithic(hidden_states=x, w1=w13, w2=w2, router_logits=logits,
                                  activation=MoEActivation.SILU, global_num_experts=EXPERTS,
                                  expert_map=None, apply_router_weight_on_input=False,
                                  routing_sink=None)
    expected = fused_moe(x, logits, w13, w2, top_k=TOP_K, renormalize=True)
    assert out.device.type == "npu" and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=3e-2, rtol=3e-2)
    # One rank: every batch is all-gather (nothing to move), counted by its token count.
    assert prepare_finalize.batches == {ALL_GATHER: {tokens: 1}, "alltoall": {}, "mc2": {}}
    assert prepare_finalize.pending is None


def test_kernel_steps_out_of_order_are_clear_errors(reference_npu):
    _, prepare_finalize = _kernel()
    with pytest.raises(RuntimeError, match="'layers.0.mlp': finalize without prepare"):
        prepare_finalize.finalize(torch.zeros(1, HIDDEN))
    x = torch.ones(3, HIDDEN, dtype=torch.bfloat16, device="npu")
    logits = torch.zeros(3, EXPERTS, device="npu")
    prepare_finalize.prepare(x, logits, None)
    with pytest.raises(RuntimeError, match="prepare called twice without finalize"):
        prepare_finalize.prepare(x, logits, None)
    experts = AscendDispatchedExperts(_moe_config(), FusedMoEQuantConfig.make(),
                                      prepare_finalize)
    w13, w2 = _weights(0)
    with pytest.raises(RuntimeError, match="only on rows its prepare/finalize dispatched"):
        experts.apply(x, w13, w2, logits, MoEActivation.SILU, EXPERTS, None, None, False)


def test_experts_declare_what_they_serve():
    assert AscendDispatchedExperts._supports_activation(MoEActivation.SILU)
    assert not AscendDispatchedExperts._supports_activation(MoEActivation.GELU)
    assert AscendDispatchedExperts._supports_quant_scheme(None, None)
    assert not AscendDispatchedExperts._supports_quant_scheme(object(), None)
    assert AscendDispatchedExperts.activation_format() == mk.FusedMoEActivationFormat.Standard
