"""qwen::rope: rotate-half RoPE on the first rotary_dim dims of each head, with an optional fused q/k RMSNorm.

q [..., Hq, D], k [..., Hk, D], positions [...] (= q.shape[:-2]) -> (q_out, k_out), same shapes:

    inv_freq_i = theta^(-2i/R)  (i < R/2),  a = positions * inv_freq
    x_out = [x1 cos a - x2 sin a,  x2 cos a + x1 sin a,  x[R:]],   x1 = x[:R/2], x2 = x[R/2:R]

With q_norm_weight/k_norm_weight, each head is first RMS-normed over D (Qwen3's q_norm/k_norm).

Positions lie in [-2^24, 2^24] (MAX_POSITION): the angles are fp32 (float64 for float64 inputs),
and fp32 holds every integer only up to 2^24. CPU tensors outside raise (a value check, free
there); on CUDA a check would cost a host sync, so the kernels write NaN in the rotated dims
of such a position's heads instead, as the reference does.

qwen::rope_backward: a rotation is orthogonal, so the backward rotates the output gradients by
-a, then (with the fused norm) runs the RMSNorm backward over each head.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from csrc_free_ops import rope as kernels
from csrc_free_ops.common import empty_contiguous_like
from csrc_free_ops.rope import MAX_POSITION

from .checks import check_float, check_index, check_same, fail
from .norm import rms_norm_backward_reference, rms_norm_reference
from .registry import acc_dtype, define, last_dim_contiguous, no_grad_placeholder, register_autograd, to_dtype


def rope_cos_sin(positions: Tensor, theta: float, rotary_dim: int, dtype: torch.dtype):
    """cos, sin of the angles [..., 1, R/2] (broadcast over heads) for positions [...]; NaN for a
    position outside [-MAX_POSITION, MAX_POSITION], as in the kernels."""
    exponents = torch.arange(0, rotary_dim, 2, device=positions.device, dtype=dtype) / rotary_dim
    inv_freq = (theta ** exponents).reciprocal()  # 1 / theta^(2i/R), rounded as transformers rounds it
    outside = positions.clamp(-MAX_POSITION, MAX_POSITION) != positions
    angle = (positions[..., None, None] * inv_freq).masked_fill_(outside[..., None, None], float("nan"))
    return angle.cos(), angle.sin()


def rope_reference(q: Tensor, k: Tensor, positions: Tensor, theta: float, rotary_dim: int,
                   q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                   norm_eps: float = 1e-6, norm_offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """q and k in one pass: each RMS-normed with its weight (when given), then joined over the
    heads [..., Hq + Hk, D] and rotated by one set of products; the outputs are contiguous."""
    dt = acc_dtype(q)
    half, hq = rotary_dim // 2, q.shape[-2]
    cos, sin = rope_cos_sin(positions, theta, rotary_dim, dt)
    qf, kf = to_dtype(q, dt), to_dtype(k, dt)
    if q_norm_weight is not None:
        qf = rms_norm_reference(qf, q_norm_weight, norm_eps, norm_offset)
        kf = rms_norm_reference(kf, k_norm_weight, norm_eps, norm_offset)
    x = torch.cat([qf, kf], dim=-2)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
    return to_dtype(out[..., :hq, :], q.dtype).contiguous(), to_dtype(out[..., hq:, :], k.dtype).contiguous()


def _check(q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight):
    op = "rope"
    check_float(op, "q", q, min_ndim=2)
    check_float(op, "k", k, min_ndim=2)
    check_same(op, "q", q, k=k, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight)
    if q.shape[:-2] != k.shape[:-2] or q.shape[-1] != k.shape[-1]:
        fail(op, f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in leading dims and head_dim")
    check_index(op, "positions", positions, q.shape[:-2])
    if positions.device != q.device:
        fail(op, f"positions is on {positions.device} but q is on {q.device}")
    d = q.shape[-1]
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        fail(op, f"rotary_dim must be even and in (0, head_dim={d}], got {rotary_dim}")
    if not 0.0 < theta < math.inf:  # theta^(-2i/R): 0, negative, inf or NaN give NaN angles
        fail(op, f"theta (the RoPE base) must be positive and finite, got {theta}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        fail(op, "give both q_norm_weight and k_norm_weight, or neither")
    if q_norm_weight is not None:
        for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
            check_float(op, name, w, ndim=1)  # read with unit stride
            if w.shape[0] != d:
                fail(op, f"{name} must have shape ({d},), got {tuple(w.shape)}")


def check_positions(positions: Tensor, op: str = "rope"):
    """Value check, CPU tensors only (free there; a host sync on CUDA, where the kernels write NaN instead)."""
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < -MAX_POSITION or hi > MAX_POSITION:
            fail(op, f"positions must lie in [-2^24, 2^24] (the angles are fp32, exact for integers up to "
                         f"2^24 only), got values in [{lo}, {hi}]")


def rope_backward_reference(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, positions: Tensor, theta: float,
                            rotary_dim: int, q_norm_weight: Optional[Tensor] = None,
                            k_norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-6,
                            norm_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq_in, dk_in, d q_norm_weight, d k_norm_weight) of rope(q, k, ...) for output gradients dq, dk.
    Without norm weights the last two are empty tensors."""
    dt = acc_dtype(q)
    half = rotary_dim // 2
    cos, sin = rope_cos_sin(positions, theta, rotary_dim, dt)

    def unrotate(dy, x, w):
        dyf = dy.to(dt)
        d1, d2, rest = dyf[..., :half], dyf[..., half:rotary_dim], dyf[..., rotary_dim:]
        g = torch.cat([d1 * cos + d2 * sin, d2 * cos - d1 * sin, rest], dim=-1)
        if w is None:
            return g.to(x.dtype), no_grad_placeholder(x)
        return rms_norm_backward_reference(g, x, w, norm_eps, norm_offset)

    dq_in, dqw = unrotate(dq, q, q_norm_weight)
    dk_in, dkw = unrotate(dk, k, k_norm_weight)
    return dq_in, dk_in, dqw, dkw


def _check_backward(dq, dk, q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight, norm_eps, norm_offset):
    _check(q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight)
    check_float("rope_backward", "dq", dq)  # the kernel reads the gradients' heads with unit stride
    check_float("rope_backward", "dk", dk)
    check_same("rope_backward", "q", q, dq=dq, dk=dk)
    if dq.shape != q.shape or dk.shape != k.shape:
        fail("rope_backward", f"dq {tuple(dq.shape)} / dk {tuple(dk.shape)} must match q {tuple(q.shape)} / k {tuple(k.shape)}")


def _backward_kernel(dq, dk, q, k, *args):
    dq_in, dk_in, dqw, dkw = kernels.rope_backward(dq, dk, q, k, *args)
    return dq_in, dk_in, no_grad_placeholder(q) if dqw is None else dqw, no_grad_placeholder(k) if dkw is None else dkw


def _fake_backward(dq, dk, q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight, norm_eps, norm_offset):
    def w_grad(w, ref):
        return no_grad_placeholder(ref) if w is None else torch.empty_like(w)
    return empty_contiguous_like(q), empty_contiguous_like(k), w_grad(q_norm_weight, q), w_grad(k_norm_weight, k)


rope = define(rope_reference, kernels.rope,
              check=lambda q, k, positions, theta, rotary_dim, qw, kw, eps, offset:
              _check(q, k, positions, theta, rotary_dim, qw, kw),
              fake=lambda q, k, *args: (empty_contiguous_like(q), empty_contiguous_like(k)),
              check_values=lambda q, k, positions, *args: check_positions(positions))

rope_backward = define(rope_backward_reference, _backward_kernel, check=_check_backward, fake=_fake_backward,
                       dispatch_arg=2, check_values=lambda dq, dk, q, k, positions, *args: check_positions(positions))


def _setup(ctx, inputs, output):
    q, k, positions, theta, rotary_dim, qw, kw, eps, offset = inputs
    # Without the fused norm the backward is a pure rotation: q and k need not be kept.
    has_norm = qw is not None
    ctx.save_for_backward(q if has_norm else None, k if has_norm else None, positions, qw, kw)
    ctx.args = (theta, rotary_dim, eps, offset)


def _backward(ctx, dq, dk):
    q, k, positions, qw, kw = ctx.saved_tensors
    theta, rotary_dim, eps, offset = ctx.args
    dq, dk = last_dim_contiguous(dq), last_dim_contiguous(dk)
    if qw is None:  # only their shapes and dtypes are read
        q, k = dq, dk
    dq_in, dk_in, dqw, dkw = rope_backward(dq, dk, q, k, positions, theta, rotary_dim, qw, kw, eps, offset)
    has_norm = qw is not None
    return (dq_in, dk_in, None, None, None, dqw if has_norm else None, dkw if has_norm else None, None, None)


register_autograd(rope, _backward, _setup)
