"""Run vLLM's offline LLM once, in its own process, and print a JSON result.

vLLM resolves its platform once per process, so comparing the plugin with stock
vLLM needs one process per configuration. Usage:

    python run_llm.py '{"model": "...", "prompts": [...], "max_tokens": 16, "llm": {...},
                        "sampling": {...}}'
    python run_llm.py '{"model": "...", "score": [[token ids], ...], "llm": {...}}'

"score_own": true adds "token_logprobs" of the prompts and their continuations (``score``).
"""

from __future__ import annotations

import json
import sys


def moe_comm_batches(modules) -> dict:
    total: dict = {}
    methods = {id(m.quant_method): m.quant_method for m in modules
               if getattr(m, "quant_method", None) is not None}
    for method in methods.values():
        for name, sizes in (getattr(method, "moe_comm_batches", None) or {}).items():
            counts = total.setdefault(name, {})
            for num_tokens, batches in sizes.items():
                counts[str(num_tokens)] = counts.get(str(num_tokens), 0) + batches
    return total


def nz_weights(model) -> list[str]:
    import sys

    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return []
    return sorted(name for name, p in model.named_parameters()
                  if p.device.type == "npu" and torch_npu.get_npu_format(p) == 29)


def medusa_rows(runner) -> list[int] | None:
    """The Medusa LM-head rows [first, end) this rank holds (a share under TP), if any."""
    heads = getattr(getattr(runner, "drafter", None), "model", None)
    if not hasattr(heads, "row_offset"):
        return None
    return [heads.row_offset, heads.row_offset + heads.head_weight(0).shape[0]]


def punica_wrappers(runner) -> list[str] | None:
    manager = getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)
    mapping = getattr(manager, "punica_wrapper_mapping", None)
    return sorted({type(w).__name__ for w in mapping.values()}) if mapping else None


def ray_node_ip() -> str | None:
    import sys

    ray = sys.modules.get("ray")
    return ray.util.get_node_ip_address() if ray and ray.is_initialized() else None


def probe_worker(worker) -> dict:
    """Runs inside each worker process: which classes did vLLM actually use?"""
    worker = getattr(worker, "worker", worker)  # collective_rpc hands us the wrapper
    runner = worker.model_runner
    modules = list(runner.get_model().modules())
    import os

    import torch

    return {
        "worker": type(worker).__module__ + "." + type(worker).__name__,
        # enable_cpu_binding: the cores this worker may run on, and torch's pool size.
        "cpu_affinity": sorted(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "model_runner": type(runner).__module__ + "." + type(runner).__name__,
        "proposer_source": getattr(runner, "proposer_source", None),
        "drafter": type(runner.drafter).__name__ if hasattr(runner, "drafter") else None,
        # Counters our proposers keep of their own steps (AscendEagleProposer), if any.
        "drafter_counters": dict(getattr(getattr(runner, "drafter", None), "ascend_counters",
                                         None) or {}),
        "medusa_rows": medusa_rows(runner),
        # With LoRA enabled: the Punica wrapper classes vLLM's LoRA manager uses.
        "punica_wrappers": punica_wrappers(runner),
        "rejection_sampler_source": getattr(runner, "rejection_sampler_source", None),
        "rejection_sampler": type(getattr(runner, "rejection_sampler", None)).__name__,
        "rejection_sampler_calls": getattr(getattr(runner, "rejection_sampler", None),
                                           "num_calls", None),
        # NPU graph replays in this worker (NPUModelRunner), if it counts them.
        "graph_replays": getattr(runner, "graph_replays", None),
        # Per-batch MoE communication under expert parallelism on npu, summed over layers:
        # {method: {num_tokens: batches}} (AscendUnquantizedFusedMoEMethod.moe_comm_batches).
        "moe_comm_batches": moe_comm_batches(modules),
        # Per graph runtime mode (FULL / PIECEWISE): wrappers, graphs captured, replays.
        "graph_counts": getattr(runner, "graph_counts", None),
        # The batch sizes (tokens) captured as graphs.
        "graph_capture_sizes": list(getattr(runner.compilation_config,
                                            "cudagraph_capture_sizes", None) or []),
        "kv_block_size": runner.cache_config.block_size,
        # Under the Ray executor: the IP of the Ray node this worker runs on.
        "ray_node_ip": ray_node_ip(),
        # weight_nz_mode: the parameters whose storage torch_npu reports as FRACTAL_NZ.
        "nz_weights": nz_weights(runner.get_model()),
        "layer_classes": sorted({type(m).__name__ for m in modules
                                 if type(m).__name__.startswith(("Ascend", "RMSNorm",
                                                                 "SiluAndMul"))}),
    }


def spec_decode_metrics(llm) -> dict:
    """vLLM's own speculative-decoding counters (summed over engines), when stats are on.

    Needs ``"disable_log_stats": False`` in ``llm``; e.g. ``vllm:spec_decode_num_drafts``,
    ``vllm:spec_decode_num_accepted_tokens``, ``vllm:spec_decode_num_accepted_tokens_per_pos``.
    """
    if not getattr(llm.llm_engine, "log_stats", False):
        return {}
    counters: dict = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:spec_decode"):
            continue
        if hasattr(metric, "values"):  # the per-position vector
            old = counters.get(metric.name, [0] * len(metric.values))
            counters[metric.name] = [a + b for a, b in zip(old, metric.values)]
        elif hasattr(metric, "value"):
            counters[metric.name] = counters.get(metric.name, 0) + metric.value
    return counters


def score(llm, sequences: list[list[int]]) -> dict:
    """Teacher-forced: the logprob the model gives each token of each sequence (from the
    second on), whatever it would have chosen itself."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in sequences], params,
                           use_tqdm=False)
    return {"token_logprobs": [[position[token].logprob
                                for token, position in zip(ids[1:], out.prompt_logprobs[1:],
                                                           strict=True)]
                               for ids, out in zip(sequences, outputs, strict=True)]}


def lora_requests(lora: dict | None) -> list | None:
    """One LoRARequest (or None: the base model) per prompt, from ``{"adapters": {name:
    folder}, "per_prompt": [name or None, ...]}``; ids follow the adapters' order."""
    if not lora:
        return None
    from vllm.lora.request import LoRARequest

    made = {name: LoRARequest(name, number, path)
            for number, (name, path) in enumerate(lora["adapters"].items(), start=1)}
    return [made[name] if name else None for name in lora["per_prompt"]]


def sampling_params(options: dict):
    from vllm import SamplingParams

    options = dict(options)
    if "structured_outputs" in options:  # e.g. {"choice": ["yes", "no"]}
        from vllm.sampling_params import StructuredOutputsParams

        options["structured_outputs"] = StructuredOutputsParams(**options["structured_outputs"])
    return SamplingParams(**options)


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM
    from vllm.platforms import current_platform

    llm_kwargs = dict(dtype="float32", max_model_len=512, enforce_eager=True,
                      gpu_memory_utilization=0.05, seed=0)
    llm_kwargs.update(args.get("llm", {}))
    llm = LLM(model=args["model"], **llm_kwargs)
    if "score" in args:
        print("RESULT " + json.dumps(score(llm, args["score"])), flush=True)
        return
    # "sampling" overrides these SamplingParams (e.g. {"temperature": 0.8, "seed": 7}), and
    # "per_prompt_sampling" (a dict or None per prompt) overrides "sampling" prompt by prompt.
    sampling = args.get("sampling", {})
    per_prompt = args.get("per_prompt_sampling") or [None] * len(args["prompts"])
    params = [sampling_params({"temperature": 0.0, "max_tokens": args.get("max_tokens", 16),
                               "ignore_eos": True, **sampling, **(own or {})})
              for own in per_prompt]
    outputs = llm.generate(args["prompts"], params, use_tqdm=False,
                           lora_request=lora_requests(args.get("lora")))
    result = {
        "platform": type(current_platform).__module__ + "." + type(current_platform).__name__,
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "texts": [out.outputs[0].text for out in outputs],
        "prompt_token_ids": [list(out.prompt_token_ids) for out in outputs],
        "workers": llm.collective_rpc(probe_worker),
    }
    if params[0].logprobs:
        # Per prompt, per generated position: {token id: logprob} of the top candidates.
        result["logprobs"] = [[{str(token): entry.logprob for token, entry in position.items()}
                               for position in out.outputs[0].logprobs] for out in outputs]
    if args.get("score_own"):  # the prompts with their greedy continuations, teacher-forced
        result.update(score(llm, [p + c for p, c in zip(result["prompt_token_ids"],
                                                        result["token_ids"], strict=True)]))
    metrics = spec_decode_metrics(llm)
    if metrics:
        result["metrics"] = metrics
    if args.get("acceptance_summary"):
        # ascend_specdec's helper applied to LLM.get_metrics() itself, in this process.
        from ascend_specdec.metrics import acceptance_summary

        result["acceptance_summary"] = acceptance_summary(llm.get_metrics())
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
