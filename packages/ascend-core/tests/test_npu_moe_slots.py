"""The npu MoE method served from physical expert slots (``ExpertSlots``, the hook ascend-eplb's
layer uses): redundant slots on the reference torch_npu give the logical experts' result, the
expert-parallel kernel sends rows to the rank of their slot, and bad input is a clear error.
End to end (with EPLB's runtime and rearrangements) in tests/e2e/test_npu_eplb.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_npu_moe import kn, make, plain_moe
from test_npu_moe_ep import _moe_config
from vllm.model_executor.layers.fused_moe import modular_kernel as mk
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

from ascend_core.distributed.moe_comm import ALL_GATHER, MoECommunication
from ascend_core.ops.moe import AscendUnquantizedFusedMoEMethod, ExpertSlots, fused_moe
from ascend_core.ops.moe_ep import AscendDispatchedExperts, AscendMoECommPrepareFinalize

from npu_reference import reference_torch_npu

EXPERTS, TOP_K = 8, 2
# Two redundant slots: experts 2 and 5 twice; slot order unlike the logical one.
PHY2LOG = torch.tensor([7, 6, 5, 4, 3, 2, 1, 0, 2, 5])


@pytest.fixture(scope="module")
def reference_npu():
    with reference_torch_npu() as module:
        yield module


class Replicas:
    """logical -> slot as a load balancer would: each token picks replica ``token % n``.
    Remembers the logical ids it was given (what a load recorder counts)."""

    def __init__(self, phy2log: torch.Tensor, num_experts: int) -> None:
        self.slots = [(phy2log == e).nonzero().reshape(-1) for e in range(num_experts)]
        self.seen: list[torch.Tensor] = []

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append(ids.cpu().clone())
        out = torch.empty_like(ids.cpu(), dtype=torch.int64)
        for t in range(ids.shape[0]):
            for j in range(ids.shape[1]):
                choices = self.slots[int(ids[t, j])]
                out[t, j] = choices[t % len(choices)]
        return out.to(ids.device)


def slot_weights(w13, w2, phy2log=PHY2LOG):
    """The [E, K, N] weights of the slots: row s holds expert phy2log[s]."""
    return kn(w13)[phy2log], kn(w2)[phy2log]


# --- ExpertSlots ------------------------------------------------------------------------------


def test_slots_spread_evenly_over_the_ranks():
    slots = ExpertSlots(10, 2, lambda ids: ids)
    assert slots.slots_per_rank == 5
    placement = slots.placement()
    assert placement.owner.tolist() == [0] * 5 + [1] * 5
    assert placement.local_index.tolist() == [0, 1, 2, 3, 4] * 2
    assert placement.num_local_experts(1) == 5


def test_bad_slots_are_clear_errors():
    with pytest.raises(ValueError, match="num_slots must be a positive multiple of num_ranks=2"
                                         r".*got 9"):
        ExpertSlots(9, 2, lambda ids: ids)
    with pytest.raises(ValueError, match="num_ranks must be an integer >= 1, got 0"):
        ExpertSlots(8, 0, lambda ids: ids)
    with pytest.raises(TypeError, match="to_slots must be callable, got list"):
        ExpertSlots(8, 1, [0, 1])
    ids = torch.zeros(3, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"shaped like the routed ids \(3, 2\), got \(3,\)"):
        ExpertSlots(8, 1, lambda ids: ids[:, 0]).route(ids)
    with pytest.raises(ValueError, match="integer slot ids.*torch.float32"):
        ExpertSlots(8, 1, lambda ids: ids.float()).route(ids)


# --- one NPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 9, 33])
def test_redundant_slots_give_the_logical_experts_result(reference_npu, tokens):
    x, logits, w13, w2 = make(tokens, EXPERTS, seed=20 + tokens)
    xn, ln = x.to("npu"), logits.to(torch.bfloat16).to("npu")
    s13, s2 = (w.to("npu") for w in slot_weights(w13, w2))
    replicas = Replicas(PHY2LOG, EXPERTS)
    out = fused_moe(xn, ln, s13, s2, top_k=TOP_K, renormalize=True,
                    slots=ExpertSlots(len(PHY2LOG), 1, replicas))
    logical = fused_moe(xn, ln, kn(w13).to("npu"), kn(w2).to("npu"), top_k=TOP_K,
                        renormalize=True)
    # The same rows through the same weights: the same numbers as the logical experts.
    assert out.device.type == "npu"
    assert torch.equal(out.cpu(), logical.cpu())
    expected = plain_moe(x, logits.to(torch.bfloat16), w13, w2, TOP_K, True)
    assert (out.cpu().float() - expected).abs().max() <= 0.03 * max(1.0, expected.abs().max())
    # The hook saw the logical ids (what EPLB records), once.
    (seen,) = replicas.seen
    probs = logits.to(torch.bfloat16).float().softmax(-1)
    assert torch.equal(seen.long().sort(-1).values, probs.topk(TOP_K).indices.sort(-1).values)


def test_redundant_slots_are_used(reference_npu):
    # Tokens all routed to expert 2 alternate between its two slots (2 -> slots 5 and 8):
    # zeroing one slot's weights zeroes exactly the tokens sent there.
    x, logits, w13, w2 = make(6, EXPERTS, seed=7)
    logits = torch.full((6, EXPERTS), -9.0)
    logits[:, 2] = 5.0
    s13, s2 = slot_weights(w13, w2)
    s2[8] = 0
    out = fused_moe(x.to("npu"), logits.to("npu"), s13.to("npu"), s2.to("npu"), top_k=1,
                    renormalize=True, slots=ExpertSlots(10, 1, Replicas(PHY2LOG, EXPERTS)))
    zero_rows = (out.cpu() == 0).all(-1)
    assert zero_rows.tolist() == [False, True] * 3


def test_fused_moe_bad_slots_are_clear_errors(reference_npu):
    x, logits, w13, w2 = make(2, EXPERTS)
    s13, s2 = slot_weights(w13, w2)
    with pytest.raises(ValueError, match="10 expert slots but w13 has 8 rows"):
        fused_moe(x, logits, kn(w13), kn(w2), top_k=2, renormalize=True,
                  slots=ExpertSlots(10, 1, lambda ids: ids))
    with pytest.raises(ValueError, match="one rank only.*num_ranks=2"):
        fused_moe(x, logits, s13, s2, top_k=2, renormalize=True,
                  slots=ExpertSlots(10, 2, lambda ids: ids))


# --- the method's hook ----------------------------------------------------------------------------


def npu_method(ep_size: int = 1, dp_size: int = 1) -> AscendUnquantizedFusedMoEMethod:
    """The method as vLLM builds it on the npu platform, without vLLM's layer around it."""
    method = object.__new__(AscendUnquantizedFusedMoEMethod)
    method.unquantized_backend = UnquantizedMoeBackend.OOT
    method.moe_kernel = None
    method.full_graphs = False
    parallel = SimpleNamespace(use_ep=ep_size > 1, ep_size=ep_size, dp_size=dp_size,
                               pcp_size=1)
    method.moe = SimpleNamespace(moe_parallel_config=parallel)
    return method


def npu_layer(w13, w2, **overrides):
    layer = SimpleNamespace(
        layer_name="model.layers.0.mlp.experts", ascend_weights_kn=True, top_k=TOP_K,
        renormalize=True, use_grouped_topk=False, num_expert_group=None, topk_group=None,
        scoring_func="softmax", e_score_correction_bias=None, routed_scaling_factor=1.0,
        w13_weight=w13, w2_weight=w2, expert_map=None)
    for name, value in overrides.items():
        setattr(layer, name, value)
    return layer


def test_the_method_serves_slots_after_the_hook(reference_npu):
    x, logits, w13, w2 = make(9, EXPERTS, seed=11)
    xn, ln = x.to("npu"), logits.to("npu")
    logical = npu_layer(kn(w13).to("npu"), kn(w2).to("npu"))
    method = npu_method()
    assert method.runs_npu_path and method.expert_slots is None
    before = method.apply_monolithic(logical, xn, ln)
    s13, s2 = (w.to("npu") for w in slot_weights(w13, w2))
    layer = npu_layer(s13, s2)
    replicas = Replicas(PHY2LOG, EXPERTS)
    method.serve_expert_slots(layer, ExpertSlots(10, 1, replicas))
    after = method.apply_monolithic(layer, xn, ln)
    assert torch.equal(after.cpu(), before.cpu())
    assert len(replicas.seen) == 1


def test_the_hook_refuses_what_it_cannot_serve(reference_npu):
    _, _, w13, w2 = make(1, EXPERTS)
    s13, s2 = slot_weights(w13, w2)
    slots = ExpertSlots(10, 1, lambda ids: ids)
    host = npu_method()
    host.unquantized_backend = UnquantizedMoeBackend.TRITON
    with pytest.raises(NotImplementedError, match="served by the npu platform's unquantized "
                                                  "experts after weight loading"):
        host.serve_expert_slots(npu_layer(s13, s2), slots)
    with pytest.raises(NotImplementedError, match=r"weights processed: False"):
        npu_method().serve_expert_slots(npu_layer(s13, s2, ascend_weights_kn=False), slots)
    with pytest.raises(TypeError, match="takes ExpertSlots, got dict"):
        npu_method().serve_expert_slots(npu_layer(s13, s2), {"num_slots": 10})
    with pytest.raises(ValueError, match="w13_weight has 8 expert rows but 10 slots are local"):
        npu_method().serve_expert_slots(npu_layer(kn(w13), kn(w2)), slots)
    with pytest.raises(ValueError, match="spread over 2 ranks but the layer has 1"):
        npu_method().serve_expert_slots(npu_layer(s13[:5], s2[:5]),
                                        ExpertSlots(10, 2, lambda ids: ids))
    # Expert parallel without the per-batch kernel (data parallel): not served.
    with pytest.raises(NotImplementedError, match="over 2 expert-parallel ranks need the "
                                                  "per-batch MoE communication, which this layer does not run.*dp_size=2"):
        npu_method(ep_size=2, dp_size=2).serve_expert_slots(
            npu_layer(s13[:5], s2[:5]), ExpertSlots(10, 2, lambda ids: ids))
    assert npu_method().expert_slots is None


def test_expert_parallel_kernel_dispatches_slots(reference_npu):
    """The kernel's router returns slots, and its communication places them: one rank
    here (the placement of every slot is this rank); two ranks in the e2e test."""
    x, logits, w13, w2 = make(12, EXPERTS, seed=13)
    xn, ln = x.to("npu"), logits.to("npu")
    s13, s2 = (w.to("npu") for w in slot_weights(w13, w2))
    method, layer = npu_method(), npu_layer(s13, s2)
    replicas = Replicas(PHY2LOG, EXPERTS)
    slots = ExpertSlots(10, 1, replicas)
    method.expert_slots = slots
    comm = MoECommunication(None, slots.placement(), all2all_min_tokens=0)
    prepare_finalize = AscendMoECommPrepareFinalize(
        comm, lambda router_logits: method._select_experts(layer, router_logits), "l0")
    config = _moe_config()
    config.num_experts = config.num_local_experts = 10
    experts = AscendDispatchedExperts(config, FusedMoEQuantConfig.make(), prepare_finalize)
    kernel = mk.FusedMoEKernel(prepare_finalize, experts)
    out = kernel.apply_monolithic(hidden_states=xn, w1=s13, w2=s2, router_logits=ln,
                                  activation=MoEActivation.SILU, global_num_experts=10,
                                  expert_map=None, apply_router_weight_on_input=False,
                                  routing_sink=None)
    expected = fused_moe(xn, ln, kn(w13).to("npu"), kn(w2).to("npu"), top_k=TOP_K,
                         renormalize=True)
    torch.testing.assert_close(out.float().cpu(), expected.float().cpu(), atol=3e-2, rtol=3e-2)
    assert prepare_finalize.batches[ALL_GATHER] == {12: 1}
    assert len(replicas.seen) == 1
