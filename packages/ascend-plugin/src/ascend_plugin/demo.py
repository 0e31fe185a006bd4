"""The main job: serve a model through the plugin on the host target and ask it things.

    python -m ascend_plugin.demo                  # the demo model, built locally
    python -m ascend_plugin.demo --model PATH     # any checkpoint vLLM can load
    python -m ascend_plugin.demo --serve          # keep serving after the requests

The demo model is a tiny random Llama with a tokenizer trained on text from the
Python installation (no download): its answers are fluent-looking noise, but
every token went through vLLM and the plugin.
"""

from __future__ import annotations

import argparse
import sys
import time

from ascend_plugin.serving import chat, complete, running_server

PROMPTS = ["The Python Software Foundation", "def main():"]
CHAT = ["What is an NPU?", "Write a haiku about vLLM."]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="checkpoint folder or name (default: the demo model)")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--max-tokens", type=int, default=24)
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
    if model is None:
        from ascend_plugin.tiny_models import ensure_model

        print("[demo] preparing the demo model (built once, then cached)", flush=True)
        model = str(ensure_model("llama"))
    extra = [a for a in args.server_args if a != "--"]
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
        if args.serve:
            print(f"[demo] serving at {url}; Ctrl-C stops", flush=True)
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    print("[demo] done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
