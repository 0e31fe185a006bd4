"""The vLLM-facing glue of ascend-specdec: the only modules here that import vLLM at load time."""
