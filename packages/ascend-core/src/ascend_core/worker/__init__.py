"""Workers and model runners for the npu and host targets."""
