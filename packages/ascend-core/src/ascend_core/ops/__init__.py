"""vLLM custom ops that route model layers to ascend-kernels."""
