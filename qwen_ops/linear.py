"""qwen::linear: x [..., K] @ weight[N, K].T (+ bias[N]) -> [..., N].

M = prod(x.shape[:-1]) <= 16 (decode) takes the split-K kernel pair, larger M the
tiled GEMM (csrc_free_ops/gemm.py). fp32 accumulation, output in x's dtype.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import gemm as kernels

from .checks import check_float, check_same, fail
from .dispatch import acc_dtype, use_triton


def linear_reference(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    dt = acc_dtype(x)
    return F.linear(x.to(dt), weight.to(dt), None if bias is None else bias.to(dt)).to(x.dtype)


def _check(x, weight, bias):
    op = "linear"
    check_float(op, "x", x)
    check_float(op, "weight", weight, ndim=2)
    check_same(op, "x", x, weight=weight, bias=bias)
    if weight.shape[1] != x.shape[-1]:
        fail(op, f"weight is {tuple(weight.shape)} ([N, K]) but x's last dim is {x.shape[-1]}")
    if x.shape[-1] == 0:
        fail(op, "x's last dim (K) must be positive")
    if bias is not None:
        check_float(op, "bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            fail(op, f"bias has {bias.shape[0]} elements but weight has N={weight.shape[0]} rows")


@torch.library.custom_op("qwen::linear", mutates_args=())
def linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    _check(x, weight, bias)
    if use_triton(x):
        return kernels.linear(x, weight, bias)
    return linear_reference(x, weight, bias)


@linear.register_fake
def _(x, weight, bias=None):
    _check(x, weight, bias)
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
