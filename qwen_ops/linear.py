"""qwen::linear: x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N], qwen::linear_backward, and
qwen::linear_silu_mul(x, gate_up_weight [2I, K]) = silu_mul(linear(x, gate_up_weight)) -> [..., I].

M = prod(x.shape[:-1]) <= 16 (decode) takes the split-K kernel pair, larger M the
tiled GEMM (csrc_free_ops/linear.py). fp32 accumulation, output in x's dtype.

Backward: dx = dy @ W, dW = dy^T @ x, db = sum over rows of dy; gradients not asked for
come back as empty tensors.

linear_silu_mul (inference: no autograd) takes one GEMM whose tiles hold the gate and up products
side by side and store silu(gate) * up, where the TMA GEMM runs (16-bit operands, M > 16 rows, a
config that does not split K); elsewhere the linear and silu_mul kernels one after the other. Its
output is not rounded to x's dtype between the GEMM and the SwiGLU, as the reference's is.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import activation as activation_kernels
from csrc_free_ops import linear as kernels
from csrc_free_ops.common import empty_contiguous_like

from .activation import silu_mul_reference
from .checks import check_float, check_same, fail
from .registry import acc_dtype, define, last_dim_contiguous, no_grad_placeholder, register_autograd, to_dtype


SLICE_FEATURES = 1024
SLICED_ROWS = range(2, 512)
"""linear_reference takes a weight of more than SLICE_FEATURES output features SLICE_FEATURES at a
time when x has SLICED_ROWS rows: one thread of MKL's fp32 GEMM (PyTorch's CPU BLAS) runs such a
product slower whole than in slices (Qwen3-0.6B's fused 6144-feature gate/up and
4096-feature QKV weights in a 128-token prefill; docs/performance.md, the CPU path). One row (a
decode step) and longer prefills run faster whole. Every output feature is the same dot product."""


def linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    dt = acc_dtype(x)
    xf, n = to_dtype(x, dt), weight.shape[0]
    if n <= SLICE_FEATURES or x.shape[:-1].numel() not in SLICED_ROWS:
        return to_dtype(F.linear(xf, to_dtype(weight, dt), None if bias is None else to_dtype(bias, dt)), x.dtype)
    pieces = [F.linear(xf, to_dtype(weight[i:i + SLICE_FEATURES], dt),
                       None if bias is None else to_dtype(bias[i:i + SLICE_FEATURES], dt))
              for i in range(0, n, SLICE_FEATURES)]
    return to_dtype(torch.cat(pieces, dim=-1), x.dtype)


def linear_backward_reference(dy: Tensor, x: Tensor, weight: Tensor, need_dx: bool = True, need_dw: bool = True,
                              need_db: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dx = dy @ W, dW = dy^T @ x, db = sum_rows dy) for y = x @ W^T + b."""
    dt = acc_dtype(x)
    rows = x.shape[:-1].numel()  # not -1: N or K may be 0
    dy2, x2 = dy.to(dt).reshape(rows, weight.shape[0]), x.to(dt).reshape(rows, weight.shape[1])
    dx = (dy2 @ weight.to(dt)).reshape(x.shape).to(x.dtype) if need_dx else no_grad_placeholder(x)
    dw = (dy2.t() @ x2).to(weight.dtype) if need_dw else no_grad_placeholder(weight)
    db = dy2.sum(0).to(weight.dtype) if need_db else no_grad_placeholder(weight)
    return dx, dw, db


def _check(x, weight, bias, op="linear", name="weight"):
    check_float(op, "x", x)
    check_float(op, name, weight, ndim=2)
    check_same(op, "x", x, **{name: weight}, bias=bias)
    if weight.shape[1] != x.shape[-1]:
        fail(op, f"{name} is {tuple(weight.shape)} ([N, K]) but x's last dim is {x.shape[-1]}")
    if x.shape[-1] == 0:
        fail(op, "x's last dim (K) must be positive")
    if bias is not None:
        check_float(op, "bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            fail(op, f"bias has {bias.shape[0]} elements but weight has N={weight.shape[0]} rows")


def _check_backward(dy, x, weight, need_dx, need_dw, need_db):
    op = "linear_backward"
    check_float(op, "dy", dy)
    check_float(op, "x", x)
    check_float(op, "weight", weight, ndim=2)
    check_same(op, "x", x, dy=dy, weight=weight)
    if dy.shape != (*x.shape[:-1], weight.shape[0]) or x.shape[-1] != weight.shape[1]:
        fail(op, f"dy {tuple(dy.shape)}, x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")


def _backward_kernel(dy, x, weight, need_dx, need_dw, need_db):
    dx, dw, db = kernels.linear_backward(dy, x, weight, need_dx, need_dw, need_db)
    return (no_grad_placeholder(x) if dx is None else dx, no_grad_placeholder(weight) if dw is None else dw,
            no_grad_placeholder(weight) if db is None else db)


def _fake_backward(dy, x, weight, need_dx, need_dw, need_db):
    return (empty_contiguous_like(x) if need_dx else no_grad_placeholder(x),
            empty_contiguous_like(weight) if need_dw else no_grad_placeholder(weight),
            weight.new_empty((weight.shape[0],)) if need_db else no_grad_placeholder(weight))


linear = define(linear_reference, kernels.linear, check=_check,
                fake=lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))

linear_backward = define(linear_backward_reference, _backward_kernel, check=_check_backward, fake=_fake_backward,
                         dispatch_arg=1)


def _setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = (tuple(ctx.needs_input_grad) + (False,))[:3]  # bias may be left out
    need_db = bool(need_db and ctx.has_bias)
    dx, dw, db = linear_backward(last_dim_contiguous(dy), x, weight, need_dx, need_dw, need_db)
    return (dx if need_dx else None, dw if need_dw else None, db if need_db else None)


register_autograd(linear, _backward, _setup)


def linear_silu_mul_reference(x: Tensor, gate_up_weight: Tensor) -> Tensor:
    return silu_mul_reference(linear_reference(x, gate_up_weight))


def _check_silu_mul(x, gate_up_weight):
    _check(x, gate_up_weight, None, "linear_silu_mul", "gate_up_weight")
    if gate_up_weight.shape[0] % 2:
        fail("linear_silu_mul", f"gate_up_weight needs an even number of rows (gate, then up), got "
                                f"{gate_up_weight.shape[0]}")


def _silu_mul_kernel(x, gate_up_weight):
    y = kernels.linear_silu_mul(x, gate_up_weight)
    return activation_kernels.silu_mul(kernels.linear(x, gate_up_weight, None)) if y is None else y


linear_silu_mul = define(linear_silu_mul_reference, _silu_mul_kernel, check=_check_silu_mul,
                         fake=lambda x, gate_up_weight: x.new_empty((*x.shape[:-1], gate_up_weight.shape[0] // 2)))
