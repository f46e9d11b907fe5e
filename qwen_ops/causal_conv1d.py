"""qwen::causal_conv1d and qwen::causal_conv1d_update: Qwen3.5 Gated DeltaNet's short convolution.

A depthwise causal conv1d over channels (kernel size K = 4 in Qwen3.5, no bias) followed by
SiLU, on channels-last activations x [B, T, C] (C = 2 * key_dim + value_dim, the fused
in_proj_qkv output). With xs = [state[b, :, 0:K-1], x[b, 0:T, :]^T] along time:

    y[b, t, c] = silu(sum_{j<K} weight[c, j] * xs[b, c, t + j])
    new_state[b, c, i] = xs[b, c, T + i]            (the last K-1 inputs, i < K-1)

causal_conv1d(x [B, T, C], weight [C, K], initial_state [B, C, K-1] or None)
    -> (y [B, T, C], final_state [B, C, K-1]): prefill. Without an initial state the inputs
    before t = 0 are zeros (so with T < K-1 the final state is zero-padded on the left).
causal_conv1d_update(x [B, T, C] (T small, usually 1), conv_state [B, C, K-1], weight [C, K])
    -> y [B, T, C]: decode; conv_state is updated in place to the new state, continuing
    exactly where causal_conv1d (or the previous update) stopped.

This is transformers' `causal_conv1d_fn` / `causal_conv1d_update` (activation "silu") on
[B, T, C] instead of [B, C, T], with the state of length K-1. fp32 math (float64 for float64);
y and the state in x's dtype (the state holds inputs). The weight may have any float dtype.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import causal_conv1d as kernels
from csrc_free_ops.common import empty_contiguous_like

from .checks import check_float, check_same, fail
from .registry import acc_dtype, define

MAX_KERNEL_SIZE = 16


def _conv(x: Tensor, weight: Tensor, state: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(y, new_state) in acc dtype; x [B, T, C], state [B, C, K-1] or None."""
    dt = acc_dtype(x)
    bsz, t, c = x.shape
    k = weight.shape[1]
    if state is None:
        state = torch.zeros(bsz, c, k - 1, dtype=dt, device=x.device)
    xs = torch.cat([state.to(dt), x.transpose(1, 2).to(dt)], dim=-1)  # [B, C, K-1+T]
    w = weight.to(dt)
    y = sum(w[:, j, None] * xs[..., j:j + t] for j in range(k))  # [B, C, T]
    return F.silu(y).transpose(1, 2), xs[..., xs.shape[-1] - (k - 1):]


def causal_conv1d_reference(x: Tensor, weight: Tensor,
                            initial_state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    y, state = _conv(x, weight, initial_state)
    return y.to(x.dtype).contiguous(), state.to(x.dtype).contiguous()


def causal_conv1d_update_reference(x: Tensor, conv_state: Tensor, weight: Tensor) -> Tensor:
    y, state = _conv(x, weight, conv_state)
    conv_state.copy_(state)
    return y.to(x.dtype).contiguous()


def _check(op: str, x: Tensor, weight: Tensor, state: Optional[Tensor], state_name: str):
    check_float(op, "x", x, ndim=3)
    check_float(op, "weight", weight, ndim=2)
    if weight.device != x.device:
        fail(op, f"weight is on {weight.device} but x is on {x.device}")
    c, k = weight.shape
    if c != x.shape[2]:
        fail(op, f"weight has {c} channels (weight [C, K]) but x [B, T, C] has {x.shape[2]}")
    if not 2 <= k <= MAX_KERNEL_SIZE:
        fail(op, f"kernel size (weight.shape[1]) must be between 2 and {MAX_KERNEL_SIZE}, got {k}")
    if state is not None:
        check_float(op, state_name, state, ndim=3)
        check_same(op, "x", x, **{state_name: state})
        want = (x.shape[0], c, k - 1)
        if tuple(state.shape) != want:
            fail(op, f"{state_name} must have shape [B, C, K-1] = {want}, got {tuple(state.shape)}")


def _check_conv(x, weight, initial_state=None):
    _check("causal_conv1d", x, weight, initial_state, "initial_state")


def _check_update(x, conv_state, weight):
    _check("causal_conv1d_update", x, weight, conv_state, "conv_state")


def _fake_conv(x, weight, initial_state=None):
    bsz, t, c = x.shape
    return (torch.empty((bsz, t, c), dtype=x.dtype, device=x.device),
            torch.empty((bsz, c, weight.shape[1] - 1), dtype=x.dtype, device=x.device))


def _fake_update(x, conv_state, weight):
    return empty_contiguous_like(x)


causal_conv1d = define(causal_conv1d_reference, kernels.causal_conv1d, _check_conv, _fake_conv)
causal_conv1d_update = define(causal_conv1d_update_reference, kernels.causal_conv1d_update, _check_update,
                              _fake_update, mutates_args=("conv_state",))
