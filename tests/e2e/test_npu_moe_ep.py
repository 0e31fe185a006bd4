"""Expert parallelism on the npu target end to end: real vLLM, two reference NPUs (HCCL = gloo
underneath), a tiny Qwen3-MoE with ``tensor_parallel_size=2, enable_expert_parallel=True``.

Each MoE forward picks its token communication by the batch's token count
(``VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS``, 16 here): the prefill steps of the 8 prompts (at
least 16 tokens each) go all-to-all, the decode steps (8 tokens) all-gather. The workers report
which path each batch size took (``moe_comm_batches`` from the worker probe), and the greedy
tokens equal those of one NPU (TP 1) up to near-ties (the expert sums are added in another
order and in bfloat16; see test_npu_target.py).

The model routes each token to one of 8 experts (top-1): with top-2 over two ranks the
selection keeps all-gather for every batch (all-to-all would move as many rows).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_npu_target import NPU, assert_equal_up_to_near_ties, assert_on_npu, run

ALL2ALL_MIN_TOKENS = 16
NUM_LAYERS = 2  # tiny_models' default
MAX_TOKENS = 16  # test_npu_target.run


@pytest.fixture(scope="module")
def qwen3_moe_top1() -> Path:
    from ascend_plugin.tiny_models import ensure_model

    return ensure_model("qwen3_moe", num_experts_per_tok=1)


@pytest.fixture(scope="module")
def tp1(qwen3_moe_top1) -> dict:
    return run(qwen3_moe_top1, NPU)


@pytest.fixture(scope="module")
def tp2_ep(qwen3_moe_top1) -> dict:
    env = {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2",
           "VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS": str(ALL2ALL_MIN_TOKENS)}
    return run(qwen3_moe_top1, env, tensor_parallel_size=2, enable_expert_parallel=True,
               distributed_executor_backend="mp")


def test_each_moe_forward_picks_its_path_by_the_batch_token_count(tp2_ep):
    assert_on_npu(tp2_ep, workers=2)
    prompt_tokens = sum(len(ids) for ids in tp2_ep["prompt_token_ids"])
    decode_tokens = len(tp2_ep["prompt_token_ids"])
    assert prompt_tokens >= ALL2ALL_MIN_TOKENS > decode_tokens
    batches = [worker["moe_comm_batches"] for worker in tp2_ep["workers"]]
    print(f"\nper-batch MoE paths (rank 0): {batches[0]}")
    # Both ranks took the same path for every batch (or a collective would have hung).
    assert batches[0] == batches[1]
    taken = batches[0]
    # No batch went the other way than the threshold says (the profiling and warm-up runs,
    # with hundreds of tokens, included).
    assert all(int(n) >= ALL2ALL_MIN_TOKENS for n in taken["alltoall"])
    assert all(int(n) < ALL2ALL_MIN_TOKENS for n in taken["allgather"])
    # The requests' batches (the scheduler may spread the prefills over two steps): in every
    # MoE layer each prompt token and each fed-back generated token went through one path.
    served = {method: {int(n): k for n, k in sizes.items()
                       if int(n) <= prompt_tokens + decode_tokens}
              for method, sizes in taken.items()}
    fed_back = decode_tokens * (MAX_TOKENS - 1)
    assert sum(n * k for sizes in served.values() for n, k in sizes.items()) == (
        (prompt_tokens + fed_back) * NUM_LAYERS)
    # The prefill steps went all-to-all: most prompt tokens (the scheduler may leave a short
    # rest of a prompt for a later step, mixed with decodes; such a batch goes by its own
    # size, checked above)...
    assert 2 * sum(n * k for n, k in served["alltoall"].items()) >= prompt_tokens * NUM_LAYERS
    # ...and the decode steps of all prompts together (one token each) all-gather.
    assert served["allgather"].get(decode_tokens, 0) >= (MAX_TOKENS // 2) * NUM_LAYERS
    for worker in tp2_ep["workers"]:
        assert "AscendUnquantizedFusedMoEMethod" in worker["layer_classes"]


def test_tp2_expert_parallel_greedy_tokens_equal_tp1(tp2_ep, tp1):
    assert_on_npu(tp1)
    # One NPU has no expert parallelism: no per-batch communication there.
    assert tp1["workers"][0]["moe_comm_batches"] == {}
    assert len({tuple(ids) for ids in tp1["token_ids"]}) == len(tp1["token_ids"])
    assert_equal_up_to_near_ties(tp2_ep, tp1, "qwen3-MoE TP 2 + EP vs TP 1 on npu")
