"""Flash-attention backward (FlashAttention-2 style), and a forward that also returns the row
log-sum-exp the backward needs.

Layouts as in csrc_free_ops/attention.py: q/o/dO [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (any
strides, last dim contiguous), kv head = q head // GROUP; causal query i sits at position
Sk - Sq + i. lse [B, Hq, Sq] fp32 is the natural-log log-sum-exp of the scaled scores.

Nothing of size Sq x Sk is stored: every kernel recomputes its tile of P = exp(s - lse).

1. lse, when the forward did not keep it: attention.py's forward kernel run for the row
   statistics only (`attention_with_lse(..., write_o=False)`).
2. preprocess: delta_i = sum_d dO_id * O_id (minus dlse_i when lse itself gets a gradient),
   grid (cdiv(Sq, BLOCK), B*Hq).
3. dK/dV, grid (cdiv(Sk, BLOCK_N), B*Hk): a program owns one key block of one kv head, holds
   k, v and the fp32 accumulators dk, dv in registers and walks, for each of the GROUP query
   heads of its kv head in turn, every query block that can see it:
       P^T = exp2(k q^T * scale*log2e - lse*log2e),  dV += P^T dO,
       dP^T = v dO^T,  dS^T = P^T * (dP^T - delta),  dK += dS^T q
   GQA's sum over the heads of a group is this loop: fixed order, no atomics.
4. dQ, grid (cdiv(Sq, BLOCK_M), B*Hq): a program owns one query block and walks the key
   blocks it sees:  dS = P * (dO v^T - delta),  dQ += dS k.
dK and dQ get the softmax scale at the end. Two kernels instead of one with atomic dQ:
deterministic, at the price of recomputing q k^T twice.
"""
import torch
import triton
import triton.language as tl

from .attention import LOG2E, attention_with_lse
from .triton_helpers import INTERPRET, dot


@triton.jit
def _bwd_preprocess_kernel(
    o_ptr, do_ptr, dlse_ptr, delta_ptr,
    stride_ob, stride_os, stride_oh, stride_db, stride_ds, stride_dh,
    SQ, HQ, HAS_DLSE: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    m = offs_m[:, None] < SQ
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=m, other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :], mask=m, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = pid_bh.to(tl.int64) * SQ + offs_m
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row, mask=offs_m < SQ, other=0.0)
    tl.store(delta_ptr + row, delta, mask=offs_m < SQ)


@triton.jit
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    SQ, SK, HQ, HK, GROUP, qk_scale, scale,
    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HK).to(tl.int64)
    hk = pid_bh % HK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_mb = tl.arange(0, BLOCK_M)
    col_ok = offs_n < SK
    k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    v = tl.load(v_ptr + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=col_ok[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, D), dtype=tl.float32)
    delta_pos = SK - SQ
    lo = 0
    if CAUSAL:
        # The first query that sees key n0 is n0 - (Sk - Sq).
        lo = tl.maximum(pid_n * BLOCK_N - delta_pos, 0) // BLOCK_M * BLOCK_M
    for g in range(0, GROUP):
        h = hk * GROUP + g
        q_base = q_ptr + b * stride_qb + h * stride_qh
        do_base = do_ptr + b * stride_db + h * stride_dh
        stat_base = (b * HQ + h) * SQ
        for m0 in range(lo, SQ, BLOCK_M):
            offs_m = m0 + offs_mb
            row_ok = offs_m < SQ
            qt = tl.load(q_base + offs_m[None, :] * stride_qs + offs_d[:, None], mask=row_ok[None, :], other=0.0)
            do = tl.load(do_base + offs_m[:, None] * stride_ds + offs_d[None, :], mask=row_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + stat_base + offs_m, mask=row_ok, other=0.0) * 1.4426950408889634
            dlt = tl.load(delta_ptr + stat_base + offs_m, mask=row_ok, other=0.0)
            st = dot(k, qt, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)) * qk_scale
            valid = row_ok[None, :] & col_ok[:, None]
            if CAUSAL:
                valid = valid & (offs_n[:, None] <= offs_m[None, :] + delta_pos)
            pt = tl.where(valid, tl.exp2(st - lse[None, :]), 0.0)
            dv = dot(pt.to(do.dtype), do, dv)
            dpt = dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
            dst = pt * (dpt - dlt[None, :])
            dk = dot(dst.to(qt.dtype), tl.trans(qt), dk)
    out = b * SK * HK * D + hk * D + offs_n[:, None] * (HK * D) + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=col_ok[:, None])
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    SQ, SK, HQ, GROUP, qk_scale, scale,
    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    row_ok = offs_m < SQ
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :],
                 mask=row_ok[:, None], other=0.0)
    stat = pid_bh.to(tl.int64) * SQ + offs_m
    lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0) * 1.4426950408889634
    dlt = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    delta_pos = SK - SQ
    hi = SK
    if CAUSAL:
        hi = min(SK, (pid_m + 1) * BLOCK_M + delta_pos)
    dq = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + offs_n0
        col_ok = offs_n < SK
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vs + offs_d[:, None], mask=col_ok[None, :], other=0.0)
        s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)) * qk_scale
        valid = row_ok[:, None] & col_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + delta_pos)
        p = tl.where(valid, tl.exp2(s - lse[:, None]), 0.0)
        dp = dot(do, vt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        ds = p * (dp - dlt[:, None])
        dq = dot(ds.to(kt.dtype), tl.trans(kt), dq)
    out = b * SQ * HQ * D + h * D + offs_m[:, None] * (HQ * D) + offs_d[None, :]
    tl.store(dq_ptr + out, (dq * scale).to(dq_ptr.dtype.element_ty), mask=row_ok[:, None])


def _bwd_blocks(d: int, itemsize: int):
    """((BLOCK_M, BLOCK_N) of the dK/dV kernel, (BLOCK_M, BLOCK_N) of the dQ kernel, num_warps,
    num_stages), chosen so that ptxas (sm_90) reports no register spills; fp32 (ieee dots)
    needs much smaller tiles."""
    if INTERPRET:
        return (32, 32), (32, 32), 4, 1
    if itemsize == 4:
        return ((32, 32), (32, 32), 8, 1) if d <= 64 else ((16, 16), (16, 16), 4, 1)
    if d <= 64:
        return (64, 64), (64, 64), 4, 3
    if d <= 128:
        return (32, 64), (64, 64), 8, 2
    return (32, 32), (32, 32), 8, 1


def _qstrides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def attention_backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None):
    """Gradients of o = attention(q, k, v): (dq, dk, dv), contiguous, input dtype. lse: the forward's
    [B, Hq, Sq] fp32 (natural log), or None to recompute it; dlse: a gradient reaching lse, or None."""
    bsz, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    group = hq // hk
    dq = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((bsz, sk, hk, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((bsz, sk, hk, d), dtype=v.dtype, device=v.device)
    if bsz * hq == 0 or sk == 0:
        return dq, dk, dv
    if sq == 0:
        return dq, dk.zero_(), dv.zero_()
    if lse is None:
        _, lse = attention_with_lse(q, k, v, scale, causal, write_o=False)
    delta = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    pre_block = max(16, 4096 // d)
    _bwd_preprocess_kernel[(triton.cdiv(sq, pre_block), bsz * hq)](
        o, do, dlse if dlse is not None else delta, delta, *_qstrides(o), *_qstrides(do),
        sq, hq, HAS_DLSE=dlse is not None, D=d, BLOCK_M=pre_block, num_warps=4,
    )
    (bm1, bn1), (bm2, bn2), warps, stages = _bwd_blocks(d, q.element_size())
    _bwd_dkdv_kernel[(triton.cdiv(sk, bn1), bsz * hk)](
        q, k, v, do, lse, delta, dk, dv, *_qstrides(q), *_qstrides(k), *_qstrides(v), *_qstrides(do),
        sq, sk, hq, hk, group, scale * LOG2E, scale,
        CAUSAL=causal, D=d, BLOCK_M=bm1, BLOCK_N=bn1, num_warps=warps, num_stages=stages,
    )
    _bwd_dq_kernel[(triton.cdiv(sq, bm2), bsz * hq)](
        q, k, v, do, lse, delta, dq, *_qstrides(q), *_qstrides(k), *_qstrides(v), *_qstrides(do),
        sq, sk, hq, group, scale * LOG2E, scale,
        CAUSAL=causal, D=d, BLOCK_M=bm2, BLOCK_N=bn2, num_warps=warps, num_stages=stages,
    )
    return dq, dk, dv
