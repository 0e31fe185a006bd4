"""Distributed communication of the npu target (HCCL through torch.distributed)."""
