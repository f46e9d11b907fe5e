"""Rotary position embedding (NeoX rotate-half), optionally fused with a per-head RMSNorm.

For each head x [D] at position p, with R = rotary_dim and i < R/2:

    inv_freq_i = theta^(-2i/R),   a_i = p * inv_freq_i
    out[i]       = x[i] cos a_i - x[i + R/2] sin a_i
    out[i + R/2] = x[i + R/2] cos a_i + x[i] sin a_i
    out[R:]      = x[R:]                                  (partial rotary passes through)

cos/sin come from the positions inside the kernel, in fp32: no tables in memory.
With a norm weight w, x is first replaced by x * rsqrt(mean(x^2) + eps) * (w + offset)
(Qwen3's q_norm/k_norm), saving a kernel and a round trip per projection.

Grid: (rows, 2): program (r, 0) handles every q head of row r, (r, 1) every k head.
"""
import math

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_heads(
    x_ptr, o_ptr, w_ptr, row, stride_r, stride_h, H, pos, log2_theta, eps, offset,
    D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = D - ROT
    heads = tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    m_rot = (heads[:, None] < H) & (i[None, :] < HALF)
    src = x_ptr + row * stride_r + heads[:, None] * stride_h
    dst = o_ptr + row * (H * D) + heads[:, None] * D
    x1 = tl.load(src + i[None, :], mask=m_rot, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i[None, :], mask=m_rot, other=0.0).to(tl.float32)
    if PASS > 0:
        p = tl.arange(0, BLOCK_PASS)
        m_pass = (heads[:, None] < H) & (p[None, :] < PASS)
        xp = tl.load(src + ROT + p[None, :], mask=m_pass, other=0.0).to(tl.float32)
    if HAS_NORM:
        sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        if PASS > 0:
            sq += tl.sum(xp * xp, axis=1)
        rstd = tl.rsqrt(sq / D + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32) + offset
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32) + offset
        x1 = x1 * rstd * w1[None, :]
        x2 = x2 * rstd * w2[None, :]
        if PASS > 0:
            wp = tl.load(w_ptr + ROT + p, mask=p < PASS, other=0.0).to(tl.float32) + offset
            xp = xp * rstd * wp[None, :]
    inv_freq = tl.exp2(i.to(tl.float32) * (-2.0 / ROT) * log2_theta)
    angle = pos * inv_freq
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    tl.store(dst + i[None, :], (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=m_rot)
    tl.store(dst + HALF + i[None, :], (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=m_rot)
    if PASS > 0:
        tl.store(dst + ROT + p[None, :], xp.to(o_ptr.dtype.element_ty), mask=m_pass)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr,
    stride_qr, stride_qh, stride_kr, stride_kh, HQ, HK, log2_theta, eps, offset,
    D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.float32)
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr, qo_ptr, qw_ptr, row, stride_qr, stride_qh, HQ, pos, log2_theta, eps, offset,
                    D, ROT, HAS_NORM, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS)
    else:
        _rope_heads(k_ptr, ko_ptr, kw_ptr, row, stride_kr, stride_kh, HK, pos, log2_theta, eps, offset,
                    D, ROT, HAS_NORM, BLOCK_HK, BLOCK_HALF, BLOCK_PASS)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H, D] -> [R, H, D] without a copy when the leading dims flatten to one stride."""
    return t.reshape(-1, t.shape[-2], t.shape[-1])


def rope(q, k, positions, theta: float, rotary_dim: int, q_norm_weight, k_norm_weight, eps: float, offset: float):
    """q [..., Hq, D], k [..., Hk, D], positions [...] -> (q_out, k_out), contiguous, input dtype."""
    hq, d = q.shape[-2:]
    hk = k.shape[-2]
    q3, k3 = _as_rows(q), _as_rows(k)
    pos = positions.reshape(-1).contiguous()  # an expanded or sliced view has stride != 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    rows = q3.shape[0]
    if rows == 0:
        return q_out, k_out
    has_norm = q_norm_weight is not None
    _rope_kernel[(rows, 2)](
        q3, k3, pos, q_out, k_out,
        q_norm_weight if has_norm else q3, k_norm_weight if has_norm else k3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), hq, hk,
        math.log2(theta), eps, offset,
        D=d, ROT=rotary_dim, HAS_NORM=has_norm,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_HALF=triton.next_power_of_2(max(rotary_dim // 2, 1)),
        BLOCK_PASS=triton.next_power_of_2(max(d - rotary_dim, 1)),
        num_warps=4,
    )
    return q_out, k_out
