"""The demo's command line: where its log goes, which name its requests use."""

from ascend_plugin.demo import parse_args, served_name


def test_log_goes_under_the_cache_folder_never_the_working_directory(monkeypatch, tmp_path,
                                                                     capsys):
    from ascend_plugin import demo

    monkeypatch.setenv("HOME", str(tmp_path))

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(demo, "running_server", stop)
    try:
        demo.main(["--model", "/m"])
    except Stop:
        pass
    log = tmp_path / ".cache" / "ascend-plugin" / "demo-server.log"
    assert f"[demo] server log: {log}" in capsys.readouterr().out
    assert log.parent.is_dir()
    assert parse_args([]).log is None  # DEFAULT_LOG is taken when the demo runs


def test_requests_use_the_served_model_name_given_to_vllm():
    assert served_name("/m", []) == "/m"
    assert served_name("/m", ["--dtype", "bfloat16"]) == "/m"
    assert served_name("/m", ["--served-model-name", "coder", "--dtype", "bf16"]) == "coder"
    assert served_name("/m", ["--served-model-name=coder"]) == "coder"


def test_vllm_flags_after_the_double_dash_reach_the_server():
    args = parse_args(["--port", "8011", "--", "--served-model-name", "coder"])
    assert args.port == 8011
    assert [a for a in args.server_args if a != "--"] == ["--served-model-name", "coder"]
