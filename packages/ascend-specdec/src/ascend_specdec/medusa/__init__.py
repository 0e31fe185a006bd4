"""Medusa: heads, their checkpoint format, self-distillation training. Imports no vLLM."""

from ascend_specdec.medusa.checkpoint import load_heads, save_heads
from ascend_specdec.medusa.config import MedusaConfigError, MedusaHeadsConfig
from ascend_specdec.medusa.heads import MedusaHeads, last_accepted_rows
from ascend_specdec.medusa.train import ensure_medusa_heads, train_medusa_heads
from ascend_specdec.medusa.training import TrainOptions

__all__ = ["MedusaConfigError", "MedusaHeads", "MedusaHeadsConfig", "TrainOptions",
           "ensure_medusa_heads", "last_accepted_rows", "load_heads", "medusa_proposer_factory",
           "save_heads", "train_medusa_heads"]


def medusa_proposer_factory(vllm_config, device, runner):
    """What ascend-core's model runners call for method "medusa" (vLLM is imported here)."""
    from ascend_specdec.vllm.medusa_proposer import AscendMedusaProposer

    return AscendMedusaProposer(vllm_config, device, runner)
