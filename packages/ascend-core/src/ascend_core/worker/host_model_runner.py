"""The host target's model runner: vLLM's CPU runner plus the plugin's hooks.

Pipeline parallel: a later stage receives its input activations into a buffer that vLLM's
GPU runner allocates in its dummy run; vLLM's CPU runner runs none in eager mode, so stock
vLLM's CPU pipeline parallel stops at the first step (``assert self.intermediate_tensors is
not None``). This runner allocates the buffer on first use instead.
"""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from ascend_core.lora.checks import CheckedLoRARunnerMixin
from ascend_core.worker.speculative import (
    install_registered_proposer,
    install_registered_rejection_sampler,
    vllm_proposer_deferred,
)
from ascend_core.worker.tree_runner import TreeVerificationRunnerMixin


class AscendHostModelRunner(TreeVerificationRunnerMixin, CheckedLoRARunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        with vllm_proposer_deferred(vllm_config):
            super().__init__(vllm_config, device)
        self.proposer_source = install_registered_proposer(self)
        self.rejection_sampler_source = install_registered_rejection_sampler(self)

    def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors,
                                             sync_self):
        if self.intermediate_tensors is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype,
                device=self.device)
        return super().sync_and_gather_intermediate_tensors(num_tokens, intermediate_tensors,
                                                            sync_self)
