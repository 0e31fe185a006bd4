"""The npu target end to end on the reference torch_npu: real vLLM, the npu platform,
NPUWorker, NPUModelRunner and the Ascend attention backend, on the reference's npu device
(host memory behind torch's PrivateUse1 backend; torch_npu functions computed by the
reference).

Each configuration runs once in its own process (module-scoped fixtures). The comparisons
are with the host target in the same dtype (bfloat16: the Ascend attention takes
float16/bfloat16 only), on the same prompts, greedy, 16 tokens each:

- dense Llama (hidden 128, head_dim 32): every token of every prompt equal;
- n-gram and Medusa speculative decoding on the npu target: every token equal to the npu
  target without speculation;
- FULL decode graphs (NPUGraph, vLLM's CUDAGraphWrapper): every token equal to the eager npu
  run, with decode steps replayed from captured graphs (and, in that run, the float linear
  weights in FRACTAL_NZ: weight_nz_mode 2);
- W8A8 (compressed-tensors, dynamic per-token activations) Llama checkpoint, against the
  host target serving the same checkpoint, and tensor parallel 2 (two reference NPUs, HCCL =
  gloo underneath) against TP 1: here the sums are formed in another order (the int8
  matmul's epilogue, the all-reduce of partial results) and bfloat16 rounds them apart, so
  a near-tie may flip a token. What is compared: per prompt, the tokens up to the first
  difference are equal, and at that position both runs' top-5 logprobs hold both tokens
  within ``NEAR_TIE`` (0.1 nat, a few bfloat16 steps of these logits) of each other; after
  a difference the contexts differ and nothing more is compared. These run on the Medusa
  demo's base Llama (initializer_range 0.005), whose logits have larger margins.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_runs import ALL_CPUS, FIXED_DRAFT_LENGTH, PROMPTS, run_vllm

REPO_ROOT = Path(__file__).resolve().parents[2]
REFERENCE = str(REPO_ROOT / "testing" / "reference_torch_npu")
MiB = 1 << 20

# The reference NPU is host memory: a 1 GiB device with 20% for vLLM keeps the KV cache
# small (about 200 MiB), and the KV-cache size still comes from the profiling run.
NPU = {
    "VLLM_ASCEND_TARGET": "npu",
    "PYTHONPATH": os.pathsep.join(
        [REFERENCE] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ),
    "TORCH_NPU_REFERENCE_TOTAL_MEMORY": str(1024 * MiB),
}
HOST = {"VLLM_ASCEND_TARGET": "host"}
LLM = {"dtype": "bfloat16", "gpu_memory_utilization": 0.2}
# The n-gram and EAGLE tests on npu run with the draft-length controller (opt-in).
DYNAMIC_DRAFT_LENGTH = {"draft_length_config": {"dynamic": True}}
NPU_RUNNER = "ascend_core.worker.npu_model_runner.NPUModelRunner"
NEAR_TIE = 0.1
TOP_LOGPROBS = 5


def first_difference(a: list[int], b: list[int]) -> int | None:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return None if n == len(a) == len(b) else n


def assert_equal_up_to_near_ties(ours: dict, theirs: dict, what: str,
                                 near_tie: float = NEAR_TIE) -> None:
    """Greedy tokens equal, or equal up to a position where the two runs' choices are
    within ``near_tie`` of each other in both runs' logprobs."""
    assert ours["prompt_token_ids"] == theirs["prompt_token_ids"]
    report = []
    for prompt, (a, b) in enumerate(zip(ours["token_ids"], theirs["token_ids"], strict=True)):
        n = first_difference(a, b)
        if n is None:
            report.append("equal")
            continue
        gaps = []
        for run in (ours, theirs):
            top = run["logprobs"][prompt][n]
            missing = [t for t in (a[n], b[n]) if str(t) not in top]
            assert not missing, (f"{what}, prompt {prompt}: tokens {a[n]} / {b[n]} differ at "
                                 f"position {n} and {missing} is not in the top "
                                 f"{TOP_LOGPROBS} there: {top}")
            gaps.append(abs(top[str(a[n])] - top[str(b[n])]))
        report.append(f"differs at {n}, gap {max(gaps):.3f}")
        assert max(gaps) <= near_tie, (f"{what}, prompt {prompt}: tokens {a[n]} / {b[n]} at "
                                       f"position {n} are {max(gaps):.3f} nat apart, not a "
                                       f"near-tie (<= {near_tie})")
    print(f"\n{what}: {report}")


def run(model, env, prompts=PROMPTS, score_own=False, **llm) -> dict:
    return run_vllm({"model": str(model), "prompts": prompts, "max_tokens": 16,
                     "sampling": {"logprobs": TOP_LOGPROBS}, "llm": {**LLM, **llm},
                     "score_own": score_own}, env)


def assert_on_npu(result: dict, workers: int = 1) -> None:
    assert result["platform"] == "ascend_core.platform.npu.AscendPlatform"
    assert len(result["workers"]) == workers
    for worker in result["workers"]:
        assert worker["worker"] == "ascend_core.worker.npu_worker.NPUWorker"
        assert worker["model_runner"] == NPU_RUNNER


# --- dense Llama ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama() -> Path:
    from ascend_plugin.tiny_models import ensure_model

    return ensure_model("llama")


@pytest.fixture(scope="module")
def llama_host(llama) -> dict:
    return run(llama, HOST)


@pytest.fixture(scope="module")
def llama_npu(llama) -> dict:
    return run(llama, NPU)


def test_dense_llama_runs_through_the_npu_worker_and_runner(llama_npu):
    assert_on_npu(llama_npu)
    (worker,) = llama_npu["workers"]
    # The npu custom ops were the model's layers, not vLLM's own.
    assert {"AscendRMSNorm", "AscendRotaryEmbedding", "AscendSiluAndMul"} <= set(
        worker["layer_classes"])


def test_dense_llama_greedy_tokens_equal_the_host_target(llama_npu, llama_host):
    assert len({tuple(ids) for ids in llama_host["token_ids"]}) == len(PROMPTS)
    # Exact on AVX-512 machines; on AVX2-only ones vLLM's CPU kernels round bfloat16
    # another way and a near-tie of these random weights may flip (issue 18).
    assert_equal_up_to_near_ties(llama_npu, llama_host, "dense Llama npu vs host")


# --- speculative decoding ---------------------------------------------------------------------


def test_ngram_speculation_on_npu_keeps_greedy_tokens(llama, llama_npu):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1}
    result = run(llama, NPU, speculative_config=spec, additional_config=DYNAMIC_DRAFT_LENGTH)
    assert_on_npu(result)
    (worker,) = result["workers"]
    assert worker["proposer_source"] == "ascend"
    assert worker["rejection_sampler_source"] == "ascend"
    assert result["token_ids"] == llama_npu["token_ids"]


@pytest.fixture(scope="module")
def medusa_demo() -> tuple[str, str]:
    from tiny_medusa import ensure_tiny_medusa

    return ensure_tiny_medusa()


@pytest.fixture(scope="module")
def medusa_base_npu(medusa_demo) -> dict:
    return run(medusa_demo[0], NPU)


def test_medusa_speculation_on_npu_keeps_greedy_tokens(medusa_demo, medusa_base_npu):
    from ascend_plugin.demo import MEDUSA_HEADS

    base, heads = medusa_demo
    plain = medusa_base_npu
    spec = {"method": "medusa", "model": heads, "num_speculative_tokens": MEDUSA_HEADS}
    # At k=3 every step, for the acceptance length it prints (docs/FEATURES.md).
    result = run(base, NPU, speculative_config=spec, disable_log_stats=False,
                 additional_config=FIXED_DRAFT_LENGTH)
    assert_on_npu(result)
    (worker,) = result["workers"]
    assert worker["proposer_source"] == "ascend"
    assert worker["drafter"] == "AscendMedusaProposer"
    metrics = result["metrics"]
    assert metrics["vllm:spec_decode_num_drafts"] > 0
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"]
    print(f"\nMedusa on npu: mean acceptance length "
          f"{1 + accepted / metrics['vllm:spec_decode_num_drafts']:.3f}")
    assert accepted > 0
    assert result["token_ids"] == plain["token_ids"]


def test_medusa_tree_steps_on_npu_keep_greedy_tokens_and_logprobs(medusa_demo,
                                                                  medusa_base_npu):
    """Medusa trees on npu: the fused attention op's full mask (sparse_mode 0) lets each
    node see the context and its ancestors; the accepted paths move to the slots after
    their roots. Tokens equal to no speculation, logprobs within 1e-3 (measured 5e-7)."""
    base, heads = medusa_demo
    plain = medusa_base_npu
    tree = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
    spec = {"method": "medusa", "model": heads, "num_speculative_tokens": len(tree)}
    result = run(base, NPU, speculative_config=spec, disable_log_stats=False,
                 additional_config={**FIXED_DRAFT_LENGTH,
                                    "medusa_tree_config": {"paths": tree}})
    assert_on_npu(result)
    metrics = result["metrics"]
    length = 1 + metrics["vllm:spec_decode_num_accepted_tokens"] / metrics[
        "vllm:spec_decode_num_drafts"]
    print(f"\nMedusa tree of {len(tree)} nodes on npu: mean acceptance length {length:.3f}")
    assert length > 1.5
    assert result["token_ids"] == plain["token_ids"]
    gaps = [abs(position[token] - reference[token])
            for ours, theirs in zip(result["logprobs"], plain["logprobs"], strict=True)
            for position, reference in zip(ours, theirs, strict=True)
            for token in reference if token in position]
    assert len(gaps) >= len(PROMPTS) * 16 and max(gaps) <= 1e-3


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_speculation_on_npu_keeps_greedy_tokens(medusa_demo, medusa_base_npu, method):
    from ascend_plugin.tiny_drafts import ensure_eagle3_draft, ensure_eagle_draft

    base = medusa_demo[0]
    if method == "eagle":
        draft = ensure_eagle_draft(base, std=0.005, carry_embedding=True)
    else:
        draft = ensure_eagle3_draft(base, draft_vocab_size=1024)
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 3}
    result = run(base, NPU, speculative_config=spec, disable_log_stats=False,
                 additional_config=DYNAMIC_DRAFT_LENGTH)
    assert_on_npu(result)
    (worker,) = result["workers"]
    assert worker["proposer_source"] == "ascend"
    assert worker["drafter"] == "AscendEagleProposer"
    assert result["metrics"]["vllm:spec_decode_num_drafts"] > 0
    assert result["token_ids"] == medusa_base_npu["token_ids"]


# --- W8A8 checkpoint --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def w8a8_checkpoint(tmp_path_factory, medusa_demo) -> Path:
    from ascend_quant.writers import Group, write_compressed_tensors

    out = tmp_path_factory.mktemp("npu-w8a8") / "llama-w8a8-dynamic"
    write_compressed_tensors(medusa_demo[0], out, [Group(r".*_proj", "W8A8_DYNAMIC")])
    return out


def test_w8a8_checkpoint_on_npu_equals_the_host_target(w8a8_checkpoint):
    host = run(w8a8_checkpoint, HOST)
    npu = run(w8a8_checkpoint, NPU)
    assert_on_npu(npu)
    assert len({tuple(ids) for ids in host["token_ids"]}) == len(PROMPTS)
    assert_equal_up_to_near_ties(npu, host, "W8A8 npu vs host")
    # weight_nz_mode's default (1): the int8 weights npu_quant_matmul reads are FRACTAL_NZ,
    # nothing else.
    nz = npu["workers"][0]["nz_weights"]
    assert nz and all(name.endswith("_proj.ascend_npu_qweight") for name in nz)
    assert {name.rsplit(".", 2)[-2] for name in nz} == {"qkv_proj", "o_proj", "gate_up_proj",
                                                        "down_proj"}


# --- tensor parallel 2 ------------------------------------------------------------------------


def test_tensor_parallel_2_over_hccl_equals_tp_1(medusa_demo, medusa_base_npu):
    """With enable_cpu_binding: each worker on its own half of this process's cores."""
    env = {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2"}
    result = run(medusa_demo[0], env, tensor_parallel_size=2, distributed_executor_backend="mp",
                 additional_config={"enable_cpu_binding": True})
    assert_on_npu(result, workers=2)
    assert_equal_up_to_near_ties(result, medusa_base_npu, "TP 2 vs TP 1 on npu")
    from ascend_core.worker.cpu_binding import cpu_share, numa_node_of_core

    allowed = sorted(ALL_CPUS)  # a run with two workers gets every core (vllm_runs)
    expected = [cpu_share(allowed, rank, 2, numa_node_of_core()) for rank in (0, 1)]
    assert [w["cpu_affinity"] for w in result["workers"]] == expected
    if len(allowed) >= 2:
        assert not set(expected[0]) & set(expected[1])
    assert [w["torch_threads"] for w in result["workers"]] == [len(c) for c in expected]
    # Without the key vLLM's worker keeps the cores it was started on.
    assert medusa_base_npu["workers"][0]["cpu_affinity"] == sorted(os.sched_getaffinity(0))


def test_pipeline_parallel_2_over_hccl_equals_pp_1(medusa_demo, medusa_base_npu):
    """Two stages on two reference NPUs: vLLM's stage-to-stage tensors go through the
    group's send / recv (``hccl``, gloo underneath)."""
    env = {**NPU, "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2"}
    result = run(medusa_demo[0], env, pipeline_parallel_size=2,
                 distributed_executor_backend="mp")
    assert_on_npu(result, workers=2)
    assert_equal_up_to_near_ties(result, medusa_base_npu, "PP 2 vs PP 1 on npu")


# --- MoE (unquantized experts) ----------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_moe() -> Path:
    from ascend_plugin.tiny_models import ensure_model

    # hidden 128 / 4 heads: head_dim 32, one the Ascend attention takes (16..512, steps of 16).
    return ensure_model("qwen3_moe")


@pytest.fixture(scope="module")
def qwen3_moe_npu(qwen3_moe) -> dict:
    return run(qwen3_moe, NPU, score_own=True)


def score(model, env, sequences, **llm) -> list[list[float]]:
    return run_vllm({"model": str(model), "score": sequences, "llm": {**LLM, **llm}},
                    env)["token_logprobs"]


def mean_difference(a: list[list[float]], b: list[list[float]]) -> float:
    diffs = [abs(x - y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True)]
    return sum(diffs) / len(diffs)


def test_moe_model_on_npu_is_as_exact_as_the_host_target(qwen3_moe, qwen3_moe_npu):
    """8 experts, top-2 renormalised: routing on npu_moe_gating_top_k_softmax, experts on
    npu_grouped_matmul + npu_swiglu. This random MoE (weights std 0.2) has large logits, and
    bfloat16 sums formed in another order than vLLM's CPU experts part its greedy paths by
    0.5 nat on some CPUs (seen with AMX), so its greedy tokens are not compared. Instead the
    same sequences (the npu run's prompts and greedy continuations) are scored teacher-forced,
    by that npu run itself and on the host in bfloat16 and in float32: the npu logprobs must
    lie on average no further from float32's than twice the host's bfloat16 ones do (+0.02
    nat). The mean, not the
    largest difference: where two experts' router scores nearly tie, bfloat16 rounding picks
    either, and one such token moves by several nats (seen: 4.1 nat for one of 209 tokens
    on an emulated AVX2-only CPU)."""
    npu = qwen3_moe_npu
    assert_on_npu(npu)
    (worker,) = npu["workers"]
    assert "AscendUnquantizedFusedMoEMethod" in worker["layer_classes"]
    assert len({tuple(ids) for ids in npu["token_ids"]}) == len(PROMPTS)
    sequences = [p + c for p, c in zip(npu["prompt_token_ids"], npu["token_ids"], strict=True)]
    exact = score(qwen3_moe, HOST, sequences, dtype="float32")
    on_npu = mean_difference(npu["token_logprobs"], exact)
    on_host = mean_difference(score(qwen3_moe, HOST, sequences), exact)
    print(f"\nqwen3-MoE bfloat16 vs float32, mean logprob difference over "
          f"{sum(map(len, exact))} tokens: npu {on_npu:.4f}, host {on_host:.4f}")
    assert on_npu <= 2 * on_host + 0.02


# --- FULL decode graphs -----------------------------------------------------------------------

# FULL decode graphs on NPUGraph, asked for as a user would (run_llm.py defaults to eager).
GRAPHS = {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}, "enforce_eager": False,
          "max_num_seqs": 8}


@pytest.fixture(scope="module")
def llama_npu_graphs(llama) -> dict:
    # With the float linear weights in FRACTAL_NZ too (weight_nz_mode 2).
    return run(llama, NPU, additional_config={"weight_nz_mode": 2}, **GRAPHS)


def test_dense_llama_with_full_decode_graphs_keeps_greedy_tokens(llama_npu_graphs, llama_npu):
    assert_on_npu(llama_npu_graphs)
    (worker,) = llama_npu_graphs["workers"]
    # Decode steps replayed captured graphs: 16 tokens per prompt, the first from prefill.
    assert worker["graph_replays"] >= 15
    (eager_worker,) = llama_npu["workers"]
    assert eager_worker["graph_replays"] == 0
    assert llama_npu_graphs["token_ids"] == llama_npu["token_ids"]


def test_weight_nz_mode_2_casts_every_float_linear_weight(llama_npu_graphs, llama_npu):
    """The graphs run above (greedy equal to llama_npu) had weight_nz_mode 2: each layer's
    qkv, o, gate_up and down weights FRACTAL_NZ; embeddings, norms and the LM head ND. By
    default (1) a float model keeps every weight ND."""
    (worker,) = llama_npu_graphs["workers"]
    layers = {name.split(".layers.")[1].split(".")[0] for name in worker["nz_weights"]}
    projections = {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight",
                   "mlp.gate_up_proj.weight", "mlp.down_proj.weight"}
    assert set(worker["nz_weights"]) == {f"model.layers.{i}.{p}" for i in layers
                                         for p in projections}
    assert layers and layers == {str(i) for i in range(len(layers))}
    assert llama_npu["workers"][0]["nz_weights"] == []


def test_moe_model_with_full_decode_graphs_keeps_greedy_tokens(qwen3_moe, qwen3_moe_npu):
    """Routing, the grouped matmuls and the weighted combine of every MoE layer replayed
    from captured graphs: the group sizes are device tensors, so each replay routes the
    step's own tokens."""
    result = run(qwen3_moe, NPU, **GRAPHS)
    assert_on_npu(result)
    (worker,) = result["workers"]
    assert worker["graph_replays"] >= 15
    assert result["token_ids"] == qwen3_moe_npu["token_ids"]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_with_full_decode_graphs_keeps_greedy_tokens(medusa_demo, medusa_base_npu,
                                                          method):
    """EAGLE / EAGLE-3 (3 drafts) with FULL decode graphs: the verification batches (4-token
    queries) replay captured graphs whose fused attention is a task group per layer, the
    draft runs eagerly (vLLM's drafter takes PIECEWISE graphs only), and every greedy token
    is the eager run's without speculation. The drafter's warm-up during capture gets
    padding KV slots (AscendEagleProposer.dummy_run); with its unwritten slot buffer (zeros)
    it wrote slot 0 for every dummy token and start-up failed on duplicate slots."""
    import json

    from ascend_plugin.tiny_drafts import ensure_eagle3_draft, ensure_eagle_draft

    base = medusa_demo[0]
    if method == "eagle":
        draft = ensure_eagle_draft(base, std=0.005, carry_embedding=True)
    else:
        draft = ensure_eagle3_draft(base, draft_vocab_size=1024)
    spec = {"method": method, "model": str(draft), "num_speculative_tokens": 3}
    result = run(base, NPU, speculative_config=spec, disable_log_stats=False, **GRAPHS)
    assert_on_npu(result)
    (worker,) = result["workers"]
    assert worker["drafter"] == "AscendEagleProposer"
    assert worker["drafter_counters"]["dummy_run_padding_slots"] > 0
    sizes = worker["graph_capture_sizes"]
    assert sizes and all(size % 4 == 0 for size in sizes), sizes  # verification batches
    assert max(sizes) <= worker["kv_block_size"], (sizes, worker["kv_block_size"])
    full = worker["graph_counts"]["FULL"]
    layers = json.loads((Path(base) / "config.json").read_text())["num_hidden_layers"]
    assert full["graphs"] == len(sizes), (full, sizes)
    assert full["task_groups"] == full["graphs"] * layers, (full, layers)
    assert 0 < full["replays"] <= worker["rejection_sampler_calls"], full
    assert full["task_updates"] == full["replays"] * layers, (full, layers)
    assert result["metrics"]["vllm:spec_decode_num_drafts"] > 0
    assert result["token_ids"] == medusa_base_npu["token_ids"]
