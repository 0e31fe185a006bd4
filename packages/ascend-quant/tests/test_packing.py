"""int4 packing: round trips, and the int32 layout byte-for-byte equal to compressed-tensors'."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

from ascend_quant.int4 import pack_int4_rows, pack_int32, unpack_int4_rows, unpack_int32
from ascend_quant.quantize import dequantize_weight, quantize_weight


def random_int(shape, bits, seed=0):
    g = torch.Generator().manual_seed(seed)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1))
    return torch.randint(low, high, shape, generator=g, dtype=torch.int8)


@pytest.mark.parametrize("k", [2, 7, 64, 130])
def test_int4_rows_round_trip(k):
    q = random_int((k, 9), 4)
    packed = pack_int4_rows(q)
    assert packed.dtype == torch.uint8 and packed.shape == ((k + 1) // 2, 9)
    assert torch.equal(unpack_int4_rows(packed, k), q)


def test_int4_rows_refuse_out_of_range_values():
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4_rows(torch.tensor([[8]], dtype=torch.int8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("cols", [8, 16, 20, 33])
@pytest.mark.parametrize("packed_dim", [0, 1])
def test_int32_packing_matches_compressed_tensors(bits, cols, packed_dim):
    q = random_int((cols if packed_dim == 0 else 6, 6 if packed_dim == 0 else cols), bits)
    ours = pack_int32(q, bits, packed_dim)
    theirs = pack_to_int32(q, bits, packed_dim)
    assert torch.equal(ours, theirs)
    size = q.shape[packed_dim]
    assert torch.equal(unpack_int32(ours, bits, size, packed_dim), q)
    assert torch.equal(unpack_from_int32(theirs, bits, q.shape, packed_dim), q)


@pytest.mark.parametrize("bits,group", [(8, None), (4, None), (4, 32), (8, 16)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_min_max_quantization_error_is_within_half_a_step(bits, group, symmetric):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(1))
    qw = quantize_weight(w, bits, group, symmetric)
    err = (dequantize_weight(qw.q, qw.scale, qw.zero) - w).abs()
    step = qw.scale.repeat_interleave(qw.group_size, dim=1)
    assert bool((err <= step / 2 + 1e-6).all())
