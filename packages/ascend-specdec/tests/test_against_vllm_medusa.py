"""Against vLLM (imports it): the proposer's interface for vLLM's runner, and our heads'
drafts against vLLM's own Medusa model loading the same checkpoint."""

import json
import socket
from types import SimpleNamespace

import pytest
import torch
import vllm  # noqa: E402,F401  (this file runs where vLLM is installed)
from vllm.v1.spec_decode.medusa import MedusaProposer  # noqa: E402

from ascend_core.registry import SPECULATIVE_PROPOSERS  # noqa: E402
from ascend_core.worker.speculative import install_registered_proposer  # noqa: E402
from ascend_specdec import register  # noqa: E402
from ascend_specdec.medusa import MedusaConfigError, load_heads, save_heads  # noqa: E402
from ascend_specdec.medusa.checkpoint import iter_safetensors  # noqa: E402
from ascend_specdec.vllm.medusa_proposer import AscendMedusaProposer  # noqa: E402

from medusa_cases import random_heads  # noqa: E402


def vllm_config(heads_dir, k=3, hidden=16, vocab=40, dtype=torch.float32):
    return SimpleNamespace(
        speculative_config=SimpleNamespace(method="medusa", model=str(heads_dir),
                                           num_speculative_tokens=k, revision=None),
        model_config=SimpleNamespace(dtype=dtype, get_hidden_size=lambda: hidden,
                                     get_vocab_size=lambda: vocab),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        additional_config={},
    )


@pytest.fixture
def heads_dir(tmp_path):
    heads = random_heads(original_lm_head=True, truncated_vocab_size=12)
    save_heads(heads, tmp_path)
    return tmp_path, heads


def test_is_a_medusa_proposer_for_vllms_runner(heads_dir):
    folder, _ = heads_dir
    # vLLM's runner asserts isinstance(drafter, MedusaProposer) before proposing.
    assert isinstance(AscendMedusaProposer(vllm_config(folder), torch.device("cpu")),
                      MedusaProposer)


def test_propose_runs_the_heads(heads_dir):
    folder, heads = heads_dir
    proposer = AscendMedusaProposer(vllm_config(folder, k=2), torch.device("cpu"))
    proposer.load_model(target_model=None)
    hidden = torch.randn(5, 16)
    drafts = proposer.propose(num_speculative_tokens=2, target_hidden_states=hidden,
                              sampling_metadata=None, slot_mappings=None)
    assert torch.equal(drafts, heads.propose(hidden, 2))
    proposer.dummy_run(num_tokens=8)
    assert proposer.model is not None  # what the runner's get_draft_model returns


def test_heads_run_in_the_models_dtype(heads_dir):
    folder, _ = heads_dir
    proposer = AscendMedusaProposer(vllm_config(folder, dtype=torch.bfloat16), "cpu")
    proposer.load_model(None)
    assert proposer.model.lm_head.weight.dtype == torch.bfloat16
    assert proposer.propose(3, torch.randn(2, 16, dtype=torch.bfloat16)).shape == (2, 3)


@pytest.mark.parametrize("kwargs, message", [
    ({"hidden": 32}, "hidden_size=16, but the base model's hidden size is 32"),
    ({"vocab": 50}, "vocab_size=40, but the base model's vocabulary has 50 tokens"),
    ({"k": 4}, "num_speculative_tokens=4 is more than the 3 Medusa heads"),
])
def test_start_up_errors(heads_dir, kwargs, message):
    folder, _ = heads_dir
    with pytest.raises(MedusaConfigError, match=message):
        AscendMedusaProposer(vllm_config(folder, **kwargs), "cpu")


def test_core_runner_hook_installs_it(heads_dir):
    folder, _ = heads_dir
    register()
    assert SPECULATIVE_PROPOSERS.find("medusa") is not None
    runner = SimpleNamespace(vllm_config=vllm_config(folder), device="cpu", drafter=object())
    assert install_registered_proposer(runner) == "ascend"
    assert type(runner.drafter) is AscendMedusaProposer


@pytest.fixture(scope="module")
def vllm_context():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        initialize_model_parallel(1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


def vllms_medusa(folder):
    """vLLM's Medusa model, built and loaded from ``folder`` the way its loader does."""
    from vllm.model_executor.models.medusa import Medusa
    from vllm.transformers_utils.configs.medusa import MedusaConfig

    hf_config = MedusaConfig.from_pretrained(str(folder))
    config = SimpleNamespace(speculative_config=SimpleNamespace(
        draft_model_config=SimpleNamespace(hf_config=hf_config)))
    model = Medusa(vllm_config=config)
    model.load_weights(iter_safetensors(folder))
    for module in model.modules():  # vLLM's CPU linear layers are set up after loading
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
    return model


def top1_drafts(model, hidden: torch.Tensor) -> torch.Tensor:
    """vLLM's Medusa: each head's top-1 token, [tokens, heads]."""
    with torch.no_grad():
        logits = model.compute_logits(model(hidden))
    return torch.stack([head_logits.argmax(-1) for head_logits in logits], dim=1)


@pytest.mark.parametrize("fields", [{}, {"num_hidden_layers": 2}, {"medusa_fc_bias": True},
                                    {"original_lm_head": True},
                                    {"original_lm_head": True, "truncated_vocab_size": 12}])
def test_drafts_equal_vllms_medusa_on_the_same_checkpoint(vllm_context, tmp_path, fields):
    heads = random_heads(**fields)
    save_heads(heads, tmp_path)
    theirs = vllms_medusa(tmp_path)
    hidden = torch.randn(64, 16)
    assert torch.equal(heads.propose(hidden), top1_drafts(theirs, hidden))


def test_a_config_without_medusa_fc_bias_reads_as_vllm_reads_it(vllm_context, tmp_path):
    """No key (other tools' checkpoints): no bias in the blocks, here as in vLLM."""
    heads = random_heads()
    save_heads(heads, tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["medusa_fc_bias"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, theirs = load_heads(tmp_path), vllms_medusa(tmp_path)
    assert not any(name.endswith(".bias") for name, _ in theirs.named_parameters())
    hidden = torch.randn(64, 16)
    assert torch.equal(ours.propose(hidden), top1_drafts(theirs, hidden))


def test_a_tree_drafts_its_nodes_from_each_heads_candidates(heads_dir):
    folder, heads = heads_dir
    config = vllm_config(folder, k=4)
    config.additional_config = {"medusa_tree_config": {"paths": [[0], [1], [0, 0], [0, 2]]}}
    proposer = AscendMedusaProposer(config, "cpu")
    assert proposer.tree.top_k == (2, 3)
    proposer.load_model(None)
    hidden = torch.randn(2, 16)
    drafts = proposer.propose(4, hidden)
    candidates = heads.propose_top_k(hidden, [2, 3])
    assert drafts.tolist() == torch.stack([candidates[0][:, 0], candidates[0][:, 1],
                                           candidates[1][:, 0], candidates[1][:, 2]],
                                          1).tolist()
    assert proposer.propose(2, hidden).tolist() == drafts[:, :2].tolist()  # a tree prefix
    # Candidates past the heads' draft vocabulary (12 tokens here) are refused.
    config.additional_config = {"medusa_tree_config": {"paths": [[0], [13]]}}
    config.speculative_config.num_speculative_tokens = 2
    with pytest.raises(MedusaConfigError, match="draft from 12 tokens: use candidate indices"):
        AscendMedusaProposer(config, "cpu")
