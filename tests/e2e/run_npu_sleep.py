"""Sleep and wake an npu-target engine between generations, in its own process, and print a
JSON result: the tokens of each generation and the worker's memory numbers at each stage.

    python run_npu_sleep.py '{"model": "...", "prompts": [...], "max_tokens": 16, "llm": {...}}'

Stages: generate; sleep(level=1); wake_up(); generate; sleep(level=2); wake_up(["weights"]);
reload_weights; wake_up(["kv_cache"]); generate.
"""

from __future__ import annotations

import json
import sys

from run_llm import probe_worker


def main() -> None:
    args = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    llm = LLM(model=args["model"], enable_sleep_mode=True, **args.get("llm", {}))
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])

    def generate() -> list[list[int]]:
        return [list(out.outputs[0].token_ids) for out in llm.generate(args["prompts"], params)]

    def memory() -> dict:
        (report,) = llm.collective_rpc("npu_memory_report")
        report["graph_replays"] = llm.collective_rpc(probe_worker)[0]["graph_replays"]
        return report

    stages = {"start": memory()}
    tokens = {"before": generate()}
    stages["awake"] = memory()
    llm.sleep(level=1)
    stages["level1_asleep"] = memory()
    llm.wake_up()
    stages["level1_woken"] = memory()
    tokens["after_level1"] = generate()
    stages["after_level1"] = memory()
    llm.sleep(level=2)
    stages["level2_asleep"] = memory()
    llm.wake_up(tags=["weights"])
    llm.collective_rpc("reload_weights")
    stages["level2_weights_reloaded"] = memory()
    llm.wake_up(tags=["kv_cache"])
    stages["level2_woken"] = memory()
    tokens["after_level2"] = generate()
    stages["after_level2"] = memory()
    print("RESULT " + json.dumps({"tokens": tokens, "memory": stages}), flush=True)


if __name__ == "__main__":
    main()
