"""The vLLM-facing glue of ascend-quant (the only modules here that import vLLM).

``register`` registers the quantization configs with vLLM; ``config`` holds them;
``linear`` and ``moe`` are the per-layer methods that run the schemes; ``detect``
selects the ``ascend`` method for msModelSlim folders.
"""
