"""qwen::rms_norm and qwen::add_rms_norm.

    rms_norm(x, w, eps, offset) = x * rsqrt(mean(x^2, -1) + eps) * (w + offset)
    add_rms_norm(x, r, w, eps, offset) = (rms_norm(x + r, ...), x + r)

x [..., N], w [N]; fp32 math (float64 for float64), output in x's dtype.
"""
import torch
from torch import Tensor

from csrc_free_ops import norm as kernels

from .checks import check_float, check_same, fail
from .dispatch import acc_dtype, use_triton


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    xf = x.to(acc_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (weight.to(xf.dtype) + offset)
    return y.to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0):
    summed = (x.to(acc_dtype(x)) + residual.to(acc_dtype(x))).to(x.dtype)
    return rms_norm_reference(summed, weight, eps, offset), summed


def _check(op: str, x: Tensor, weight: Tensor, residual: Tensor | None = None):
    check_float(op, "x", x)
    check_float(op, "weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        fail(op, f"weight has {weight.shape[0]} elements but x's last dim is {x.shape[-1]}")
    if weight.device != x.device:
        fail(op, f"weight is on {weight.device} but x is on {x.device}")
    if residual is not None:
        check_float(op, "residual", residual)
        check_same(op, "x", x, residual=residual)
        if residual.shape != x.shape:
            fail(op, f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")


@torch.library.custom_op("qwen::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    _check("rms_norm", x, weight)
    if use_triton(x):
        return kernels.rms_norm(x, weight, eps, offset)
    return rms_norm_reference(x, weight, eps, offset)


@rms_norm.register_fake
def _(x, weight, eps, offset=0.0):
    _check("rms_norm", x, weight)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("qwen::add_rms_norm", mutates_args=())
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    _check("add_rms_norm", x, weight, residual)
    if use_triton(x):
        return kernels.add_rms_norm(x, residual, weight, eps, offset)
    return add_rms_norm_reference(x, residual, weight, eps, offset)


@add_rms_norm.register_fake
def _(x, residual, weight, eps, offset=0.0):
    _check("add_rms_norm", x, weight, residual)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))
