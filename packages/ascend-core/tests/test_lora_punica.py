"""AscendPunicaWrapper against vLLM's CPU Punica wrapper (the host's stock LoRA path), on one
mixed batch: tokens of two adapters and of none, a two-slice linear layer (as a merged
QKV / gate-up projection is), the logits and the embedding; and the platforms name it."""

import pytest
import torch
from vllm.lora.layers import LoRAMapping
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from ascend_core.lora.punica import AscendPunicaWrapper

from npu_reference import reference_on_path

SLOTS, RANK, HIDDEN, VOCAB = 3, 8, 32, 50
SLICES = (24, 16)
# Requests: adapter id 7 (2 tokens), none (3), adapter id 9 (1); the last slot stays empty,
# where stock's CPU ops would send a token without an adapter (index -1).
TOKENS = (7, 7, 0, 0, 0, 9)
PROMPTS = (7, 0, 9)
SLOT_OF_ID = [7, 9, None]


def wrappers():
    mapping = LoRAMapping(TOKENS, PROMPTS, is_prefill=True)
    made = []
    for cls in (AscendPunicaWrapper, PunicaWrapperCPU):
        wrapper = cls(64, 8, "cpu")
        wrapper.update_metadata(mapping, SLOT_OF_ID, SLOTS, VOCAB)
        made.append(wrapper)
    return made


def stacked(rows, cols, seed):
    weights = torch.randn(SLOTS, 1, rows, cols, generator=torch.Generator().manual_seed(seed))
    weights[SLOTS - 1] = 0  # an unloaded slot holds zeros
    return weights


def test_linear_layer_equals_vllms_cpu_wrapper():
    ours, stock = wrappers()
    x = torch.randn(len(TOKENS), HIDDEN)
    lora_a = tuple(stacked(RANK, HIDDEN, seed) for seed in (1, 2))
    lora_b = tuple(stacked(n, RANK, seed) for n, seed in zip(SLICES, (3, 4)))
    base = torch.randn(len(TOKENS), sum(SLICES))
    results = []
    for wrapper in (ours, stock):
        y = base.clone()
        wrapper.add_lora_linear(y, x, lora_a, lora_b, 0.5, SLICES)
        results.append(y)
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(results[0][2:5], base[2:5])  # no adapter: the base output, exactly
    assert not torch.allclose(results[0][:2], base[:2])  # the adapter did something


def test_logits_and_embedding_equal_vllms_cpu_wrapper():
    ours, stock = wrappers()
    hidden = torch.randn(len(PROMPTS), HIDDEN)
    lora_a, lora_b = stacked(RANK, HIDDEN, 5), stacked(VOCAB, RANK, 6)
    logits = [torch.randn(len(PROMPTS), VOCAB, generator=torch.Generator().manual_seed(7))
              for _ in range(2)]
    for wrapper, y in zip((ours, stock), logits):
        wrapper.add_lora_logits(y, hidden, lora_a, lora_b, 1.0)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)

    embeddings = torch.randn(len(TOKENS), RANK)
    lora_b_embed = stacked(HIDDEN, RANK, 8)[:, 0]
    outputs = [torch.zeros(len(TOKENS), HIDDEN) for _ in range(2)]
    for wrapper, y in zip((ours, stock), outputs):
        wrapper.add_lora_embedding(y, embeddings, lora_b_embed, True)
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=1e-5)


def test_padded_rows_of_a_graph_step_take_no_adapter():
    """A captured decode graph runs more rows than the step has tokens; the rows past them
    must not fail nor read a slot that was never written."""
    ours, _ = wrappers()
    x = torch.randn(len(TOKENS) + 4, HIDDEN)
    y = torch.zeros(len(TOKENS) + 4, SLICES[0])
    ours.add_lora_linear(y, x, (stacked(RANK, HIDDEN, 1),), (stacked(SLICES[0], RANK, 2),),
                         1.0, SLICES[:1])
    assert (y[len(TOKENS):] == 0).all()
    assert (y[:2] != 0).any()


@pytest.mark.parametrize("platform", ["host", "npu"])
def test_both_platforms_name_the_wrapper(platform):
    if platform == "host":
        from ascend_core.platform.host import AscendHostPlatform as cls
    else:
        with reference_on_path(forget=["ascend_core.platform.npu"]):
            from ascend_core.platform.npu import AscendPlatform as cls
    assert cls.get_punica_wrapper() == "ascend_core.lora.punica.AscendPunicaWrapper"


class Linear(torch.nn.Module):
    """What the check reads of vLLM's linear layers: full input and output sizes."""

    def __init__(self, inputs, outputs, output_sizes=None):
        super().__init__()
        self.input_size, self.output_size = inputs, outputs
        if output_sizes:
            self.output_sizes = output_sizes


class TinyModel(torch.nn.Module):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}

    def __init__(self):
        super().__init__()
        layer = torch.nn.Module()
        layer.self_attn = torch.nn.Module()
        layer.self_attn.qkv_proj = Linear(32, 64, [32, 16, 16])
        layer.self_attn.o_proj = Linear(32, 32)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([layer])


def write_adapter(folder, shapes):
    from safetensors.torch import save_file

    prefix = "base_model.model.model.layers.0.self_attn"
    save_file({f"{prefix}.{name}.{part}.weight": torch.zeros(shape)
               for name, parts in shapes.items() for part, shape in parts.items()},
              str(folder / "adapter_model.safetensors"))


def test_an_adapter_of_this_model_fits(tmp_path):
    from ascend_core.lora.checks import check_adapter_fits

    write_adapter(tmp_path, {"k_proj": {"lora_A": (8, 32), "lora_B": (16, 8)},
                             "o_proj": {"lora_A": (8, 32), "lora_B": (32, 8)}})
    check_adapter_fits(TinyModel(), tmp_path)


def test_an_adapter_of_another_base_is_refused_naming_the_layer(tmp_path):
    from ascend_core.lora.checks import AdapterMismatch, check_adapter_fits

    # k_proj's outputs are 16 in this model (its share of qkv_proj); this adapter's are 32.
    write_adapter(tmp_path, {"k_proj": {"lora_A": (8, 32), "lora_B": (32, 8)}})
    with pytest.raises(AdapterMismatch, match=r"model\.layers\.0\.self_attn\.k_proj takes 32 "
                       r"inputs and gives 16 outputs here, but the adapter's lora_A is "
                       r"\[8, 32\] and lora_B \[32, 8\]"):
        check_adapter_fits(TinyModel(), tmp_path)


def test_a_step_without_adapters_runs_no_lora_op(monkeypatch):
    """As vLLM's own wrappers: decode steps of base requests alone cost nothing extra."""
    import ascend_core.lora.punica as punica

    def refuse(*args, **kwargs):
        raise AssertionError("a LoRA op ran in a step without adapters")

    monkeypatch.setattr(punica, "lora_shrink", refuse)
    monkeypatch.setattr(punica, "lora_expand", refuse)
    wrapper = AscendPunicaWrapper(64, 8, "cpu")
    wrapper.update_metadata(LoRAMapping((0,) * 4, (0, 0), is_prefill=False), SLOT_OF_ID,
                            SLOTS, VOCAB)
    y = torch.zeros(4, SLICES[0])
    wrapper.add_lora_linear(y, torch.randn(4, HIDDEN), (stacked(RANK, HIDDEN, 1),),
                            (stacked(SLICES[0], RANK, 2),), 1.0, SLICES[:1])
    wrapper.add_lora_logits(torch.zeros(2, VOCAB), torch.randn(2, HIDDEN),
                            stacked(RANK, HIDDEN, 5), stacked(VOCAB, RANK, 6), 1.0)
    assert (y == 0).all()
    wrapper.update_metadata(LoRAMapping((0, 9, 0, 0), (0, 9), is_prefill=False), SLOT_OF_ID,
                            SLOTS, VOCAB)
    with pytest.raises(AssertionError, match="a LoRA op ran"):
        wrapper.add_lora_linear(y, torch.randn(4, HIDDEN), (stacked(RANK, HIDDEN, 1),),
                                (stacked(SLICES[0], RANK, 2),), 1.0, SLICES[:1])
