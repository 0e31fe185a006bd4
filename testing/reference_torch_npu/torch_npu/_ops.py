"""Fused torch_npu ops, computed with plain torch on CPU tensors.

Each function follows its torch_npu documentation page (argument names, shapes, dtype
rules) and raises on what the page rules out or what the reference does not model, rather
than computing something the real op would refuse. Arithmetic is done in float32 and the
result cast once to the output dtype; the real kernels may round intermediates differently,
so compare with a tolerance suited to the dtype.

Errors, as the real binding raises them:

- ``RuntimeError`` for an argument the op's checks refuse (a dtype, shape or value the page
  rules out): op-plugin's checks are ``TORCH_CHECK``s, which reach Python as RuntimeError;
- ``TypeError`` where the Python type of an argument is wrong (not a Tensor, an int, a
  float, a bool or a list where the schema names one, an unknown keyword): the generated
  binding's argument parser refuses those before the op runs;
- ``NotImplementedError`` (a RuntimeError too) for what the real op does but the
  reference does not model: never a silently different result.
"""

from __future__ import annotations

import torch

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_DIMS = 8


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}.")
    if value.device.type != "cpu":
        raise RuntimeError(
            f"{name} is on {value.device}; the reference torch_npu computes on CPU tensors "
            "(it stands in for NPU memory with host memory)."
        )
    return value


def _require_float_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in _FLOAT_DTYPES:
        raise RuntimeError(
            f"{name} has dtype {tensor.dtype}; supported dtypes are float16, bfloat16 and "
            "float32."
        )


def _require_dims(name: str, tensor: torch.Tensor, low: int) -> None:
    if not low <= tensor.dim() <= _MAX_DIMS:
        raise RuntimeError(f"{name} must have {low} to {_MAX_DIMS} dims, got {tensor.dim()}.")


def _require_dense(name: str, tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        raise RuntimeError(f"{name} is empty (shape {tuple(tensor.shape)}); empty tensors are "
                           "not supported.")
    if not tensor.is_contiguous():
        raise RuntimeError(f"{name} is not contiguous; non-contiguous tensors are not supported.")


def npu_rms_norm(input, gamma, epsilon=1e-06):
    """``torch_npu.npu_rms_norm(input, gamma, epsilon=1e-06) -> (Tensor, Tensor)``.

    The schema's ``Tensor self`` is ``input`` in the Python binding (torchgen names a
    function's ``self`` so); the page writes ``self``.

    Follows Ascend/op-plugin ``docs/context/（beta）torch_npu-npu_rms_norm.md`` and, for what
    that page leaves open, the aclnnRmsNorm kernel page it calls (``aclnnRmsNorm.md``):

    - ``input``: float16, bfloat16 or float32, 1 to 8 dims (the torch_npu page says 2-8 for
      ``input`` and ``gamma`` but its own example passes a 1-D ``gamma``; the kernel page
      says 1-8 for both), contiguous, not empty.
    - ``gamma``: the trailing dims of ``input`` (``gamma.shape == input.shape[n:]``), of
      ``input``'s dtype; float32 ``gamma`` with float16/bfloat16 ``input`` is also accepted,
      as the kernel page's dtype table allows.
    - ``epsilon``: float added under the square root.

    Returns ``(y, rstd)``: ``y = input / sqrt(mean(input**2) + epsilon) * gamma`` over the
    dims ``gamma`` covers, in ``input``'s dtype; ``rstd = 1 / sqrt(mean(input**2) + epsilon)``
    in float32, shaped like ``input`` with those dims set to 1 (torch_npu's meta function).
    """
    _require_tensor("input", input)
    _require_tensor("gamma", gamma)
    _require_float_dtype("input", input)
    _require_float_dtype("gamma", gamma)
    _require_dims("input", input, 1)
    _require_dims("gamma", gamma, 1)
    _require_dense("input", input)
    _require_dense("gamma", gamma)
    if gamma.dtype != input.dtype and not (
        gamma.dtype == torch.float32 and input.dtype in (torch.float16, torch.bfloat16)
    ):
        raise RuntimeError(
            f"gamma has dtype {gamma.dtype} but input has {input.dtype}; gamma must match "
            "input's dtype (or be float32 when input is float16/bfloat16)."
        )
    norm_dims = gamma.dim()
    trailing = tuple(input.shape[input.dim() - norm_dims:])
    if norm_dims > input.dim() or tuple(gamma.shape) != trailing:
        raise RuntimeError(
            f"gamma's shape {tuple(gamma.shape)} must equal the trailing dims of input's shape "
            f"{tuple(input.shape)}."
        )
    if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)):
        raise TypeError(f"epsilon must be a float, got {type(epsilon).__name__}.")

    reduce_dims = tuple(range(input.dim() - norm_dims, input.dim()))
    x = input.float()
    rstd = torch.rsqrt(x.pow(2).mean(dim=reduce_dims, keepdim=True) + float(epsilon))
    y = (x * rstd * gamma.float()).to(input.dtype)
    return y, rstd


def npu_swiglu(input, dim=-1):
    """``torch_npu.npu_swiglu(Tensor input, int dim=-1) -> Tensor``.

    Follows Ascend/op-plugin ``docs/context/（beta）torch_npu-npu_swiglu.md``: ``input`` is
    split in half along ``dim`` into ``A`` (first half) and ``B`` (second half) and the
    result is ``swish(A) * B = A * sigmoid(A) * B`` in ``input``'s dtype.

    - ``input``: float32, float16 or bfloat16, 1 to 8 dims, even along ``dim``, contiguous,
      not empty.
    - ``dim``: int in ``[-input.dim(), input.dim() - 1]``.
    """
    _require_tensor("input", input)
    _require_float_dtype("input", input)
    _require_dims("input", input, 1)
    _require_dense("input", input)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int, got {type(dim).__name__}.")
    if not -input.dim() <= dim <= input.dim() - 1:
        raise RuntimeError(
            f"dim={dim} is out of range for a {input.dim()}-dim input; use "
            f"{-input.dim()}..{input.dim() - 1}."
        )
    if input.shape[dim] % 2:
        raise RuntimeError(
            f"input's size along dim {dim} is {input.shape[dim]}; it must be divisible by 2."
        )
    first, second = input.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(first) * second).to(input.dtype)
