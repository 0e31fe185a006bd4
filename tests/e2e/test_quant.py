"""Quantized checkpoints served through the plugin on the host target.

Tiny random models (a dense Qwen2 and a Qwen2-MoE, from ascend_plugin.tiny_models) are
quantized at test time: with the compressed-tensors library (ascend_quant.writers) and in
msModelSlim form. Each checkpoint is served by real vLLM with VLLM_ASCEND_TARGET=host in
its own process (this file is also that process's script) and compared with the float
model on the next-token logits of random prompts: top-1 agreement and the largest logit
difference; resident weight bytes are counted inside the worker.

Engine starts are the cost (about 35 s each on 2 cores): each checkpoint starts once per
session and the tests share the results.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from vllm_runs import cores_for, vllm_environment

HERE = Path(__file__).parent
HOST = {"VLLM_ASCEND_TARGET": "host"}
NUM_PROMPTS, PROMPT_LEN = 48, 12
QUANT_WEIGHTS = ("ascend_qweight", "ascend_qweight_int4", "ascend_w13", "ascend_w2")
TEXT_PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Hello, my name is",
                "import os\nimport sys\n"]


# --------------------------------------------------------------------------- engine side


def probe_worker(worker) -> dict:
    """Inside the worker: which methods serve which layers, and resident weight bytes."""
    worker = getattr(worker, "worker", worker)
    model = worker.model_runner.get_model()
    per_scheme: dict[str, dict] = {}
    total = 0
    for module in model.modules():
        params = dict(module.named_parameters(recurse=False))
        total += sum(p.numel() * p.element_size() for p in params.values())
        scheme = getattr(module, "ascend_quant_scheme", None)
        if scheme is None:
            continue
        key = f"{type(module).__name__}:{scheme}"
        entry = per_scheme.setdefault(key, {"layers": 0, "bytes": 0, "weight_bytes": 0,
                                            "numel": 0})
        entry["layers"] += 1
        for name, p in params.items():
            if not name.startswith("ascend_"):
                continue  # the layer's float bias
            size = p.numel() * p.element_size()
            entry["bytes"] += size  # the quantized weight and its scales
            if name in QUANT_WEIGHTS:
                entry["weight_bytes"] += size
        entry["numel"] += module.ascend_quant_logical_numel
    methods = sorted({type(m.quant_method).__name__ for m in model.modules()
                      if getattr(m, "quant_method", None) is not None})
    return {"per_scheme": per_scheme, "param_bytes": total, "methods": methods}


def engine_main(args: dict) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    llm_kwargs = dict(dtype="float32", max_model_len=256, enforce_eager=True,
                      gpu_memory_utilization=0.05, seed=0, max_logprobs=-1,
                      logprobs_mode="raw_logits")
    llm_kwargs.update(args.get("llm", {}))
    llm = LLM(model=args["model"], **llm_kwargs)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(4, vocab, (NUM_PROMPTS, PROMPT_LEN), generator=g).tolist()
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=-1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], one, use_tqdm=False)
    logits = []
    for out in outs:
        entry = out.outputs[0].logprobs[0]
        logits.append([entry[t].logprob for t in range(vocab)])
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    texts = llm.generate(TEXT_PROMPTS, greedy, use_tqdm=False)
    result = {
        "platform": type(current_platform).__module__ + "." + type(current_platform).__name__,
        "quant_config": type(llm.llm_engine.vllm_config.quant_config).__name__,
        "logits": logits,
        "token_ids": [list(o.outputs[0].token_ids) for o in texts],
        "workers": llm.collective_rpc(probe_worker),
    }
    with open(args["out"], "w", encoding="utf-8") as f:
        json.dump(result, f)


# --------------------------------------------------------------------------- test side


def serve(model: str | Path, env: dict | None = None, **llm) -> dict:
    """Run this file as the engine script on ``model``; its result, or fail with its log."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        args = {"model": str(model), "llm": llm, "out": str(out)}
        proc = subprocess.run([sys.executable, __file__, json.dumps(args)], env=vllm_environment(env),
                              capture_output=True, text=True, timeout=900,
                              preexec_fn=cores_for(llm, env))
        if proc.returncode == 0 and out.exists():
            return json.loads(out.read_text())
        raise AssertionError(f"vLLM run failed (exit {proc.returncode}) for {model}:\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}")


def start_failure(model: str | Path, env: dict | None = None, **llm) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        args = {"model": str(model), "llm": llm, "out": str(Path(tmp) / "result.json")}
        proc = subprocess.run([sys.executable, __file__, json.dumps(args)], env=vllm_environment(env),
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0, f"expected a start-up failure, got:\n{proc.stdout[-2000:]}"
    return proc.stdout + proc.stderr


def compare(result: dict, reference: dict) -> dict:
    """Top-1 agreement and largest logit difference against the reference run."""
    import torch

    got = torch.tensor(result["logits"], dtype=torch.float64)
    ref = torch.tensor(reference["logits"], dtype=torch.float64)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    diff = (got - ref).abs()
    centred_got = got - got.mean(-1, keepdim=True)
    centred_ref = ref - ref.mean(-1, keepdim=True)
    corr = (centred_got * centred_ref).sum(-1) / (centred_got.norm(dim=-1)
                                                  * centred_ref.norm(dim=-1))
    return {"top1": agree, "max_diff": diff.max().item(), "mean_diff": diff.mean().item(),
            "logit_range": ref.abs().max().item(), "min_corr": corr.min().item()}


def report(name: str, stats: dict) -> None:
    print(f"\n[quant e2e] {name}: top-1 agreement {stats['top1']:.3f}, largest logit "
          f"difference {stats['max_diff']:.4f} (mean {stats['mean_diff']:.4f}, logits up "
          f"to {stats['logit_range']:.2f}), logit correlation min {stats['min_corr']:.4f}")


# --------------------------------------------------------------------------- checkpoints


def _groups(*spec):
    from ascend_quant.writers import Group

    return [Group(*args, **kw) for args, kw in spec]


def _dense_checkpoints() -> dict:
    """name -> (format, groups, extra writer args) of the dense-model checkpoints."""
    return {
        "ct_w8a16": ("ct", _groups(((r".*_proj", "W8A16"), {}))),
        "ct_w8a8_dynamic": ("ct", _groups(((r".*_proj", "W8A8_DYNAMIC"), {}))),
        "ct_w4a16": ("ct", _groups(((r".*_proj", "W4A16"), {"group_size": 32}))),
        "ct_mixed": ("ct", _groups(
            ((r".*self_attn\.[qkv]_proj", "W8A8"), {}),
            ((r".*o_proj", "W4A8_DYNAMIC"), {"group_size": 32, "packed": True}),
            ((r".*(gate|up)_proj", "W4A4_DYNAMIC"), {}),
            ((r".*down_proj", "W8A8_DYNAMIC"), {}))),
        "ct_fused_mismatch": ("ct", _groups(
            ((r".*self_attn\.[qk]_proj", "W8A8_DYNAMIC"), {}),
            ((r".*v_proj", "W8A16"), {}),
            ((r".*_proj", "W8A8_DYNAMIC"), {}))),
        "ms_mixed": ("ms", _groups(
            ((r".*self_attn\.[qkv]_proj", "W8A8"), {}),
            ((r".*o_proj", "W8A16"), {}),
            ((r".*(gate|up)_proj", "W8A8_DYNAMIC"), {}),
            ((r".*down_proj", "W4A8_DYNAMIC"), {}))),
    }


def write(kind: str, src: Path, out: Path, groups) -> Path:
    from ascend_quant.writers import write_compressed_tensors, write_modelslim

    if not (out / "config.json").exists():
        if kind == "ct":
            write_compressed_tensors(src, out, groups)
        else:
            write_modelslim(src, out, groups, group_size=32)
    return out


class Runs:
    """Each configuration served once per session, on first use."""

    def __init__(self, root: Path) -> None:
        from ascend_plugin.tiny_models import ensure_model

        self.root = root
        self.dense = ensure_model("qwen2")
        self.moe = ensure_model("qwen2_moe")
        self.results: dict[str, dict] = {}

    def checkpoint(self, name: str) -> Path:
        if name.startswith("moe_"):
            kind = name.split("_")[1]
            from ascend_quant.writers import Group

            return write(kind, self.moe, self.root / name, [Group(r".*_proj", "W8A8_DYNAMIC")])
        kind, groups = _dense_checkpoints()[name]
        return write(kind, self.dense, self.root / name, groups)

    def get(self, key: str, make) -> dict:
        if key not in self.results:
            self.results[key] = make()
        return self.results[key]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("quant-checkpoints"))


@pytest.fixture(scope="module")
def float_dense(runs):
    return runs.get("float", lambda: serve(runs.dense, HOST))


@pytest.fixture(scope="module")
def float_moe(runs):
    return runs.get("float_moe", lambda: serve(runs.moe, HOST))


def served(runs, name: str, **llm) -> dict:
    return runs.get(name, lambda: serve(runs.checkpoint(name), HOST, **llm))


def methods(result: dict) -> set[str]:
    (worker,) = result["workers"]
    return set(worker["methods"])


def per_scheme(result: dict) -> dict:
    (worker,) = result["workers"]
    return worker["per_scheme"]


# --------------------------------------------------------------------------- tests


def test_w8a8_dynamic_equals_stock_vllm(runs, float_dense):
    """Our int8 GEMM sums exactly on every CPU; stock vLLM's CPU int8 kernel (oneDNN) does
    only where the CPU has VNNI: without it, pairs of products saturate in int16. So the
    plugin equals stock where stock is exact, and is never less faithful to the float
    model than stock. On CPUs with AMX stock vLLM cannot serve this float32 checkpoint."""
    import torch

    from ascend_kernels.quant import _cpu_int_mm_is_exact

    plugin = served(runs, "ct_w8a8_dynamic")
    assert plugin["platform"].endswith("AscendHostPlatform")
    assert plugin["quant_config"] == "AscendCompressedTensorsConfig"
    assert "AscendQuantLinearMethod" in methods(plugin)
    ours = compare(plugin, float_dense)
    report("W8A8_DYNAMIC vs float", ours)
    assert ours["top1"] >= 0.85 and ours["min_corr"] > 0.98
    if torch.cpu._is_amx_tile_supported():
        # With AMX, stock vLLM takes its AMX int8 kernel (vLLM's check_cpu_sgl_kernel), which
        # takes bfloat16 / float16 activations only: this float32 model does not run there.
        output = start_failure(runs.checkpoint("ct_w8a8_dynamic"), {})
        assert "int8_scaled_mm_with_quant: expect A to be bfloat16 or half" in output
        return
    stock = runs.get("stock_w8a8_dynamic",
                     lambda: serve(runs.checkpoint("ct_w8a8_dynamic"), {}))
    assert stock["quant_config"] == "CompressedTensorsConfig"
    theirs = compare(stock, float_dense)
    report("stock vLLM's W8A8_DYNAMIC vs float", theirs)
    assert ours["top1"] >= theirs["top1"] and ours["max_diff"] <= theirs["max_diff"] + 1e-3
    same = compare(plugin, stock)
    report("W8A8_DYNAMIC plugin vs stock vLLM", same)
    if _cpu_int_mm_is_exact():  # oneDNN's int8 GEMM is exact here: so is stock
        assert same["top1"] == 1.0 and same["max_diff"] < 1e-3


def dequantized(runs, name: str) -> dict:
    """The float model a weight-only checkpoint stands for, served unquantized."""
    from ascend_quant.writers import write_dequantized_compressed_tensors

    def make():
        out = runs.root / f"{name}_dequantized"
        if not (out / "config.json").exists():
            write_dequantized_compressed_tensors(runs.checkpoint(name), out)
        return serve(out, HOST)

    return runs.get(f"{name}_dequantized", make)


@pytest.mark.parametrize("name", ["ct_w8a16", "ct_w4a16"])
def test_weight_only_schemes_equal_their_dequantized_float_model(runs, name):
    """No stock vLLM path on CPU for these (W8A16 at all, W4A16 in float32), so the
    reference is the float model of the dequantized weights: the scheme may only add
    float rounding."""
    stats = compare(served(runs, name), dequantized(runs, name))
    report(f"{name} vs its dequantized float model", stats)
    assert stats["top1"] == 1.0 and stats["max_diff"] < 1e-3


def test_w8a16_stays_near_bfloat16_noise(runs, float_dense):
    bf16 = runs.get("bf16", lambda: serve(runs.dense, HOST, dtype="bfloat16"))
    w8a16 = served(runs, "ct_w8a16")
    noise = compare(bf16, float_dense)
    stats = compare(w8a16, float_dense)
    report("bfloat16 vs float32 (the noise floor)", noise)
    report("W8A16 (per channel, min-max) vs float32", stats)
    # Per-channel int8 rounding of this random model's weights moves its logits about
    # twice as far as bfloat16 rounding of weights and activations does.
    assert stats["max_diff"] <= 2.5 * noise["max_diff"]
    assert stats["mean_diff"] <= 2.5 * noise["mean_diff"]
    assert stats["top1"] >= 0.9 and stats["min_corr"] > 0.99


def test_stock_vllm_has_no_w8a16_path_on_cpu(runs):
    output = runs.get("stock_w8a16", lambda: {"log": start_failure(
        runs.checkpoint("ct_w8a16"), {})})["log"]
    assert "Failed to find a kernel that can implement the WNA16 linear layer" in output


def test_w4a16_in_float32(runs, float_dense):
    result = served(runs, "ct_w4a16")
    stats = compare(result, float_dense)
    report("W4A16 (group 32) vs float", stats)
    # int4 rounding of a random 2-layer model with large weights: far from float, but
    # the scheme itself is exact (the dequantized-model test above).
    assert stats["min_corr"] > 0.5


@pytest.mark.parametrize("name", ["ct_mixed", "ms_mixed"])
def test_mixed_schemes(runs, float_dense, name):
    llm = {"quantization": "ascend"} if name.startswith("ms_") else {}
    result = served(runs, name, **llm)
    want = {"ct_mixed": {"QKVParallelLinear:W8A8", "RowParallelLinear:W4A8_DYNAMIC",
                         "MergedColumnParallelLinear:W4A4_DYNAMIC",
                         "RowParallelLinear:W8A8_DYNAMIC"},
            "ms_mixed": {"QKVParallelLinear:W8A8", "RowParallelLinear:W8A16",
                         "MergedColumnParallelLinear:W8A8_DYNAMIC",
                         "RowParallelLinear:W4A8_DYNAMIC"}}[name]
    assert set(per_scheme(result)) == want
    assert all(len(ids) == 16 for ids in result["token_ids"])
    stats = compare(result, float_dense)
    report(f"{name} vs float", stats)
    assert stats["min_corr"] > {"ct_mixed": 0.75, "ms_mixed": 0.93}[name]


def test_tensor_parallel_2_equals_1(runs):
    """Sharded int4 weights (packed words split along the input of o_proj and down_proj,
    grouped scales and zero-free packing along the output of qkv and gate_up) give the
    TP=1 logits. A weight-only scheme, so the ranks' partial sums are the only change
    (activation-quantized schemes quantize each rank's input slice with its own scale,
    a different, finer quantization)."""
    tp1 = served(runs, "ct_w4a16")
    tp2 = runs.get("ct_w4a16_tp2", lambda: serve(
        runs.checkpoint("ct_w4a16"), {**HOST, "VLLM_CPU_OMP_THREADS_BIND": "0|1"},
        tensor_parallel_size=2))
    assert len(tp2["workers"]) == 2
    stats = compare(tp2, tp1)
    report("W4A16 at TP=2 vs TP=1", stats)
    assert stats["top1"] == 1.0 and stats["max_diff"] < 1e-3


BITS = {"W8A8": 8, "W8A8_DYNAMIC": 8, "W8A16": 8, "W4A16": 4, "W4A8_DYNAMIC": 4,
        "W4A4_DYNAMIC": 4}


def test_resident_weight_memory(runs):
    seen = {}
    for name in ("ct_w8a16", "ct_w4a16", "ct_mixed", "ms_mixed"):
        llm = {"quantization": "ascend"} if name.startswith("ms_") else {}
        for key, entry in per_scheme(served(runs, name, **llm)).items():
            bits = BITS[key.split(":")[1]]
            # The quantized weights take bits/16 of their bfloat16 size exactly...
            assert entry["weight_bytes"] * 8 == entry["numel"] * bits, (name, key, entry)
            # ...and the scales add at most an eighth on top (group 32, float32 scales).
            ratio = entry["bytes"] / (2 * entry["numel"])
            assert ratio <= bits / 16 * 1.26, (name, key, ratio)
            seen[f"{name} {key}"] = ratio
    for key, ratio in sorted(seen.items()):
        print(f"[quant e2e] resident bytes / bf16 bytes, {key}: {ratio:.3f} "
              f"({1 / ratio:.2f}x smaller)")


@pytest.mark.parametrize("fmt", ["ct", "ms"])
def test_moe_experts_w8a8_int8(runs, float_moe, fmt):
    llm = {"quantization": "ascend"} if fmt == "ms" else {}
    result = served(runs, f"moe_{fmt}", **llm)
    assert "AscendQuantMoEMethod" in methods(result)
    # vLLM's RoutedExperts, or a subclass a sibling package put in its place.
    (entry,) = [e for key, e in per_scheme(result).items()
                if key.endswith("RoutedExperts:W8A8_DYNAMIC")]
    assert entry["weight_bytes"] == entry["numel"]  # int8: half of bfloat16
    stats = compare(result, float_moe)
    report(f"MoE {fmt} W8A8_DYNAMIC (experts and linear) vs float", stats)
    assert stats["top1"] >= 0.75 and stats["min_corr"] > 0.96


def test_moe_formats_agree(runs):
    """Both writers quantize the same way (symmetric min-max per channel), so the two
    formats' independent loading paths must give the same logits."""
    ct = served(runs, "moe_ct")
    ms = served(runs, "moe_ms", quantization="ascend")
    same = compare(ct, ms)
    report("MoE compressed-tensors vs msModelSlim", same)
    assert same["top1"] == 1.0 and same["max_diff"] < 1e-4


def test_unsupported_scheme_fails_at_start_up_naming_the_layer(runs):
    src = runs.checkpoint("ct_w8a8_dynamic")
    bad = runs.root / "ct_fp8"
    if not bad.exists():
        import shutil

        shutil.copytree(src, bad)
        config = json.loads((bad / "config.json").read_text())
        group = config["quantization_config"]["config_groups"]["group_0"]
        group["weights"]["type"] = "float"
        group["input_activations"]["type"] = "float"
        (bad / "config.json").write_text(json.dumps(config))
    output = start_failure(bad, HOST)
    assert "QuantConfigError" in output and "is not supported: float weights" in output
    assert "'model.layers.0.self_attn.q_proj'" in output and "Supported: W8A8:" in output


def test_fused_shards_with_different_schemes_fail_at_start_up(runs):
    output = start_failure(runs.checkpoint("ct_fused_mismatch"), HOST)
    assert "'model.layers.0.self_attn.qkv_proj' fuses shards quantized differently" in output
    assert "v_proj: W8A16" in output


def test_description_not_matching_the_weights_fails_at_start_up(runs):
    src = runs.checkpoint("ms_mixed")
    bad = runs.root / "ms_missing_scale"
    if not bad.exists():
        import shutil

        from safetensors.torch import save_file

        from ascend_quant.writers import read_tensors

        shutil.copytree(src, bad)
        tensors = read_tensors(bad)
        del tensors["model.layers.1.self_attn.k_proj.deq_scale"]
        save_file(tensors, str(bad / "model.safetensors"))
    output = start_failure(bad, HOST, quantization="ascend")
    assert "does not match the checkpoint's weights" in output
    assert "described but not in the checkpoint: model.layers.1.self_attn.k_proj.deq_scale" \
        in output


def test_modelslim_folder_is_detected_without_quantization_argument(runs, float_dense):
    """The platform's config hook (ascend_quant.vllm.detect, through core's CONFIG_HOOKS)
    selects the method: vLLM builds the quantization config before that hook runs."""
    result = runs.get("ms_detected", lambda: serve(runs.checkpoint("ms_mixed"), HOST))
    assert result["quant_config"] == "AscendModelSlimConfig"


if __name__ == "__main__":
    engine_main(json.loads(sys.argv[1]))
