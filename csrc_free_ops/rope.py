"""Rotary position embedding (NeoX rotate-half), optionally fused with a per-head RMSNorm.

For each head x [D] at position p, with R = rotary_dim and i < R/2:

    inv_freq_i = theta^(-2i/R),   a_i = p * inv_freq_i
    out[i]       = x[i] cos a_i - x[i + R/2] sin a_i
    out[i + R/2] = x[i + R/2] cos a_i + x[i] sin a_i
    out[R:]      = x[R:]                                  (partial rotary passes through)

cos/sin come from the positions inside the kernel, in fp32: no tables in memory (`rotary_cos_sin`:
the angle reduced to [-pi, pi], then the hardware's approximate sin/cos). Positions are exact in
fp32 up to |p| = 2^24 (MAX_POSITION); beyond it the kernels write NaN in the rotated dims of the
position's heads (`fp32_position`: a value check on the host would cost a sync).
With a norm weight w, x is first replaced by x * rsqrt(mean(x^2) + eps) * (w + offset)
(Qwen3's q_norm/k_norm), saving a kernel and a round trip per projection.

Grid: (rows, 2): program (r, 0) handles every q head of row r, (r, 1) every k head.

Backward: a rotation by angle a is orthogonal, so its backward is the rotation by -a applied
to the output gradient (the pass-through dims copy straight back):

    g[i]       =  dy[i] cos a_i + dy[i + R/2] sin a_i
    g[i + R/2] = -dy[i] sin a_i + dy[i + R/2] cos a_i

With the fused q/k norm g is the gradient of the normed head, so the RMSNorm backward over
the head follows, per head of D: dx = rstd * (g w' - xhat mean(g w' xhat)), and dweight =
sum over rows and heads of g * xhat: fp32 partials [P, D] per program, then a fixed-order
sum (deterministic, no atomics). cos/sin are recomputed from the positions exactly as the
forward computes them. Backward grid: (P,), one launch for q and one for k; program p walks
a contiguous range of (token, head) rows in tiles.
"""
import functools
import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .common import (INTERPRET, cdiv, empty_contiguous_like, flat_rows, fp32, kernel, next_power_of_2, num_programs,
                     pdl_launch_dependents, pdl_options, pdl_wait, row_block, sum_partials)


_HARDWARE_TRIG = tl.constexpr(not INTERPRET)  # the interpreter has no libdevice: it takes tl.cos / tl.sin

MAX_POSITION = 1 << 24
"""The largest |position| RoPE takes: positions enter the angle math as fp32, which holds every
integer up to 2^24 and no further (2^24 + 1 would rotate as 2^24)."""
_MAX_POSITION = tl.constexpr(MAX_POSITION)


@triton.jit
def fp32_position(p):
    """An integer position as the fp32 the angles are computed from; NaN where |p| > MAX_POSITION."""
    return tl.where((p >= -_MAX_POSITION) & (p <= _MAX_POSITION), p.to(tl.float32), float("nan"))


@triton.jit
def rotary_cos_sin(angle):
    """(cos, sin) of fp32 angles: the angle is reduced to [-pi, pi] by subtracting k * 2pi in three
    parts (Cody-Waite; k * 6.28125 is exact for |k| < 2^16, so the reduction is exact to fp32
    rounding for angles below ~4e5 rad), then the hardware's approximate sin/cos (absolute error
    ~1e-6 on [-pi, pi]). The rounding of the fp32 angle itself dwarfs both: |angle| * 2^-24 rad
    and more (one ulp of inv_freq times the position), ~1e-4 rad at 2048, 0.03 at 4e5 and a whole
    radian at MAX_POSITION, so long contexts get the accuracy of fp32 angles, not of the reduction.
    tl.cos / tl.sin are libdevice's, whose own reduction made the forward compute-bound
    (docs/performance.md, the small ops)."""
    k = tl.floor(angle * 0.15915494309189535 + 0.5)  # round(angle / 2pi)
    r = tl.fma(k, -6.28125, angle)
    r = tl.fma(k, -1.9353071693331003e-3, r)
    r = tl.fma(k, -1.0253131677018246e-11, r)
    if _HARDWARE_TRIG:
        return libdevice.fast_cosf(r), libdevice.fast_sinf(r)
    return tl.cos(r), tl.sin(r)


@triton.jit
def _rope_heads(
    x_ptr, o_ptr, w_ptr, row, stride_r, stride_h, H, pos, log2_theta, eps, offset,
    D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, USE_PDL: tl.constexpr,
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
    cos, sin = rotary_cos_sin(pos * inv_freq)
    cos, sin = cos[None, :], sin[None, :]
    pdl_launch_dependents(USE_PDL)
    tl.store(dst + i[None, :], (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=m_rot)
    tl.store(dst + HALF + i[None, :], (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=m_rot)
    if PASS > 0:
        tl.store(dst + ROT + p[None, :], xp.to(o_ptr.dtype.element_ty), mask=m_pass)


@kernel
def _rope_kernel(
    q_ptr, k_ptr, pos_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr,
    stride_qr, stride_qh, stride_kr, stride_kh, HQ, HK, log2_theta, eps, offset,
    D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    log2_theta, eps, offset = fp32(log2_theta), fp32(eps), fp32(offset)
    row = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    pos = fp32_position(tl.load(pos_ptr + row))
    if tl.program_id(1) == 0:
        _rope_heads(q_ptr, qo_ptr, qw_ptr, row, stride_qr, stride_qh, HQ, pos, log2_theta, eps, offset,
                    D, ROT, HAS_NORM, BLOCK_HQ, BLOCK_HALF, BLOCK_PASS, USE_PDL)
    else:
        _rope_heads(k_ptr, ko_ptr, kw_ptr, row, stride_kr, stride_kh, HK, pos, log2_theta, eps, offset,
                    D, ROT, HAS_NORM, BLOCK_HK, BLOCK_HALF, BLOCK_PASS, USE_PDL)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """[..., H, D] -> [R, H, D] without a copy when the leading dims flatten to one stride (H may be 0)."""
    return flat_rows(t, keep=2)


def rope(q, k, positions, theta: float, rotary_dim: int, q_norm_weight, k_norm_weight, eps: float, offset: float):
    """q [..., Hq, D], k [..., Hk, D], positions [...] -> (q_out, k_out), contiguous, input dtype."""
    hq, d = q.shape[-2:]
    hk = k.shape[-2]
    q3, k3 = _as_rows(q), _as_rows(k)
    pos = positions.reshape(-1).contiguous()  # an expanded or sliced view has stride != 1
    q_out = empty_contiguous_like(q)
    k_out = empty_contiguous_like(k)
    rows = q3.shape[0]
    if rows == 0:
        return q_out, k_out
    has_norm = q_norm_weight is not None
    _rope_kernel[(rows, 2)](
        q3, k3, pos, q_out, k_out,
        q_norm_weight if has_norm else q3, k_norm_weight if has_norm else k3,
        q3.stride(0), q3.stride(1), k3.stride(0), k3.stride(1), hq, hk,
        math.log2(theta), eps, offset, **_rope_meta(hq, hk, d, rotary_dim, has_norm), **pdl_options(q3),
    )
    return q_out, k_out


@functools.lru_cache(maxsize=None)
def _rope_meta(hq: int, hk: int, d: int, rotary_dim: int, has_norm: bool) -> dict:
    """The forward's constexprs and warps for a head layout (cached: a launch only unpacks them)."""
    return dict(D=d, ROT=rotary_dim, HAS_NORM=has_norm,
                BLOCK_HQ=next_power_of_2(hq), BLOCK_HK=next_power_of_2(hk),  # 0 heads: a masked block of 1
                BLOCK_HALF=next_power_of_2(rotary_dim // 2), BLOCK_PASS=next_power_of_2(d - rotary_dim),
                num_warps=_warps(hq, hk, d, rotary_dim))


def _warps(hq: int, hk: int, d: int, rotary_dim: int) -> int:
    """Warps for the launch's smallest tile ([heads, R/2] rotated, [heads, D - R] passed through, for
    q's heads and k's): at least 4 elements per thread, so no two warps hold copies of one element
    (each copy would be stored to shared memory by the per-head reductions: a benign write-write
    race, but one that compute-sanitizer's racecheck reports)."""
    heads = next_power_of_2(min(hq, hk))
    widths = [rotary_dim // 2] + ([d - rotary_dim] if d > rotary_dim else [])
    return max(1, min(4, heads * next_power_of_2(min(widths)) // 128))


@kernel
def _rope_bwd_kernel(
    dy_ptr, x_ptr, pos_ptr, w_ptr, dx_ptr, dw_part_ptr,
    stride_dyr, stride_dyh, stride_xr, stride_xh,
    NHR, H, PER_PROG, log2_theta, eps, offset,
    D: tl.constexpr, ROT: tl.constexpr, HAS_NORM: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    """Works on head-rows (token, head) hr = token * H + head, BLOCK_R of them per tile; program p
    takes head-rows [p * PER_PROG, ...) and writes its dweight partial to row p."""
    log2_theta, eps, offset = fp32(log2_theta), fp32(eps), fp32(offset)
    HALF: tl.constexpr = ROT // 2
    PASS: tl.constexpr = D - ROT
    pid = tl.program_id(0)
    rr = tl.arange(0, BLOCK_R)
    i = tl.arange(0, BLOCK_HALF)
    p = tl.arange(0, BLOCK_PASS)
    inv_freq = tl.exp2(i.to(tl.float32) * (-2.0 / ROT) * log2_theta)
    if HAS_NORM:
        w1 = (tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32) + offset)[None, :]
        w2 = (tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32) + offset)[None, :]
        wp = (tl.load(w_ptr + ROT + p, mask=p < PASS, other=0.0).to(tl.float32) + offset)[None, :]
        dw1 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
        dw2 = tl.zeros((BLOCK_HALF,), dtype=tl.float32)
        dwp = tl.zeros((BLOCK_PASS,), dtype=tl.float32)
    lo = pid.to(tl.int64) * PER_PROG  # int64 offsets
    hi = min(lo + PER_PROG, NHR)
    for r0 in range(lo, hi, BLOCK_R):
        hr = r0 + rr
        ok = hr < hi
        row = hr // H
        head = hr % H
        m_rot = ok[:, None] & (i[None, :] < HALF)
        m_pass = ok[:, None] & (p[None, :] < PASS)
        pos = fp32_position(tl.load(pos_ptr + row, mask=ok, other=0))
        cos, sin = rotary_cos_sin(pos[:, None] * inv_freq[None, :])
        src = dy_ptr + row[:, None] * stride_dyr + head[:, None] * stride_dyh
        dy1 = tl.load(src + i[None, :], mask=m_rot, other=0.0).to(tl.float32)
        dy2 = tl.load(src + HALF + i[None, :], mask=m_rot, other=0.0).to(tl.float32)
        gp = tl.load(src + ROT + p[None, :], mask=m_pass, other=0.0).to(tl.float32)
        g1 = dy1 * cos + dy2 * sin
        g2 = dy2 * cos - dy1 * sin
        if HAS_NORM:
            xs = x_ptr + row[:, None] * stride_xr + head[:, None] * stride_xh
            x1 = tl.load(xs + i[None, :], mask=m_rot, other=0.0).to(tl.float32)
            x2 = tl.load(xs + HALF + i[None, :], mask=m_rot, other=0.0).to(tl.float32)
            xp = tl.load(xs + ROT + p[None, :], mask=m_pass, other=0.0).to(tl.float32)
            sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1) + tl.sum(xp * xp, axis=1)
            rstd = tl.rsqrt(sq / D + eps)[:, None]
            xh1, xh2, xhp = x1 * rstd, x2 * rstd, xp * rstd
            dw1 += tl.sum(g1 * xh1, axis=0)
            dw2 += tl.sum(g2 * xh2, axis=0)
            dwp += tl.sum(gp * xhp, axis=0)
            gw1, gw2, gwp = g1 * w1, g2 * w2, gp * wp
            mean = (tl.sum(gw1 * xh1, axis=1) + tl.sum(gw2 * xh2, axis=1) + tl.sum(gwp * xhp, axis=1))[:, None] / D
            g1 = rstd * (gw1 - xh1 * mean)
            g2 = rstd * (gw2 - xh2 * mean)
            gp = rstd * (gwp - xhp * mean)
        dst = dx_ptr + hr[:, None] * D  # dx is contiguous [tokens, H, D]
        tl.store(dst + i[None, :], g1.to(dx_ptr.dtype.element_ty), mask=m_rot)
        tl.store(dst + HALF + i[None, :], g2.to(dx_ptr.dtype.element_ty), mask=m_rot)
        tl.store(dst + ROT + p[None, :], gp.to(dx_ptr.dtype.element_ty), mask=m_pass)
    if HAS_NORM:
        part = dw_part_ptr + pid * D
        tl.store(part + i, dw1, mask=i < HALF)
        tl.store(part + HALF + i, dw2, mask=i < HALF)
        tl.store(part + ROT + p, dwp, mask=p < PASS)


def _one(dy, x, pos, weight, theta, rotary_dim, eps, offset):
    """dy, x [..., H, D] -> (dx contiguous in x's dtype, dweight [D] or None)."""
    h, d = x.shape[-2:]
    x3 = _as_rows(x)
    dy3 = _as_rows(dy)
    nhr = x3.shape[0] * h
    dx = empty_contiguous_like(x)
    has_norm = weight is not None
    if nhr == 0:
        return dx, (torch.zeros_like(weight) if has_norm else None)
    p = num_programs(cdiv(nhr, 8))
    per = cdiv(nhr, p)
    p = cdiv(nhr, per)
    partial = torch.empty((p, d) if has_norm else (1, 1), dtype=torch.float32, device=x.device)
    _rope_bwd_kernel[(p,)](
        dy3, x3, pos, weight if has_norm else x3, dx, partial,
        dy3.stride(0), dy3.stride(1), x3.stride(0), x3.stride(1),
        nhr, h, per, math.log2(theta), eps, offset,
        D=d, ROT=rotary_dim, HAS_NORM=has_norm,
        BLOCK_R=min(row_block(next_power_of_2(d)), next_power_of_2(per)),
        BLOCK_HALF=next_power_of_2(rotary_dim // 2),
        BLOCK_PASS=next_power_of_2(d - rotary_dim), num_warps=4,
    )
    return dx, (sum_partials(partial, weight.dtype) if has_norm else None)


def rope_backward(dq, dk, q, k, positions, theta: float, rotary_dim: int, q_norm_weight, k_norm_weight,
                  eps: float, offset: float):
    """Gradients of csrc_free_ops.rope.rope: (dq_in, dk_in, d q_norm_weight or None, d k_norm_weight or None)."""
    pos = positions.reshape(-1).contiguous()  # an expanded or sliced view has stride != 1
    dq_in, dqw = _one(dq, q, pos, q_norm_weight, theta, rotary_dim, eps, offset)
    dk_in, dkw = _one(dk, k, pos, k_norm_weight, theta, rotary_dim, eps, offset)
    return dq_in, dk_in, dqw, dkw
