"""vLLM platforms of the plugin: ``npu`` (AscendPlatform) and ``host`` (AscendHostPlatform)."""


def active_target() -> str | None:
    """"npu" or "host" while vLLM's current platform is one of the plugin's, else None.

    Looked up on the platform's class: vLLM's ``Platform.__getattr__`` logs a warning
    ("Current platform cpu does not have 'ascend_target' attribute") for an attribute that
    another platform lacks, and the plugin must not show in stock vLLM's output.
    """
    from vllm.platforms import current_platform

    return getattr(type(current_platform), "ascend_target", None)
