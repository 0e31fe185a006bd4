"""vLLM platforms of the plugin: ``npu`` (AscendPlatform) and ``host`` (AscendHostPlatform)."""
