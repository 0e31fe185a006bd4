"""Storage formats: npu_format_cast / get_npu_format / Format, and which op arguments take
FRACTAL_NZ tensors (torch_npu._formats)."""

from __future__ import annotations

import gc

import pytest
import torch

ND, NZ = 2, 29


def test_base_formats_follow_the_rank(torch_npu):
    # The page's example: torch.rand(2, 3, 4, 5).npu() reads 0 (NCHW).
    assert torch_npu.get_npu_format(torch.rand(2, 3, 4, 5).npu()) == torch_npu.Format.NCHW == 0
    assert torch_npu.get_npu_format(torch.rand(2, 3, 4, 5, 6).npu()) == 30
    assert torch_npu.get_npu_format(torch.rand(8, 16).npu()) == ND
    assert torch_npu.get_npu_format(torch.rand(8).npu()) == ND


def test_cast_gives_a_new_tensor_and_leaves_the_input(torch_npu):
    x = torch.randn(32, 48).npu()
    nz = torch_npu.npu_format_cast(x, NZ)
    assert nz is not x and nz.data_ptr() != x.data_ptr()
    assert torch_npu.get_npu_format(nz) == NZ
    assert torch_npu.get_npu_format(x) == ND
    assert torch.equal(nz.cpu(), x.cpu())  # the values, in the logical layout
    # A Format member works as the integer; the same format again is the tensor itself.
    assert torch_npu.npu_format_cast(nz, torch_npu.Format.FRACTAL_NZ) is nz
    back = torch_npu.npu_format_cast(nz, ND)
    assert torch_npu.get_npu_format(back) == ND and torch.equal(back.cpu(), x.cpu())


def test_the_format_belongs_to_the_storage(torch_npu):
    """A view, and a Parameter whose .data became the cast, read the cast's format."""
    weight = torch.nn.Parameter(torch.randn(16, 32).npu(), requires_grad=False)
    weight.data = torch_npu.npu_format_cast(weight.data, NZ)
    gc.collect()  # the cast's own Python object is gone; its storage lives in the Parameter
    assert torch_npu.get_npu_format(weight) == NZ
    assert torch_npu.get_npu_format(weight.t()) == NZ


def test_a_freed_storage_forgets_its_format(torch_npu):
    nz = torch_npu.npu_format_cast(torch.randn(64, 64).npu(), NZ)
    assert torch_npu._formats.any_recorded()
    del nz
    gc.collect()
    assert not torch_npu._formats.any_recorded()


@pytest.mark.parametrize(("make", "args", "error", "match"), [
    (lambda: torch.randn(8).npu(), (NZ,), RuntimeError, "2 dimensions or more"),
    (lambda: torch.randn(8, 8), (NZ,), RuntimeError, "takes an npu tensor"),
    (lambda: torch.randn(8, 8).npu(), (7,), RuntimeError, "not a torch_npu format"),
    (lambda: torch.randn(8, 8).npu(), (NZ, 3), NotImplementedError, "customize_dtype"),
    (lambda: torch.randn(8, 8).npu(), (3,), NotImplementedError, "NC1HWC0"),
])
def test_cast_refuses(torch_npu, make, args, error, match):
    with pytest.raises(error, match=match):
        torch_npu.npu_format_cast(make(), *args)


def test_get_npu_format_takes_npu_tensors_only(torch_npu):
    with pytest.raises(RuntimeError, match="takes an npu tensor"):
        torch_npu.get_npu_format(torch.randn(2, 2))


def test_quant_matmul_takes_an_nz_weight_with_the_same_result(torch_npu):
    x1 = torch.randint(-8, 8, (4, 64), dtype=torch.int8).npu()
    x2 = torch.randint(-8, 8, (64, 32), dtype=torch.int8).npu()
    scale = torch.rand(32).npu()
    nd = torch_npu.npu_quant_matmul(x1, x2, scale, output_dtype=torch.bfloat16)
    nz = torch_npu.npu_quant_matmul(x1, torch_npu.npu_format_cast(x2, NZ), scale,
                                    output_dtype=torch.bfloat16)
    assert torch.equal(nd.cpu(), nz.cpu())
    with pytest.raises(RuntimeError, match="argument 'x1' is FRACTAL_NZ"):
        torch_npu.npu_quant_matmul(torch_npu.npu_format_cast(x1, NZ), x2, scale,
                                   output_dtype=torch.bfloat16)


def test_weight_quant_matmul_and_grouped_matmul_take_nz_weights(torch_npu):
    x = torch.randn(4, 64, dtype=torch.float16).npu()
    weight = torch.randint(-8, 8, (64, 32), dtype=torch.int8).npu()
    scale = torch.rand(32, dtype=torch.float16).npu()
    nd = torch_npu.npu_weight_quant_batchmatmul(x, weight, scale)
    nz = torch_npu.npu_weight_quant_batchmatmul(x, torch_npu.npu_format_cast(weight, NZ), scale)
    assert torch.equal(nd.cpu(), nz.cpu())
    w = torch.randn(2, 64, 32, dtype=torch.float16).npu()
    counts = torch.tensor([1, 3]).npu()
    kwargs = {"group_list": counts, "split_item": 2, "group_type": 0, "group_list_type": 1}
    (nd,) = torch_npu.npu_grouped_matmul([x], [w], **kwargs)
    (nz,) = torch_npu.npu_grouped_matmul([x], [torch_npu.npu_format_cast(w, NZ)], **kwargs)
    assert torch.equal(nd.cpu(), nz.cpu())


def test_an_op_that_takes_nd_only_refuses_an_nz_input(torch_npu):
    x = torch_npu.npu_format_cast(torch.randn(4, 64).npu(), NZ)
    with pytest.raises(RuntimeError, match="npu_rms_norm: argument 'input' is FRACTAL_NZ"):
        torch_npu.npu_rms_norm(x, torch.ones(64).npu())
    # torch's own ops take it, as torch_npu's format-aware kernels do.
    assert torch.equal((x @ torch.eye(64).npu()).cpu(), x.cpu())
