"""Multi-LoRA serving: vLLM's LoRA layers on the plugin's kernels (``punica``)."""
