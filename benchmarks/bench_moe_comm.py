"""Which MoE token communication each batch took under expert parallelism (counts, not speed).

Two tiny Qwen3-MoEs (top-1 routing over 8 experts, two layers), hidden size 128 and 1024, on
two reference NPUs (``tensor_parallel_size=2, enable_expert_parallel=True``, the npu target
on the reference torch_npu: HCCL is gloo underneath, so no timing here means anything). For
1, 16 and 64 concurrent prompts, the workers count every MoE forward by its path and its
batch's token count: MC2 (torch_npu's ``npu_moe_distribute_dispatch_v2`` / ``_combine_v2``)
where it serves the layer (hidden size 1024, not 128) and the batch (at most 512 tokens per
rank's share), else all-gather or all-to-all from the token count against
``VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS``. The tables list, per load, the batch sizes each path
served.

Results: ``benchmarks/results/moe_comm.json`` and ``moe_comm.md``.

    python benchmarks/bench_moe_comm.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "e2e"))  # the e2e tests' engine runner

from vllm_runs import PROMPTS, run_vllm  # noqa: E402

RESULTS = Path(__file__).parent / "results"
LOADS = (1, 16, 64)
REFERENCE = str(ROOT / "testing" / "reference_torch_npu")
NPU = {"VLLM_ASCEND_TARGET": "npu", "TORCH_NPU_REFERENCE_DEVICE_COUNT": "2",
       "TORCH_NPU_REFERENCE_TOTAL_MEMORY": str(1 << 32),
       "PYTHONPATH": os.pathsep.join([REFERENCE, os.environ.get("PYTHONPATH", "")])}


MODELS = {
    "tiny qwen3_moe (top-1 of 8 experts, 2 layers, hidden 128), bf16": {},
    "tiny qwen3_moe (top-1 of 8 experts, 2 layers, hidden 1024), bf16":
        {"hidden_size": 1024, "num_heads": 16, "num_kv_heads": 4},
}


def count_paths(model: str) -> dict:
    loads = {}
    for n in LOADS:
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(n)]
        print(f"[bench_moe_comm] {Path(model).name}: {n} concurrent prompts", flush=True)
        result = run_vllm({"model": model, "prompts": prompts, "max_tokens": 16,
                           "llm": {"dtype": "bfloat16", "gpu_memory_utilization": 0.2,
                                   "tensor_parallel_size": 2, "enable_expert_parallel": True,
                                   "distributed_executor_backend": "mp"}}, NPU)
        ranks = [worker["moe_comm_batches"] for worker in result["workers"]]
        assert ranks[0] == ranks[1], "the two ranks took different paths"
        loads[str(n)] = {method: {int(k): v for k, v in sizes.items()}
                         for method, sizes in ranks[0].items() if sizes}
    return loads


def main() -> int:
    from ascend_core import envs
    from ascend_plugin.tiny_models import ensure_model

    models = {name: count_paths(str(ensure_model("qwen3_moe", num_experts_per_tok=1, **kw)))
              for name, kw in MODELS.items()}
    results = {"all2all_min_tokens": envs.VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS,
               "models": models}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "moe_comm.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "moe_comm.md").write_text(markdown(results))
    print((RESULTS / "moe_comm.md").read_text())
    return 0


def markdown(results: dict) -> str:
    lines = [
        "# MoE token communication per batch under expert parallelism (npu target, reference)",
        "",
        "TP 2 with expert parallelism on two reference NPUs. Written by "
        "`benchmarks/bench_moe_comm.py`. Counts of MoE forwards (summed over the layers and "
        "the engine's own profiling and warm-up runs) by path and by the batch's token count "
        "(each rank dispatches its half); MC2 where it serves the layer (hidden size 1024-7168) "
        "and the batch (at most 512 tokens per rank), otherwise "
        f"`VLLM_ASCEND_MOE_ALL2ALL_MIN_TOKENS`: {results['all2all_min_tokens']}.",
    ]
    for model, loads in results["models"].items():
        lines += ["", f"## {model}", "", "| concurrent prompts | path | batch tokens: forwards |",
                  "|---|---|---|"]
        for n, methods in loads.items():
            for method, sizes in sorted(methods.items()):
                shown = ", ".join(f"{k}: {v}" for k, v in sorted(sizes.items(),
                                                                 key=lambda kv: int(kv[0])))
                lines.append(f"| {n} | {method} | {shown} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
