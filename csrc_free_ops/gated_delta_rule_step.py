"""Gated DeltaNet's decode step and its two small companions: the recurrent gated delta rule, the
gates of the chunked prefill and the gated RMSNorm of the layer's output.

`_recurrent_kernel`: one program per (sequence, head, value block) walks the sequence's tokens
with the state in registers, fusing the l2 norms, g = -exp(A_log) softplus(a + dt_bias) and
beta = sigmoid(b); it updates the state in place. Packed sequences: sequence i holds rows
cu_seqlens[i]:cu_seqlens[i + 1] of q, k, v, a, b and its state is row state_slots[i] of a pool,
read where continues[i] (else zeros) and written back in place (a length-0 sequence touches
nothing): the engine's decode tokens straight from and to their pool slots. No host sync, no
value-dependent allocation.

`_gated_rms_norm_kernel`: y = rms_norm(x) * weight * silu(z) over the last dim, with the
roundings of transformers' Qwen3_5RMSNormGated (see qwen_ops/gated_delta_rule.py).
"""
import torch
import triton
import triton.language as tl

from . import gated_delta_rule as chunked
from .common import INTERPRET, cdiv, empty_contiguous_like, flat_rows, fp32, head_block, head_mask, kernel, \
    next_power_of_2, row_warps, target_programs


@triton.jit
def _softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20): log1p(exp(x)), x above 20."""
    y = tl.exp(-tl.abs(x))
    one_y = 1.0 + y
    log1p = tl.where(one_y == 1.0, y, tl.log(one_y) * (y / (one_y - 1.0)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@kernel
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, cu_ptr, slot_ptr, cont_ptr, scale,
    H, GROUP,
    sqt, sqh, skt, skh, svt, svh, sat, sah, sbt, sbh,
    ssb, ssh, ssk, sot, soh,
    NORM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
    """Program (value block, sequence * H + head): the packed rows [cu[seq], cu[seq + 1]), state row
    slot[seq] of the pool, read where cont[seq] (else zeros), written unless the sequence is empty."""
    scale = fp32(scale)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    h = i_bh % H
    hk = h // GROUP
    seq = i_bh // H
    bos = tl.load(cu_ptr + seq)
    eos = tl.load(cu_ptr + seq + 1)
    srow = tl.load(slot_ptr + seq).to(tl.int64)
    dk = tl.arange(0, head_block(DK))
    dk_ok = head_mask(dk, DK)
    cv = i_v * BV + tl.arange(0, BV)
    s_ptrs = s_ptr + srow * ssb + h * ssh + dk[:, None] * ssk + cv[None, :]
    cv_ok = head_mask(cv, DV)
    s_ok = dk_ok[:, None] & cv_ok[None, :]
    s = tl.load(s_ptrs, mask=tl.where(tl.load(cont_ptr + seq) != 0, s_ok, False), other=0.0)
    s_out_ok = tl.where(eos > bos, s_ok, False)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(bos, eos):
        q = tl.load(q_ptr + t * sqt + hk * sqh + dk, mask=dk_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * skt + hk * skh + dk, mask=dk_ok, other=0.0).to(tl.float32)
        if NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + t * svt + h * svh + cv, mask=cv_ok, other=0.0).to(tl.float32)
        g = neg_a * _softplus(tl.load(a_ptr + t * sat + h * sah).to(tl.float32) + dt_bias)
        braw = tl.load(b_ptr + t * sbt + h * sbh)
        beta = tl.sigmoid(braw.to(tl.float32)).to(braw.dtype).to(tl.float32)  # sigmoid in b's dtype
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + t * sot + h * soh + cv, o.to(o_ptr.dtype.element_ty), mask=cv_ok)
    tl.store(s_ptrs, s, mask=s_out_ok)


def recurrent_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, state_slots, continues,
                                      scale: float, use_qk_l2norm: bool = True):
    """q, k [N, Hk, Dk], v [N, Hv, Dv], a, b [N, Hv] of S packed sequences (usually one token each),
    state_pool [P, Hv, Dk, Dv] fp32 (row state_slots[i] read where continues[i], written back in
    place) -> o [N, Hv, Dv] in q.dtype."""
    n, hv, dv = v.shape
    hk, dk = k.shape[1], k.shape[2]
    o = torch.empty((n, hv, dv), dtype=q.dtype, device=q.device)
    seqs = state_slots.shape[0]
    if seqs * hv == 0:
        return o
    bv = chunked._value_block(dk, dv, seqs * hv, target_programs(q.device))  # (its module's: tests patch it)
    _recurrent_kernel[(cdiv(dv, bv), seqs * hv)](
        q, k, v, a, b, A_log, dt_bias, state_pool, o, cu_seqlens, state_slots, continues, scale, hv, hv // hk,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), a.stride(1),
        b.stride(0), b.stride(1), state_pool.stride(0), state_pool.stride(1), state_pool.stride(2),
        o.stride(0), o.stride(1),
        NORM=bool(use_qk_l2norm), DK=dk, DV=dv, BV=bv, num_warps=4,
    )
    return o


@kernel
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, ROWS, HEADS, N, eps, stride_x, stride_xh, stride_z, stride_zh, stride_y, stride_yh,
    ROUND_WEIGHT_PRODUCT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Row r of the flat [ROWS = R * HEADS, N] view is head r % HEADS of leading row r // HEADS,
    each tensor with its own two strides: a gate that is a strided slice of a projection is read
    in place."""
    eps = fp32(eps)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = rows.to(tl.int64)
    lead, head = (r64 // HEADS)[:, None], (r64 % HEADS)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < ROWS)[:, None] & (cols < N)
    xr = tl.load(x_ptr + lead * stride_x + head * stride_xh + cols, mask=mask, other=0.0)
    x = xr.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    # transformers rounds the normalised x to x's dtype before the weight (and the product too
    # when the weight has x's dtype); the gate product is fp32.
    y = (x * rstd[:, None]).to(xr.dtype).to(tl.float32)
    y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if ROUND_WEIGHT_PRODUCT:
        y = y.to(xr.dtype).to(tl.float32)
    z = tl.load(z_ptr + lead * stride_z + head * stride_zh + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (z * tl.sigmoid(z))
    tl.store(y_ptr + lead * stride_y + head * stride_yh + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def _heads(t: torch.Tensor) -> torch.Tensor:
    """t [..., H, N] as [R, H, N] (a 1-d or 2-d t: H = 1), a view wherever the leading dims allow."""
    if t.dim() <= 2:
        return flat_rows(t)[:, None]
    return t.flatten(0, -3) if t.dim() > 3 else t


def gated_rms_norm(x, z, weight, eps: float):
    """x, z [..., N], weight [N] -> rms_norm(x) * weight * silu(z) [..., N] in x.dtype (contiguous).
    x and z may be strided over their last two leading dims (heads, tokens) without a copy."""
    n = x.shape[-1]
    y = empty_contiguous_like(x)
    x3, z3, y3 = _heads(x), _heads(z), _heads(y)
    rows = x3.shape[0] * x3.shape[1]
    if rows == 0 or n == 0:
        return y
    block_n = next_power_of_2(n)
    block_r = max(1, min((16384 if INTERPRET else 2048) // block_n, next_power_of_2(rows)))
    _gated_rms_norm_kernel[(cdiv(rows, block_r),)](
        x3, z3, weight, y3, rows, x3.shape[1], n, eps, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1),
        y3.stride(0), y3.stride(1), ROUND_WEIGHT_PRODUCT=weight.dtype == x.dtype, BLOCK_R=block_r, BLOCK_N=block_n,
        num_warps=row_warps(block_r * block_n),
    )
    return y


# ----------------------------------------------------------------------------- gates
#   gated_delta_gates(a, b [..., H], A_log, dt_bias [H]) -> (g, beta): the prefill's decays and
#   write strengths, g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b) (b's dtype);
#   the recurrent kernel computes the same inline.


@kernel
def _gated_delta_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, stride_a, stride_b, ROWS, H,
                              BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    h = tl.arange(0, BLOCK_H)[None, :]
    mask = (r < ROWS) & (h < H)
    neg_a = -tl.exp(tl.load(alog_ptr + h, mask=h < H, other=0.0).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + r * stride_a + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(g_ptr + r * H + h, neg_a * _softplus(a + dt_bias), mask=mask)
    braw = tl.load(b_ptr + r * stride_b + h, mask=mask, other=0.0)
    tl.store(beta_ptr + r * H + h, tl.sigmoid(braw.to(tl.float32)).to(beta_ptr.dtype.element_ty), mask=mask)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """a, b [..., H] (last dim contiguous), A_log, dt_bias [H] -> (g [..., H] fp32, beta [..., H] in
    b's dtype), both contiguous."""
    h = a.shape[-1]
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = empty_contiguous_like(b)
    if g.numel() == 0:
        return g, beta
    rows = g.numel() // h
    a2, b2 = a.reshape(rows, h), b.reshape(rows, h)
    block_h = next_power_of_2(h)
    block_r = min(next_power_of_2(rows), max(1, (16384 if INTERPRET else 2048) // block_h))
    _gated_delta_gates_kernel[(cdiv(rows, block_r),)](
        a2, b2, A_log, dt_bias, g, beta, a2.stride(0), b2.stride(0), rows, h,
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)
    return g, beta
