"""`vllm serve` (the OpenAI server) through the plugin on the host target."""

from __future__ import annotations

import urllib.error

import pytest

from ascend_plugin.serving import chat, complete, post_json, running_server

from vllm_runs import PROMPTS


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with running_server(llama_dir, extra_args=["--dtype", "float32", "--enforce-eager"],
                        env={"VLLM_ASCEND_TARGET": "host"},
                        log_path=str(log)) as url:
        yield url, log


def test_completions_match_offline_greedy(server, llama_dir, plugin_llama):
    url, _ = server
    reply = complete(url, llama_dir, PROMPTS[0], max_tokens=16)
    text = reply["choices"][0]["text"]
    assert reply["usage"]["completion_tokens"] <= 16
    # Same model, same greedy decoding: the server's text is the offline text
    # (or a prefix of it, when the server stops at the end-of-sequence token).
    assert text and plugin_llama["texts"][0].startswith(text)


def test_chat_completions_answer(server, llama_dir):
    url, _ = server
    reply = chat(url, llama_dir, "Hello there", max_tokens=8)
    message = reply["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] >= 1
    assert reply["usage"]["prompt_tokens"] > 2  # the chat template added the role tags


def test_server_runs_on_the_plugin_platform(server):
    _, log = server
    text = log.read_text()
    assert "Ascend plugin active: host target (AscendHostPlatform)" in text
    assert "Unknown vLLM environment variable detected: VLLM_ASCEND_TARGET" not in text


def test_malformed_request_is_rejected_and_server_keeps_serving(server, llama_dir):
    url, _ = server
    with pytest.raises(urllib.error.HTTPError) as err:
        post_json(url + "/v1/completions", {"model": llama_dir, "prompt": "x",
                                             "max_tokens": -3})
    assert 400 <= err.value.code < 500
    assert complete(url, llama_dir, "still there?", max_tokens=2)["choices"][0]["text"]
