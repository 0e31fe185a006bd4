"""The main job: serve a model through the plugin on the host target and ask it things.

    python -m ascend_plugin.demo                  # the demo model (models/pycoder-26m)
    python -m ascend_plugin.demo --model PATH     # any checkpoint vLLM can load
    python -m ascend_plugin.demo --serve          # keep serving after the requests
    python -m ascend_plugin.demo --medusa         # with Medusa speculative decoding
    python -m ascend_plugin.demo --pd             # prefill/decode disaggregation (1P1D)

The demo model is ``pycoder-26m``: a 26M-parameter Llama code model trained here on the
Python standard library (``tools/train_demo_model.py``; committed under ``models/``, no
download). It continues Python code; a chat message reaches it as a ``# ...`` comment, after
which it writes code. Expect plausible standard-library-style Python, not answers.

With ``--medusa`` the demo model is served with its three Medusa heads
(``models/pycoder-26m-medusa``, self-distilled by ``python -m ascend_specdec.train_medusa`` in
bf16 on standard-library prompts, committed beside it); the demo prints the mean acceptance
length the server measured and the mean draft length the draft-length controller chose.

With ``--pd`` it starts a prefill and a decode instance (MooncakeConnectorV1 over TCP on
127.0.0.1, each pinned to its own CPU when there are two) and the proxy, sends the same
requests to the proxy and prints how many prompts' KV blocks the decode instance pulled.

The server: vLLM's OpenAI server on 127.0.0.1, on ``--port`` (default: a free port, printed
when the server is ready), with ``--max-model-len 1024`` and a 1 GiB KV cache
(``VLLM_CPU_KVCACHE_SPACE=1``; set the variable to change it). Its output goes to ``--log``
(default: ``~/.cache/ascend-plugin/demo-server.log``, beside the tiny models' cache; the
--pd demo writes its three logs beside it). vLLM's own flags
go after ``--`` (``-- --served-model-name NAME --dtype bfloat16``); the demo's requests use
the served name.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ascend_plugin.serving import chat, complete, counter_totals, histogram_counts, running_server
from ascend_specdec.metrics import DRAFT_LENGTH

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(folder):"]
CHAT = ["Return the sum of the squares of a list of numbers",
        "Read a JSON file and return its contents"]

MEDUSA_HEADS = 3  # the committed heads (models/pycoder-26m-medusa) serve k = 3


# In the plugin's cache folder (where tiny_models keeps its models), never the checkout.
DEFAULT_LOG = "~/.cache/ascend-plugin/demo-server.log"


def served_name(model: str, server_args: list[str]) -> str:
    """The model name the server answers to: vLLM's --served-model-name (its first name)
    when given after --, else the model path."""
    for i, arg in enumerate(server_args):
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
        if arg == "--served-model-name" and i + 1 < len(server_args):
            return server_args[i + 1]
    return model


def medusa_server_args(heads: str) -> list[str]:
    config = {"method": "medusa", "model": heads, "num_speculative_tokens": MEDUSA_HEADS}
    return ["--speculative-config", json.dumps(config)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder or name (default: the demo model)")
    parser.add_argument("--port", type=int, default=None,
                        help="the server's port (default: a free one, printed when ready)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--medusa", action="store_true",
                        help="serve the demo model with its Medusa heads (k=3)")
    parser.add_argument("--pd", action="store_true",
                        help="prefill/decode disaggregation: a prefill and a decode instance "
                             "behind ascend_plugin.pd_proxy (needs ascend-plugin[pd-host])")
    parser.add_argument("--serve", action="store_true",
                        help="keep the server running after the demo requests (Ctrl-C stops)")
    parser.add_argument("--log", default=None,
                        help=f"where the server's output goes (default: {DEFAULT_LOG})")
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="after --, arguments passed to vLLM's server as they are")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model
    extra = [a for a in args.server_args if a != "--"]
    if args.medusa and args.pd:
        print("[demo] error: --medusa and --pd are separate demos: pick one", file=sys.stderr)
        return 2
    if args.medusa and model is not None:
        print("[demo] error: --medusa serves the demo model with its own heads; for your "
              f"model ({model}) train heads with `python -m ascend_specdec.train_medusa` "
              "and pass them after -- as --speculative-config", file=sys.stderr)
        return 2
    if model is None:
        from ascend_plugin.demo_model import DemoModelError, demo_medusa_dir, demo_model_dir

        try:
            model = str(demo_model_dir())
            if args.medusa:
                extra = medusa_server_args(str(demo_medusa_dir())) + extra
        except DemoModelError as err:
            print(f"[demo] error: {err}", file=sys.stderr)
            return 2
    print(f"[demo] starting vLLM's OpenAI server through the plugin (host target) on {model}",
          flush=True)
    args.log = os.path.abspath(os.path.expanduser(args.log or DEFAULT_LOG))
    os.makedirs(os.path.dirname(args.log), exist_ok=True)
    print(f"[demo] server log: {args.log}", flush=True)
    name = served_name(model, extra)
    start = time.monotonic()
    if args.pd:
        return run_pd_demo(args, model, extra, start, name)
    with running_server(model, port=args.port, extra_args=extra, log_path=args.log) as url:
        print(f"[demo] server ready at {url} after {time.monotonic() - start:.0f} s", flush=True)
        ask_everything(url, name, args.max_tokens)
        if args.medusa:
            print_acceptance(url)
        serve_until_interrupted(url, args.serve)
    print("[demo] done", flush=True)
    return 0


def ask_everything(url: str, model: str, max_tokens: int) -> None:
    for prompt in PROMPTS:
        reply = complete(url, model, prompt, max_tokens)
        print(f"\n/v1/completions  prompt: {prompt!r}\n  -> {reply['choices'][0]['text']!r}")
    for message in CHAT:
        reply = chat(url, model, message, max_tokens)
        answer = reply["choices"][0]["message"]["content"]
        print(f"\n/v1/chat/completions  user: {message!r}\n  -> {answer!r}")
    print(flush=True)


def serve_until_interrupted(url: str, serve: bool) -> None:
    if not serve:
        return
    print(f"[demo] serving at {url}; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def run_pd_demo(args: argparse.Namespace, model: str, extra: list[str], start: float,
                name: str) -> int:
    from ascend_plugin.pd_serving import running_pd

    cpus = sorted(os.sched_getaffinity(0))
    pinned = (str(cpus[0]), str(cpus[1])) if len(cpus) >= 2 else None
    log_dir = os.path.dirname(args.log)
    with running_pd(model, log_dir, extra_args=extra, cpus=pinned) as pd:
        print(f"[demo] prefill {pd.prefill}, decode {pd.decode}, proxy {pd.proxy} ready after "
              f"{time.monotonic() - start:.0f} s (logs: {pd.prefill_log}, {pd.decode_log}, "
              f"{pd.proxy_log})", flush=True)
        ask_everything(pd.proxy, name, args.max_tokens)
        names = ("vllm:ascend_pd_pulls", "vllm:ascend_pd_failed_pulls")
        totals = counter_totals(pd.decode, names)
        print(f"[demo] PD: the decode instance pulled the KV blocks of "
              f"{int(totals[names[0]])} prompts from the prefill instance "
              f"({int(totals[names[1]])} pulls failed and were recomputed)", flush=True)
        serve_until_interrupted(pd.proxy, args.serve)
    print("[demo] done", flush=True)
    return 0


def print_acceptance(url: str) -> None:
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens",
             "vllm:spec_decode_num_draft_tokens")
    totals = counter_totals(url, names)
    drafts, accepted, proposed = (totals[name] for name in names)
    if drafts == 0:
        print("[demo] Medusa: the server reports no drafts", flush=True)
        return
    # With the draft-length controller on, each step gets 0 to k drafts.
    print(f"[demo] Medusa: {int(drafts)} drafts, {int(accepted)} of {int(proposed)} draft "
          f"tokens accepted, mean acceptance length {1 + accepted / drafts:.2f} "
          f"({proposed / drafts:.2f} draft tokens per draft, at most k={MEDUSA_HEADS})",
          flush=True)
    lengths = histogram_counts(url, DRAFT_LENGTH)
    print("[demo] draft lengths requests were verified with (requests x steps): "
          + ", ".join(f"{length}: {n}" for length, n in sorted(lengths.items())), flush=True)


if __name__ == "__main__":
    sys.exit(main())
