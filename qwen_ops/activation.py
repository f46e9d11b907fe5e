"""SwiGLU: qwen::silu_mul, qwen::silu_mul_split and their backward ops.

    silu_mul(gate_up [..., 2I]) = silu(gate_up[..., :I]) * gate_up[..., I:]   [..., I]
    silu_mul_split(gate [..., I], up [..., I]) = silu(gate) * up              (transformers'
                                                                              gate_proj / up_proj)
Backward, s = sigmoid(g):  dg = dy * u * s * (1 + g * (1 - s)),  du = dy * g * s.
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import activation as kernels
from csrc_free_ops.common import empty_contiguous_like

from .checks import check_float, check_like, check_same, fail
from .registry import acc_dtype, define, last_dim_contiguous, register_autograd, to_dtype


def silu_mul_reference(gate_up: Tensor) -> Tensor:
    gate, up = to_dtype(gate_up, acc_dtype(gate_up)).chunk(2, dim=-1)
    return to_dtype(F.silu(gate) * up, gate_up.dtype).contiguous()  # the kernel's layout, not gate_up's strides


def silu_mul_split_reference(gate: Tensor, up: Tensor) -> Tensor:
    dt = acc_dtype(gate)
    return (F.silu(gate.to(dt)) * up.to(dt)).to(gate.dtype).contiguous()


def _grads(dy, gate, up):
    dt = acc_dtype(gate)
    g, u, dyf = gate.to(dt), up.to(dt), dy.to(dt)
    s = torch.sigmoid(g)
    return dyf * u * s * (1 + g * (1 - s)), dyf * g * s


def silu_mul_backward_reference(dy: Tensor, gate_up: Tensor) -> Tensor:
    """d gate_up [..., 2I] of silu_mul(gate_up) for output gradient dy [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat(_grads(dy, gate, up), dim=-1).to(gate_up.dtype)


def silu_mul_split_backward_reference(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    dg, du = _grads(dy, gate, up)
    return dg.to(gate.dtype).contiguous(), du.to(gate.dtype).contiguous()


def _check(gate_up: Tensor, dy: Tensor | None = None):
    op = "silu_mul" if dy is None else "silu_mul_backward"
    check_float(op, "gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        fail(op, f"gate_up's last dim must be even (gate and up halves), got {gate_up.shape[-1]}")
    if dy is not None:
        check_float(op, "dy", dy)
        check_same(op, "gate_up", gate_up, dy=dy)
        if dy.shape != (*gate_up.shape[:-1], gate_up.shape[-1] // 2):
            fail(op, f"dy {tuple(dy.shape)} does not match gate_up {tuple(gate_up.shape)}")


def _check_split(gate, up, dy=None):
    op = "silu_mul_split" if dy is None else "silu_mul_split_backward"
    check_float(op, "gate", gate)
    check_float(op, "up", up)
    if dy is not None:
        check_float(op, "dy", dy)
    check_same(op, "gate", gate, up=up, dy=dy)
    if up.shape != gate.shape or (dy is not None and dy.shape != gate.shape):
        fail(op, f"gate {tuple(gate.shape)}, up {tuple(up.shape)}" + ("" if dy is None else f" and dy {tuple(dy.shape)}")
             + " must have one shape")


silu_mul = define(silu_mul_reference, kernels.silu_mul, check=_check,
                  fake=lambda gate_up: gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2)))

silu_mul_split = define(silu_mul_split_reference, kernels.silu_mul_split, check=_check_split,
                        fake=lambda gate, up: empty_contiguous_like(gate))

silu_mul_backward = define(silu_mul_backward_reference, kernels.silu_mul_backward,
                           check=lambda dy, gate_up: _check(gate_up, dy),
                           fake=lambda dy, gate_up: empty_contiguous_like(gate_up), dispatch_arg=1)

silu_mul_split_backward = define(silu_mul_split_backward_reference, kernels.silu_mul_split_backward,
                                 check=lambda dy, gate, up: _check_split(gate, up, dy),
                                 fake=lambda dy, gate, up: (empty_contiguous_like(gate), empty_contiguous_like(gate)),
                                 dispatch_arg=1)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_bwd(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return silu_mul_backward(last_dim_contiguous(dy), gate_up)


def _silu_mul_split_bwd(ctx, dy):
    gate, up = ctx.saved_tensors
    return silu_mul_split_backward(last_dim_contiguous(dy), gate, up)


register_autograd(silu_mul, _silu_mul_bwd, _setup)
register_autograd(silu_mul_split, _silu_mul_split_bwd, _setup)


# ---------------------------------------------------------------------- Qwen3.5 output gate (inference only)
#
#   sigmoid_mul(x, gate) = x * sigmoid(gate)   x, gate [..., N]: the gated attention's output gate.
# No autograd is registered for it.


def sigmoid_mul_reference(x: Tensor, gate: Tensor) -> Tensor:
    dt = acc_dtype(x)
    return (x.to(dt) * torch.sigmoid(gate.to(dt))).to(x.dtype).contiguous()


def _check_sigmoid_mul(x, gate):
    op = "sigmoid_mul"
    check_float(op, "x", x)
    check_like(op, "x", x, gate=gate)


sigmoid_mul = define(sigmoid_mul_reference, kernels.sigmoid_mul, _check_sigmoid_mul,
                     lambda x, gate: empty_contiguous_like(x))
