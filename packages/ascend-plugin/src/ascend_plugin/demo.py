"""The main job: serve a model through the plugin on the host target and ask it things.

    python -m ascend_plugin.demo                  # the demo model (models/pycoder-26m)
    python -m ascend_plugin.demo --model PATH     # any checkpoint vLLM can load
    python -m ascend_plugin.demo --serve          # keep serving after the requests
    python -m ascend_plugin.demo --medusa         # with Medusa speculative decoding

The demo model is ``pycoder-26m``: a 26M-parameter Llama code model trained here on the
Python standard library (``tools/train_demo_model.py``; committed under ``models/``, no
download). It continues Python code; a chat message reaches it as a ``# ...`` comment, after
which it writes code. Expect plausible standard-library-style Python, not answers.

With ``--medusa`` the demo model is served with its three Medusa heads
(``models/pycoder-26m-medusa``, self-distilled by ``python -m ascend_specdec.train_medusa`` in
bf16 on standard-library prompts, committed beside it); the demo prints the mean acceptance
length the server measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from ascend_plugin.serving import chat, complete, counter_totals, running_server

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(folder):"]
CHAT = ["Return the sum of the squares of a list of numbers",
        "Read a JSON file and return its contents"]

MEDUSA_HEADS = 3  # the committed heads (models/pycoder-26m-medusa) serve k = 3


def medusa_server_args(heads: str) -> list[str]:
    config = {"method": "medusa", "model": heads, "num_speculative_tokens": MEDUSA_HEADS}
    return ["--speculative-config", json.dumps(config)]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder or name (default: the demo model)")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--medusa", action="store_true",
                        help="serve the demo model with its Medusa heads (k=3)")
    parser.add_argument("--serve", action="store_true",
                        help="keep the server running after the demo requests (Ctrl-C stops)")
    parser.add_argument("--log", default="vllm-demo-server.log",
                        help="where the server's output goes (default: %(default)s)")
    parser.add_argument("server_args", nargs=argparse.REMAINDER,
                        help="after --, arguments passed to vLLM's server as they are")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model
    extra = [a for a in args.server_args if a != "--"]
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
    print(f"[demo] server log: {args.log}", flush=True)
    start = time.monotonic()
    with running_server(model, port=args.port, extra_args=extra, log_path=args.log) as url:
        print(f"[demo] server ready at {url} after {time.monotonic() - start:.0f} s", flush=True)
        for prompt in PROMPTS:
            reply = complete(url, model, prompt, args.max_tokens)
            print(f"\n/v1/completions  prompt: {prompt!r}\n  -> {reply['choices'][0]['text']!r}")
        for message in CHAT:
            reply = chat(url, model, message, args.max_tokens)
            answer = reply["choices"][0]["message"]["content"]
            print(f"\n/v1/chat/completions  user: {message!r}\n  -> {answer!r}")
        print(flush=True)
        if args.medusa:
            print_acceptance(url)
        if args.serve:
            print(f"[demo] serving at {url}; Ctrl-C stops", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
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
    print(f"[demo] Medusa: {int(drafts)} drafts, {int(accepted)} of {int(proposed)} draft "
          f"tokens accepted, mean acceptance length {1 + accepted / drafts:.2f} "
          f"(k={MEDUSA_HEADS})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
