"""The host target's model runner: vLLM's CPU runner plus the plugin's hooks."""

from __future__ import annotations

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from ascend_core.lora.checks import CheckedLoRARunnerMixin
from ascend_core.worker.speculative import (
    install_registered_proposer,
    install_registered_rejection_sampler,
    vllm_proposer_deferred,
)


class AscendHostModelRunner(CheckedLoRARunnerMixin, CPUModelRunner):
    def __init__(self, vllm_config, device: torch.device):
        with vllm_proposer_deferred(vllm_config):
            super().__init__(vllm_config, device)
        self.proposer_source = install_registered_proposer(self)
        self.rejection_sampler_source = install_registered_rejection_sampler(self)
