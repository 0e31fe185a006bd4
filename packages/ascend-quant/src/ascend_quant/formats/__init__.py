"""Checkpoint formats: compressed-tensors configs and msModelSlim descriptions (no vLLM)."""
