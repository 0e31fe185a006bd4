"""rope_launch_config: the Triton RoPE tiling fits the UB budget that
VLLM_ASCEND_ROPE_UB_SIZE_KB sets (0 = auto, 192 KB when the device does not say)."""

import pytest
import torch

import ascend_kernels.rope as rope
from ascend_kernels import rope_launch_config

DEVICE_UB_SIZE_KB = rope.device_ub_size_kb  # before the autouse fixture replaces it

# (heads_q, heads_k, head_size, rotary_dim, dtype): Llama-8B on TP 1 and TP 4, a partial
# rotary model, DeepSeek-like many heads, float32.
SHAPES = [
    (32, 8, 128, 128, torch.bfloat16),
    (8, 2, 128, 128, torch.bfloat16),
    (16, 16, 80, 40, torch.float16),
    (128, 1, 64, 64, torch.bfloat16),
    (4, 4, 64, 64, torch.float32),
]


@pytest.fixture(autouse=True)
def no_device_ub(monkeypatch):
    monkeypatch.setattr(rope, "device_ub_size_kb", lambda: None)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("ub_size_kb", [64, 128, 192, 256, 512])
def test_tile_never_exceeds_half_the_ub(shape, ub_size_kb):
    config = rope_launch_config(32768, *shape, ub_size_kb=ub_size_kb)
    assert config.ub_size_kb == ub_size_kb
    assert config.budget_bytes == ub_size_kb * 1024 // 2
    assert 0 < config.tile_bytes <= config.budget_bytes
    heads_q, heads_k, head_size, rotary_dim, _ = shape
    assert config.block_rot * 2 >= rotary_dim
    for value in (config.tokens_per_program, config.block_heads_q, config.block_heads_k,
                  config.block_rot, config.block_pass):
        assert value & (value - 1) == 0, f"{value} is not a power of two"
    assert config.num_programs == -(-32768 // config.tokens_per_program)


@pytest.mark.parametrize("shape", SHAPES[:3])
def test_bigger_ub_gives_more_tokens_per_program(shape):
    tokens = [rope_launch_config(32768, *shape, ub_size_kb=kb).tokens_per_program
              for kb in (128, 192, 256, 512, 1024)]
    assert tokens == sorted(tokens)
    assert tokens[-1] > tokens[0]


def test_llama_shapes_on_a_192_kb_ub():
    tp1 = rope_launch_config(32768, 32, 8, 128, 128, torch.bfloat16, ub_size_kb=192)
    assert (tp1.tokens_per_program, tp1.block_heads_q, tp1.block_heads_k) == (1, 32, 8)
    tp4 = rope_launch_config(32768, 8, 2, 128, 128, torch.bfloat16, ub_size_kb=192)
    assert tp4.tokens_per_program == 4
    assert rope_launch_config(32768, 8, 2, 128, 128, torch.bfloat16,
                              ub_size_kb=256).tokens_per_program == 8


def test_heads_are_split_only_when_one_token_does_not_fit():
    small = rope_launch_config(32768, 128, 1, 64, 64, torch.bfloat16, ub_size_kb=64)
    assert small.block_heads_q < 128 and small.tokens_per_program == 1
    big = rope_launch_config(32768, 128, 1, 64, 64, torch.bfloat16, ub_size_kb=512)
    assert big.block_heads_q == 128


def test_zero_means_auto_falling_back_to_192_kb():
    assert rope_launch_config(4096, 8, 2, 128, 128, torch.bfloat16) == rope_launch_config(
        4096, 8, 2, 128, 128, torch.bfloat16, ub_size_kb=192)
    assert rope_launch_config(4096, 8, 2, 128, 128, torch.bfloat16).ub_size_kb == 192


def test_zero_reads_the_device_ub_when_reported(monkeypatch):
    monkeypatch.setattr(rope, "device_ub_size_kb", lambda: 256)
    config = rope_launch_config(4096, 8, 2, 128, 128, torch.bfloat16, ub_size_kb=0)
    assert config.ub_size_kb == 256
    assert config == rope_launch_config(4096, 8, 2, 128, 128, torch.bfloat16, ub_size_kb=256)


def test_device_ub_size_is_none_without_an_npu_driver():
    DEVICE_UB_SIZE_KB.cache_clear()
    try:
        assert DEVICE_UB_SIZE_KB() is None
    finally:
        DEVICE_UB_SIZE_KB.cache_clear()


@pytest.mark.parametrize("properties, expected", [
    ({"num_vectorcore": 40, "ub_size_kb": 256}, 256),
    ({"ub_size": 196608}, 192),
    ({"num_vectorcore": 40}, None),
])
def test_device_ub_size_reads_triton_ascend_properties(monkeypatch, properties, expected):
    class Utils:
        @staticmethod
        def get_device_properties(device):
            assert device == "npu"
            return properties

    class Triton:
        class runtime:  # noqa: N801 - mirrors triton.runtime.driver.active.utils
            class driver:  # noqa: N801
                class active:  # noqa: N801
                    utils = Utils

    monkeypatch.setattr(rope, "triton_module", lambda: Triton)
    DEVICE_UB_SIZE_KB.cache_clear()
    try:
        assert DEVICE_UB_SIZE_KB() == expected
    finally:
        DEVICE_UB_SIZE_KB.cache_clear()


def test_few_tokens_keep_programs_for_parallelism():
    config = rope_launch_config(64, 8, 2, 128, 128, torch.bfloat16, ub_size_kb=1024)
    assert config.tokens_per_program == 1 and config.num_programs == 64
    assert rope_launch_config(0, 8, 2, 128, 128, torch.bfloat16).num_programs == 0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"ub_size_kb": -1}, ValueError, "ub_size_kb=-1 must be at least 0"),
    ({"ub_size_kb": "192"}, TypeError, "ub_size_kb must be an int"),
    ({"rotary_dim": 130}, ValueError, "rotary_dim=130 must be even and at most head_size=128"),
    ({"num_heads_q": 0}, ValueError, "num_heads_q=0 must be at least 1"),
    ({"ub_size_kb": 1}, ValueError, "raise the UB size"),
])
def test_bad_arguments_are_named(kwargs, error, match):
    args = {"num_tokens": 16, "num_heads_q": 8, "num_heads_k": 2, "head_size": 128,
            "rotary_dim": 128, "dtype": torch.bfloat16, "ub_size_kb": 0}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        rope_launch_config(**args)
