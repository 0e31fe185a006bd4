"""rotary_embedding: the reference against complex rotation, the Triton backend (in
Triton's interpreter) against the reference, in and out of place."""

import pytest
import torch

from ascend_kernels import rotary_embedding
from ascend_kernels.rope import (
    RopeLaunchConfig,
    _triton_rotary_embedding,
    rope_launch_config,
    rotary_embedding_reference,
)

from conftest import DTYPES, assert_close, needs_triton

MAX_POSITION = 32


def _cache(rotary_dim: int, dtype=torch.float32) -> torch.Tensor:
    """vLLM's cos/sin cache: ``[max_position, rotary_dim]``, cos then sin."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    angles = torch.arange(MAX_POSITION).double()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(dtype)


def _complex_rotation(x: torch.Tensor, positions, cache, head_size: int, neox: bool):
    """Each rotated pair as a complex number times exp(i * angle), in float64."""
    tokens = positions.numel()
    rotary_dim = cache.shape[-1]
    heads = x.double().reshape(tokens, -1, head_size).clone()
    cos, sin = cache.double()[positions].chunk(2, dim=-1)
    turn = torch.complex(cos, sin)[:, None, :]
    half = rotary_dim // 2
    first = slice(0, half) if neox else slice(0, rotary_dim, 2)
    second = slice(half, rotary_dim) if neox else slice(1, rotary_dim, 2)
    pairs = torch.complex(heads[..., first], heads[..., second]) * turn
    heads[..., first], heads[..., second] = pairs.real, pairs.imag
    return heads.reshape(x.shape)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size, rotary_dim", [(16, 16), (24, 8)])
def test_reference_rotates_pairs_by_their_angle(neox, head_size, rotary_dim):
    torch.manual_seed(0)
    positions = torch.tensor([0, 5, 31, 5])
    cache = _cache(rotary_dim)
    query = torch.randn(4, 3 * head_size, dtype=torch.float64)
    key = torch.randn(4, 1 * head_size, dtype=torch.float64)
    q, k = rotary_embedding_reference(positions, query, key, cache.double(), head_size, neox)
    torch.testing.assert_close(q, _complex_rotation(query, positions, cache, head_size, neox))
    torch.testing.assert_close(k, _complex_rotation(key, positions, cache, head_size, neox))


CASES = [
    # (tokens, heads_q, heads_k, head_size, rotary_dim)
    (5, 4, 2, 16, 16),   # whole head
    (3, 3, 1, 24, 8),    # partial rotary, odd head counts
    (1, 2, 2, 32, 32),   # one token
    (4, 6, 2, 20, 12),   # nothing a power of two
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("tokens, heads_q, heads_k, head_size, rotary_dim", CASES)
def test_triton_matches_reference(dtype, neox, tokens, heads_q, heads_k, head_size,
                                  rotary_dim):
    torch.manual_seed(1)
    positions = torch.randint(0, MAX_POSITION, (tokens,))
    cache = _cache(rotary_dim)
    query = torch.randn(tokens, heads_q * head_size, dtype=dtype)
    key = torch.randn(tokens, heads_k * head_size, dtype=dtype)
    q, k = rotary_embedding(positions, query, key, cache, head_size, neox, backend="triton")
    ref_q, ref_k = rotary_embedding_reference(positions, query, key, cache, head_size, neox)
    assert_close(q, ref_q, dtype, scale=2)
    assert_close(k, ref_k, dtype, scale=2)


@needs_triton
@pytest.mark.parametrize("neox", [True, False])
def test_triton_several_tokens_and_head_steps_per_program(neox):
    # 4 tokens per program over 7 tokens (a partial last block), query heads in steps of 2
    # over 5 heads and key heads in steps of 1: every mask and loop of the kernel.
    torch.manual_seed(2)
    positions = torch.randint(0, MAX_POSITION, (7,))
    cache = _cache(8, torch.bfloat16)
    query = torch.randn(7, 5 * 12, dtype=torch.bfloat16)
    key = torch.randn(7, 3 * 12, dtype=torch.bfloat16)
    config = RopeLaunchConfig(tokens_per_program=4, block_heads_q=2, block_heads_k=1,
                              block_rot=4, block_pass=4, num_programs=2, num_warps=4,
                              ub_size_kb=0, budget_bytes=0, tile_bytes=0)
    q, k = _triton_rotary_embedding(positions, query, key, cache, 12, neox, False, 0, config)
    ref_q, ref_k = rotary_embedding_reference(positions, query, key, cache, 12, neox)
    assert_close(q, ref_q, torch.bfloat16, scale=2)
    assert_close(k, ref_k, torch.bfloat16, scale=2)


@needs_triton
def test_triton_with_a_planned_multi_token_config():
    config = rope_launch_config(4096, 2, 1, 16, 16, torch.float32, ub_size_kb=192)
    assert config.tokens_per_program > 1
    positions = torch.randint(0, MAX_POSITION, (9,))
    query, key = torch.randn(9, 2 * 16), torch.randn(9, 16)
    cache = _cache(16)
    q, k = _triton_rotary_embedding(positions, query, key, cache, 16, True, False, 0, config)
    ref_q, ref_k = rotary_embedding_reference(positions, query, key, cache, 16)
    assert_close(q, ref_q, torch.float32)
    assert_close(k, ref_k, torch.float32)


@needs_triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_in_place_on_slices_of_a_fused_qkv(backend, rotary_dim):
    # vLLM splits q, k, v out of one projection: strided views, rotated in place.
    torch.manual_seed(3)
    head_size, tokens = 16, 3
    qkv = torch.randn(tokens, (4 + 2 + 2) * head_size)
    query, key = qkv[:, :4 * head_size], qkv[:, 4 * head_size:6 * head_size]
    value_before = qkv[:, 6 * head_size:].clone()
    positions = torch.tensor([1, 2, 3])
    cache = _cache(rotary_dim)
    expected_q, expected_k = rotary_embedding_reference(positions, query, key, cache,
                                                        head_size)
    q, k = rotary_embedding(positions, query, key, cache, head_size, inplace=True,
                            backend=backend)
    assert q is query and k is key
    assert_close(qkv[:, :4 * head_size], expected_q, torch.float32)
    assert_close(qkv[:, 4 * head_size:6 * head_size], expected_k, torch.float32)
    torch.testing.assert_close(qkv[:, 6 * head_size:], value_before)


@needs_triton
def test_triton_three_dim_inputs_and_no_key():
    positions = torch.tensor([4, 0])
    query = torch.randn(2, 3, 16, dtype=torch.float16)
    cache = _cache(16)
    q, k = rotary_embedding(positions, query, None, cache, 16, False, backend="triton")
    assert k is None and q.shape == (2, 3, 16)
    assert_close(q, rotary_embedding_reference(positions, query, None, cache, 16, False)[0],
                 torch.float16, scale=2)


@needs_triton
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_no_tokens(backend):
    query, key = torch.randn(0, 32), torch.randn(0, 16)
    q, k = rotary_embedding(torch.zeros(0, dtype=torch.int64), query, key, _cache(16), 16,
                            backend=backend)
    assert q.shape == (0, 32) and k.shape == (0, 16)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"positions": torch.zeros(2)}, TypeError, "positions must be an int64 or int32 tensor"),
    ({"query": torch.randn(2, 20)}, ValueError, "query's last dim \\(20\\) must be a multiple"),
    ({"query": torch.randn(3, 32)}, ValueError, "does not start with positions. shape \\(2,\\)"),
    ({"key": torch.randn(2, 16, dtype=torch.float16)}, TypeError,
     "key has dtype torch.float16 but query has torch.float32"),
    ({"cos_sin_cache": torch.randn(8, 18)}, ValueError,
     "rotary_dim \\(cos_sin_cache's last dim\\) is 18"),
    ({"cos_sin_cache": torch.randn(8, 7)}, ValueError, "must be even"),
    ({"head_size": 0}, ValueError, "head_size must be an int of at least 2"),
])
def test_bad_inputs_are_named(kwargs, error, match):
    args = {"positions": torch.tensor([0, 1]), "query": torch.randn(2, 32),
            "key": torch.randn(2, 16), "cos_sin_cache": torch.randn(8, 16), "head_size": 16}
    args.update(kwargs)
    with pytest.raises(error, match=match):
        rotary_embedding(args["positions"], args["query"], args["key"], args["cos_sin_cache"],
                         args["head_size"])


# --- multimodal RoPE --------------------------------------------------------------------------


def _mrope_inputs(tokens: int, heads_q: int, heads_k: int, head_size: int, rotary_dim: int,
                  dtype=torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, MAX_POSITION, (3, tokens), generator=generator)
    query = torch.randn(tokens, heads_q * head_size, generator=generator).to(dtype)
    key = torch.randn(tokens, heads_k * head_size, generator=generator).to(dtype)
    return positions, query, key, _cache(rotary_dim)


@pytest.mark.parametrize("interleaved", [False, True])
def test_mrope_pairs_take_their_sections_position(interleaved):
    """Each rotated pair turns by the angle of its own section's position: pairs of the
    T section by row 0, H by row 1, W by row 2 (interleaved: pair i is H where i % 3 == 1
    and i < 3 * H, W where i % 3 == 2 and i < 3 * W)."""
    from ascend_kernels import mrope

    section = (2, 3, 3)
    head_size = rotary_dim = 16
    positions, query, key, cache = _mrope_inputs(5, 2, 1, head_size, rotary_dim)
    q, k = mrope(positions, query, key, cache, head_size, section, True, interleaved)
    for pair in range(rotary_dim // 2):
        if interleaved:
            row = 1 if pair % 3 == 1 and pair < 9 else 2 if pair % 3 == 2 and pair < 9 else 0
        else:
            row = 0 if pair < 2 else 1 if pair < 5 else 2
        one = torch.zeros(rotary_dim)
        one[pair] = 1.0
        cache_one = cache.clone()
        cache_one[:, :rotary_dim // 2] = cache[:, :rotary_dim // 2] * one[:rotary_dim // 2] + (
            1 - one[:rotary_dim // 2])
        cache_one[:, rotary_dim // 2:] = cache[:, rotary_dim // 2:] * one[:rotary_dim // 2]
        # Only this pair rotates (every other pair has cos 1, sin 0): by row `row`'s angle.
        got, _ = mrope(positions, query, key, cache_one, head_size, section, True, interleaved)
        want = _complex_rotation(query, positions[row], cache_one, head_size, True)
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    assert q.shape == query.shape and k.shape == key.shape


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("tokens, heads_q, heads_k, head_size, rotary_dim, section", [
    (5, 4, 2, 16, 16, (2, 3, 3)),
    (3, 3, 1, 24, 12, (2, 2, 2)),    # partial rotary, odd heads
    (9, 2, 2, 32, 32, (8, 4, 4)),
])
def test_mrope_triton_matches_reference(dtype, interleaved, neox, tokens, heads_q, heads_k,
                                        head_size, rotary_dim, section):
    from ascend_kernels import mrope

    positions, query, key, cache = _mrope_inputs(tokens, heads_q, heads_k, head_size,
                                                 rotary_dim, dtype, seed=tokens)
    ref_q, ref_k = mrope(positions, query, key, cache, head_size, section, neox, interleaved,
                         backend="reference")
    q, k = mrope(positions, query, key, cache, head_size, section, neox, interleaved,
                 backend="triton")
    assert_close(q, ref_q, dtype)
    assert_close(k, ref_k, dtype)
    # In place, into the caller's tensors.
    q2, k2 = query.clone(), key.clone()
    out_q, out_k = mrope(positions, q2, k2, cache, head_size, section, neox, interleaved,
                         inplace=True, backend="triton")
    assert out_q is q2 and out_k is k2
    assert_close(q2, ref_q, dtype)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"positions": torch.zeros(4, dtype=torch.long)}, r"positions must be \[3, num_tokens\]"),
    ({"mrope_section": (2, 3)}, "three non-negative ints"),
    ({"mrope_section": (2, 3, 4)}, r"covers 9 pairs but the cache rotates 8.*add up"),
    ({"key": None}, "key is required"),
])
def test_mrope_bad_inputs_are_named(kwargs, match):
    from ascend_kernels import mrope

    positions, query, key, cache = _mrope_inputs(4, 2, 1, 16, 16)
    args = {"positions": positions, "query": query, "key": key, "cos_sin_cache": cache,
            "head_size": 16, "mrope_section": (2, 3, 3), **kwargs}
    with pytest.raises(ValueError, match=match):
        mrope(**args)
