"""qwen::rope: rotate-half RoPE on the first rotary_dim dims of each head, with an optional fused q/k RMSNorm.

q [..., Hq, D], k [..., Hk, D], positions [...] (= q.shape[:-2]) -> (q_out, k_out), same shapes:

    inv_freq_i = theta^(-2i/R)  (i < R/2),  a = positions * inv_freq
    x_out = [x1 cos a - x2 sin a,  x2 cos a + x1 sin a,  x[R:]],   x1 = x[:R/2], x2 = x[R/2:R]

With q_norm_weight/k_norm_weight, each head is first RMS-normed over D (Qwen3's q_norm/k_norm).
"""
from typing import Optional

import torch
from torch import Tensor

from csrc_free_ops import rope as kernels

from .checks import check_float, check_index, check_same, fail
from .dispatch import acc_dtype, use_triton
from .norm import rms_norm_reference


def rope_cos_sin(positions: Tensor, theta: float, rotary_dim: int, dtype: torch.dtype):
    """cos, sin of the angles [..., 1, R/2] (broadcast over heads) for positions [...]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, device=positions.device, dtype=dtype) / rotary_dim)
    angle = positions.to(dtype)[..., None, None] * inv_freq
    return angle.cos(), angle.sin()


def rope_reference(q: Tensor, k: Tensor, positions: Tensor, theta: float, rotary_dim: int,
                   q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                   norm_eps: float = 1e-6, norm_offset: float = 0.0):
    dt = acc_dtype(q)
    half = rotary_dim // 2
    cos, sin = rope_cos_sin(positions, theta, rotary_dim, dt)

    def rotate(x, w):
        xf = x.to(dt)
        if w is not None:
            xf = rms_norm_reference(xf, w, norm_eps, norm_offset)
        x1, x2, rest = xf[..., :half], xf[..., half:rotary_dim], xf[..., rotary_dim:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1).to(x.dtype)

    return rotate(q, q_norm_weight), rotate(k, k_norm_weight)


def _check(q, k, positions, rotary_dim, q_norm_weight, k_norm_weight):
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
    if (q_norm_weight is None) != (k_norm_weight is None):
        fail(op, "give both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and tuple(w.shape) != (d,):
            fail(op, f"{name} must have shape ({d},), got {tuple(w.shape)}")


@torch.library.custom_op("qwen::rope", mutates_args=())
def rope(q: Tensor, k: Tensor, positions: Tensor, theta: float, rotary_dim: int,
         q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
         norm_eps: float = 1e-6, norm_offset: float = 0.0) -> tuple[Tensor, Tensor]:
    _check(q, k, positions, rotary_dim, q_norm_weight, k_norm_weight)
    if use_triton(q):
        return kernels.rope(q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight, norm_eps, norm_offset)
    return rope_reference(q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight, norm_eps, norm_offset)


@rope.register_fake
def _(q, k, positions, theta, rotary_dim, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6, norm_offset=0.0):
    _check(q, k, positions, rotary_dim, q_norm_weight, k_norm_weight)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device),
            torch.empty(k.shape, dtype=k.dtype, device=k.device))
