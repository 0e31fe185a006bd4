import io
import json
import subprocess
import sys

import numpy as np
import pytest

from ascend_eplb.cli import main
from ascend_eplb.expert_map import load_expert_map, save_expert_map
from ascend_eplb.policies import default
from ascend_eplb.synthetic import zipf_loads

LOADS = zipf_loads(6, 32, 1.2, seed=0)


def run(*argv):
    out, err = io.StringIO(), io.StringIO()
    code = main([str(a) for a in argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def npy(tmp_path):
    path = tmp_path / "loads.npy"
    np.save(path, LOADS.numpy())
    return path


def test_plan_writes_the_map_and_prints_a_summary(tmp_path, npy):
    out_path = tmp_path / "placement.json"
    code, out, err = run(
        "plan", "--loads", npy, "--ranks", 8, "--nodes", 2, "--groups", 4,
        "--redundant", 16, "--policy", "flashlb", "--out", out_path,
    )
    assert code == 0, err
    placement = load_expert_map(out_path)
    assert placement.phy2log.shape == (6, 48) and placement.num_gpus == 8
    assert placement.metadata["policy"] == "flashlb"
    assert "6 layers, 32 experts, 48 slots on 8 ranks (2 node(s), 4 group(s))" in out
    lines = {line.split("  ")[0]: line for line in out.splitlines()}
    assert "before: round-robin, no redundancy" in lines
    assert "after: flashlb" in lines
    after = float(lines["after: flashlb"].split()[2])
    before = float(lines["before: round-robin, no redundancy"].split()[4])
    assert after > before
    assert "planning time:" in out
    assert f"wrote the placement to {out_path}" in err and "read 6 x 32 loads" in err


def test_json_loads_both_layouts(tmp_path):
    for data in (LOADS.tolist(), {"loads": LOADS.tolist()}):
        path = tmp_path / "loads.json"
        path.write_text(json.dumps(data))
        code, out, err = run("plan", "--loads", path, "--ranks", 4, "--quiet")
        assert code == 0, err
        assert err == ""
        assert "after: default" in out


def test_previous_map_counts_moves_and_bytes(tmp_path, npy):
    previous = tmp_path / "previous.json"
    save_expert_map(previous, default.rebalance_experts(LOADS.flip(-1), 48, 1, 1, 8)[0], 8)
    code, out, err = run(
        "plan", "--loads", npy, "--ranks", 8, "--redundant", 16, "--policy", "swift",
        "--previous", previous, "--expert-bytes", 1000, "--max-moves-per-layer", 4,
    )
    assert code == 0, err
    assert "previous map" in out
    moves_line = next(line for line in out.splitlines() if line.startswith("moves vs previous"))
    moves = int(moves_line.split()[3])
    assert 0 < moves <= 6 * 4
    assert f"{moves * 1000} bytes" in moves_line


def test_progress_for_many_layers(tmp_path):
    path = tmp_path / "loads.npy"
    np.save(path, zipf_loads(70, 16, 1.0, seed=1).numpy())
    code, _, err = run("plan", "--loads", path, "--ranks", 4, "--redundant", 4)
    assert code == 0
    assert "planned layers 1-64 of 70" in err and "planned layers 65-70 of 70" in err


def test_plot(tmp_path, npy):
    png = tmp_path / "loads.png"
    code, _, err = run(
        "plan", "--loads", npy, "--ranks", 8, "--redundant", 8, "--plot", png, "--quiet"
    )
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(monkeypatch, tmp_path, npy):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, _, err = run("plan", "--loads", npy, "--ranks", 8, "--plot", tmp_path / "x.png")
    assert code == 2
    assert "--plot needs matplotlib" in err and "ascend-eplb[plot]" in err
    assert not (tmp_path / "x.png").exists()


def bad_file(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, np.ndarray):
        np.save(path, content, allow_pickle=True)
    else:
        path.write_text(content)
    return path


@pytest.mark.parametrize(
    "make, extra, match",
    [
        (lambda t: t / "missing.npy", [], "cannot read .*missing.npy"),
        (lambda t: bad_file(t, "loads.txt", "1 2 3"), [], "unsupported loads file type '.txt'"),
        (lambda t: bad_file(t, "l.npy", np.ones((2, 3, 4))), [], r"must be 2-D \[layers, experts\], got shape \(2, 3, 4\)"),
        (lambda t: bad_file(t, "l.npy", np.array([[1, "a"]], dtype=object)), [], "not a numeric"),
        (lambda t: bad_file(t, "l.json", "[[1, 2], [3]]"), [], "not a numeric"),
        (lambda t: bad_file(t, "l.json", '{"load": [[1]]}'), [], "needs a 'loads' key"),
        (lambda t: bad_file(t, "l.json", "[[1, 2"), [], "not valid JSON"),
        (lambda t: bad_file(t, "l.json", "[[1, -2]]"), [], "negative"),
        (lambda t: bad_file(t, "l.json", "[[1, NaN]]"), [], "NaN"),
        (lambda t: bad_file(t, "l.npy", np.ones((2, 8))), ["--redundant", "2"], r"num_replicas \(10\) must be divisible by num_gpus \(4\)"),
        (lambda t: bad_file(t, "l.npy", np.ones((2, 8))), ["--policy", "fastlb"], "unknown EPLB policy 'fastlb'.*flashlb"),
        (lambda t: bad_file(t, "l.npy", np.ones((2, 8))), ["--redundant", "-4"], "--redundant must be >= 0"),
        (lambda t: bad_file(t, "l.npy", np.ones((2, 8))), ["--policy", "default", "--threshold", "0.1"], "takes no option 'threshold'"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, make, extra, match):
    import re

    code, out, err = run("plan", "--loads", make(tmp_path), "--ranks", 4, "--quiet", *extra)
    assert code == 2
    assert err.startswith("ascend-eplb: error: ") and err.count("\n") == 1
    assert re.search(match, err), err


def test_previous_of_the_wrong_shape(tmp_path, npy):
    previous = tmp_path / "previous.json"
    save_expert_map(previous, default.rebalance_experts(LOADS, 32, 1, 1, 8)[0], 8)
    code, _, err = run("plan", "--loads", npy, "--ranks", 8, "--redundant", 16, "--previous", previous)
    assert code == 2 and "need [6, 48]" in err
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    code, _, err = run("plan", "--loads", npy, "--ranks", 8, "--previous", broken)
    assert code == 2 and "missing required key" in err


def test_module_entry_point(npy):
    result = subprocess.run(
        [sys.executable, "-m", "ascend_eplb", "plan", "--loads", str(npy), "--ranks", "8", "--quiet"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "after: default" in result.stdout
