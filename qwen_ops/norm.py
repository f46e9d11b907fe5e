"""qwen::rms_norm, qwen::add_rms_norm and their backward qwen::rms_norm_backward.

    rms_norm(x, w, eps, offset) = x * rsqrt(mean(x^2, -1) + eps) * (w + offset)
    add_rms_norm(x, r, w, eps, offset) = (rms_norm(x + r, ...), x + r)

x [..., N], w [N]; fp32 math (float64 for float64), outputs in x's dtype. The sum output
is rounded to x's dtype, and the norm is taken of that rounded sum (what the next layer reads).

Backward (rstd recomputed from x): with xhat = x * rstd and g = dy * (w + offset),
dx = rstd * (g - xhat * mean(g * xhat)) (+ the sum output's gradient for add_rms_norm),
dweight = sum over rows of dy * xhat.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import norm as kernels
from csrc_free_ops.common import empty_contiguous_like

from .checks import check_float, check_like, check_same, fail
from .registry import acc_dtype, define, last_dim_contiguous, register_autograd, to_dtype


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """x * rsqrt(mean(x^2, -1) + eps) * (weight + offset) in acc_dtype(x), rounded to x's dtype.
    F.rms_norm's CPU decomposition is these very ops, in this order (the same bits as writing
    them out), in one call from Python instead of seven."""
    xf = to_dtype(x, acc_dtype(x))
    w = to_dtype(weight, xf.dtype)
    return to_dtype(F.rms_norm(xf, x.shape[-1:], w + offset if offset else w, eps), x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           offset: float = 0.0) -> tuple[Tensor, Tensor]:
    summed = (x.to(acc_dtype(x)) + residual.to(acc_dtype(x))).to(x.dtype).contiguous()
    return rms_norm_reference(summed, weight, eps, offset), summed


def rms_norm_backward_reference(dy: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                                dsum: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of rms_norm(x, weight, eps, offset) for output gradient dy; dsum (add_rms_norm's
    second output's gradient) is added to dx."""
    dt = acc_dtype(x)
    xf, dyf = x.to(dt), dy.to(dt)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dyf * (weight.to(dt) + offset)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsum is not None:
        dx = dx + dsum.to(dt)
    dw = (dyf * xhat).reshape(x.shape[:-1].numel(), x.shape[-1]).sum(0)  # N may be 0
    return dx.to(x.dtype), dw.to(weight.dtype)


def _check(op: str, x: Tensor, weight: Tensor, residual: Optional[Tensor] = None):
    check_float(op, "x", x)
    check_float(op, "weight", weight, ndim=1)
    if weight.shape[0] != x.shape[-1]:
        fail(op, f"weight has {weight.shape[0]} elements but x's last dim is {x.shape[-1]}")
    if weight.device != x.device:
        fail(op, f"weight is on {weight.device} but x is on {x.device}")
    if residual is not None:
        check_like(op, "x", x, residual=residual)


def _check_backward(dy, x, weight, eps, offset=0.0, dsum=None):
    op = "rms_norm_backward"
    _check(op, x, weight)
    check_float(op, "dy", dy)
    if dsum is not None:
        check_float(op, "dsum", dsum)  # read with unit stride, as dy
    check_same(op, "x", x, dy=dy, dsum=dsum)
    if dy.shape != x.shape or (dsum is not None and dsum.shape != x.shape):
        fail(op, f"dy {tuple(dy.shape)} / dsum must have x's shape {tuple(x.shape)}")


rms_norm = define(
    rms_norm_reference, kernels.rms_norm,
    check=lambda x, weight, eps, offset: _check("rms_norm", x, weight),
    fake=lambda x, weight, eps, offset: empty_contiguous_like(x))

add_rms_norm = define(
    add_rms_norm_reference, kernels.add_rms_norm,
    check=lambda x, residual, weight, eps, offset: _check("add_rms_norm", x, weight, residual),
    fake=lambda x, residual, weight, eps, offset: (empty_contiguous_like(x), empty_contiguous_like(x)))

rms_norm_backward = define(
    rms_norm_backward_reference, kernels.rms_norm_backward, check=_check_backward,
    fake=lambda dy, x, weight, eps, offset, dsum: (empty_contiguous_like(x), torch.empty_like(weight)),
    dispatch_arg=1)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_bwd(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = rms_norm_backward(last_dim_contiguous(dy), x, weight, ctx.eps, ctx.offset)
    return dx, dw, None, None


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, eps, offset = inputs
    ctx.save_for_backward(output[1], weight)  # the (rounded) sum is what was normalised
    ctx.eps, ctx.offset = eps, offset
    ctx.set_materialize_grads(False)


def _add_rms_norm_bwd(ctx, dy, dsum):
    summed, weight = ctx.saved_tensors
    if dy is None:
        return dsum, dsum, None, None, None
    dx, dw = rms_norm_backward(last_dim_contiguous(dy), summed, weight, ctx.eps, ctx.offset,
                               last_dim_contiguous(dsum))
    return dx, dx, dw, None, None


register_autograd(rms_norm, _rms_norm_bwd, _rms_norm_setup)
register_autograd(add_rms_norm, _add_rms_norm_bwd, _add_rms_norm_setup)
