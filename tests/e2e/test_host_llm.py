"""The host target inside real vLLM, compared with stock vLLM on the same model."""

from __future__ import annotations

import pytest

from vllm_runs import PROMPTS, run_vllm, start_failure

HOST = {"VLLM_ASCEND_TARGET": "host"}


def test_stock_run_leaves_vllm_alone(stock_llama):
    assert stock_llama["platform"] == "vllm.platforms.cpu.CpuPlatform"
    (worker,) = stock_llama["workers"]
    assert worker["model_runner"] == "vllm.v1.worker.cpu_model_runner.CPUModelRunner"
    assert not any(name.startswith("Ascend") for name in worker["layer_classes"])
    # Nothing of the plugin in stock vLLM's output: the only lines that say "ascend" name
    # the tiny model's folder (under ~/.cache/ascend-plugin/models).
    lines = [line for line in stock_llama["log"].splitlines() if "ascend" in line.lower()]
    assert all("ascend-plugin/models/" in line for line in lines), lines
    assert "does not have 'ascend_target'" not in stock_llama["log"]


def test_host_target_runs_the_plugin_stack(plugin_llama):
    assert plugin_llama["platform"] == "ascend_core.platform.host.AscendHostPlatform"
    (worker,) = plugin_llama["workers"]
    assert worker["worker"] == "ascend_core.worker.host_worker.AscendHostWorker"
    assert worker["model_runner"] == (
        "ascend_core.worker.host_model_runner.AscendHostModelRunner")
    # The model's norm and activation layers are the plugin's replacements.
    assert {"AscendRMSNorm", "AscendRotaryEmbedding", "AscendSiluAndMul"} <= set(
        worker["layer_classes"])


def test_host_greedy_tokens_equal_stock(stock_llama, plugin_llama):
    assert len(plugin_llama["token_ids"]) == len(PROMPTS)
    assert all(len(ids) == 16 for ids in plugin_llama["token_ids"])
    assert plugin_llama["token_ids"] == stock_llama["token_ids"]
    # A random model that says the same thing to every prompt would hide a broken
    # comparison: the prompts must get different continuations.
    assert len({tuple(ids) for ids in stock_llama["token_ids"]}) > 1


def test_ngram_speculation_through_our_model_runner(llama_dir, plugin_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3,
            "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    result = run_vllm({"model": llama_dir, "prompts": PROMPTS,
                       "llm": {"speculative_config": spec}}, HOST)
    (worker,) = result["workers"]
    # ascend-specdec's n-gram proposer (registered as "ngram") serves, in our model runner.
    assert worker["proposer_source"] == "ascend"
    assert worker["drafter"] == "AscendNgramProposer"
    assert result["token_ids"] == plugin_llama["token_ids"]


def test_tensor_parallel_2_equals_1(llama_dir, plugin_llama):
    # vLLM's CPU workers bind OpenMP threads per NUMA node; a 2-core, 1-node
    # machine needs the binding given by hand (one core per rank).
    result = run_vllm({"model": llama_dir, "prompts": PROMPTS,
                       "llm": {"tensor_parallel_size": 2}},
                      {**HOST, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert result["platform"] == "ascend_core.platform.host.AscendHostPlatform"
    assert len(result["workers"]) == 2
    assert result["token_ids"] == plugin_llama["token_ids"]


def test_pipeline_parallel_2_equals_1(llama_dir, plugin_llama):
    result = run_vllm({"model": llama_dir, "prompts": PROMPTS,
                       "llm": {"pipeline_parallel_size": 2,
                               "distributed_executor_backend": "mp"}},
                      {**HOST, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert result["platform"] == "ascend_core.platform.host.AscendHostPlatform"
    assert len(result["workers"]) == 2
    assert result["token_ids"] == plugin_llama["token_ids"]


@pytest.mark.parametrize("additional_config, message", [
    ({"enable_cpu_bindng": True}, "Did you mean 'enable_cpu_binding'?"),
    ({"enable_mlapo": True}, "'enable_mlapo' was removed"),
    ({"enable_cpu_binding": "yes"}, "enable_cpu_binding"),
])
def test_bad_additional_config_fails_at_start_up(llama_dir, additional_config, message):
    output = start_failure({"model": llama_dir, "prompts": ["x"],
                            "llm": {"additional_config": additional_config}}, HOST)
    # vLLM wraps the error from the platform's config hook in its own ValidationError.
    assert "additional_config" in output and message in output


def test_npu_target_without_torch_npu_fails_clearly(llama_dir):
    output = start_failure({"model": llama_dir, "prompts": ["x"]},
                           {"VLLM_ASCEND_TARGET": "npu"})
    assert "VLLM_ASCEND_TARGET=npu, but torch_npu does not import" in output


def test_unknown_target_fails_clearly(llama_dir):
    output = start_failure({"model": llama_dir, "prompts": ["x"]},
                           {"VLLM_ASCEND_TARGET": "gpu"})
    assert "VLLM_ASCEND_TARGET" in output and "'gpu'" in output
