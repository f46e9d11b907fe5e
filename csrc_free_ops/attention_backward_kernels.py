"""Flash attention for prefill, the backward kernels (FlashAttention-2 style): delta, dK/dV and
dQ of o = attention(q, k, v) (attention_forward_kernel.py), with GQA and an optional KV prefix.
Launched by attention.py (`bwd_delta`, `dkdv_backward`, `dq_backward`, `attention_backward`).

q, o, do [B, Sq, Hq, D], k, v [B, Sk, Hk, D] (any strides, last dim contiguous), lse, delta
[B, Hq, Sq] fp32 (lse: natural log) -> dq [B, Sq, Hq, D], dk, dv [B, Sk, Hk, D] (contiguous). The
forward's causal convention and head-dim blocks. Nothing of size Sq x Sk is stored: every kernel
recomputes its tile of P = exp(s - lse).

- preprocess (`_bwd_preprocess_kernel`): delta_i = sum_d dO_id * O_id (minus dlse_i when lse
  itself gets a gradient), grid (cdiv(Sq, BLOCK), B*Hq).
- dK/dV (`_bwd_dkdv_kernel`), grid (B*Hk, cdiv(Sk, BLOCK_N)): a program owns one key block of
  one kv head, holds k, v and the fp32 accumulators dk, dv and walks every (query head of its
  GQA group, query block that sees the key block) pair:
      P^T = exp2(k q^T * scale*log2e - lse*log2e),  dV += P^T dO,
      dP^T = v dO^T,  dS^T = P^T * (dP^T - delta),  dK += dS^T q
  GQA's sum over the heads of a group is this walk: a fixed order, no atomics.
- dQ (`_bwd_dq_kernel`), grid (B*Hq, cdiv(Sq, BLOCK_M)): a program owns one query block and walks
  the key blocks it sees:  dS = P * (dO v^T - delta),  dQ += dS k.
dK and dQ get the softmax scale at the end. Two kernels instead of one with atomic dQ:
deterministic, at the price of recomputing q k^T twice.

Masking, as in the forward: only steps whose block crosses the causal diagonal or holds a
sequence end run the masked body (masked loads, `tl.where` on P); all others run a body
without bounds checks or per-element compares. Causal dK/dV: the first query blocks a key
block sees cross the diagonal; causal dQ: the last key blocks a query block sees. When the
block a program owns holds a sequence end, all of its steps are masked. dK/dV walks in two
flat loops over (head, query block), the masked steps of every head and then the unmasked
ones (a loop over heads around the block loops makes ptxas spill).

Launch order: heads vary fastest (grid axis 0) and, in causal attention, the blocks with the most
work start first (the last query blocks for dQ, the first key blocks for dK/dV), so the short
programs fill the tail of the launch.
"""
import triton
import triton.language as tl

from .common import LOG2E, dot, fp32, head_block, head_mask, kernel

_LOG2E: tl.constexpr = tl.constexpr(LOG2E)


@kernel
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
    offs_d = tl.arange(0, head_block(D))
    m = (offs_m[:, None] < SQ) & head_mask(offs_d, D)[None, :]
    o = tl.load(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :], mask=m, other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :], mask=m, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    row = pid_bh.to(tl.int64) * SQ + offs_m
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + row, mask=offs_m < SQ, other=0.0)
    tl.store(delta_ptr + row, delta, mask=offs_m < SQ)


@triton.jit
def _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, b, h, m0, offs_mb, offs_n, offs_d, d_ok,
               stride_qb, stride_qs, stride_qh, stride_db, stride_ds, stride_dh, SQ, SK, HQ, delta_pos, qk_scale,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dK, dV += what query rows m0 .. m0+BLOCK_M of head h give this key block. MASKED steps
    check both sequence ends and the diagonal; the others are in range and fully visible. d_ok:
    the head dim's mask (`head_mask`)."""
    offs_m = m0 + offs_mb
    q_base = q_ptr + b * stride_qb + h * stride_qh
    do_base = do_ptr + b * stride_db + h * stride_dh
    lse_base = lse_ptr + (b * HQ + h) * SQ
    delta_base = delta_ptr + (b * HQ + h) * SQ
    if MASKED:
        row_ok = offs_m < SQ
        qt = tl.load(q_base + offs_m[None, :] * stride_qs + offs_d[:, None], mask=row_ok[None, :] & d_ok[:, None],
                     other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_ds + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                     other=0.0)
        lse = tl.load(lse_base + offs_m, mask=row_ok, other=0.0)
        dlt = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
    else:
        qt = tl.load(q_base + offs_m[None, :] * stride_qs + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_ds + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        lse = tl.load(lse_base + offs_m)
        dlt = tl.load(delta_base + offs_m)
    st = dot(k, qt, tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)) * qk_scale
    pt = tl.exp2(st - lse[None, :] * _LOG2E)
    if MASKED:
        valid = row_ok[None, :] & (offs_n[:, None] < SK)
        if CAUSAL:
            valid = valid & (offs_n[:, None] <= offs_m[None, :] + delta_pos)
        pt = tl.where(valid, pt, 0.0)
    dv = dot(pt.to(do.dtype), do, dv)
    dpt = dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32))
    dst = pt * (dpt - dlt[None, :])
    dk = dot(dst.to(qt.dtype), tl.trans(qt), dk)
    return dk, dv


@kernel
def _bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    SQ, SK, HQ, HK, GROUP, qk_scale, scale,
    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    qk_scale, scale = fp32(qk_scale), fp32(scale)
    pid_bh = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N  # causal: the first key blocks, seen by the most queries, start first
    b = (pid_bh // HK).to(tl.int64)
    hk = pid_bh % HK
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, head_block(D))
    d_ok = head_mask(offs_d, D)
    offs_mb = tl.arange(0, BLOCK_M)
    col_ok = offs_n < SK
    kv_ok = col_ok[:, None] & d_ok[None, :]
    k = tl.load(k_ptr + b * stride_kb + hk * stride_kh + offs_n[:, None] * stride_ks + offs_d[None, :],
                mask=kv_ok, other=0.0)
    v = tl.load(v_ptr + b * stride_vb + hk * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :],
                mask=kv_ok, other=0.0)
    dk = tl.zeros((BLOCK_N, head_block(D)), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, head_block(D)), dtype=tl.float32)
    delta_pos = SK - SQ
    # Query blocks [lo, mid) cross the diagonal, [mid, hi) see every key of this block, [hi, SQ)
    # hold the query sequence's end; all are masked when this key block holds the key sequence's end.
    if CAUSAL:
        # Query i sees key n when n <= i + (Sk - Sq).
        lo = tl.maximum(n0 - delta_pos, 0) // BLOCK_M * BLOCK_M
        mid = tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - delta_pos, 0), BLOCK_M) * BLOCK_M
    else:
        lo = 0
        mid = 0
    hi = tl.where(n0 + BLOCK_N <= SK, SQ // BLOCK_M * BLOCK_M, lo)
    mid = min(mid, hi)
    # Flat loops over (query head of the group, query block), in a fixed order; see the docstring.
    n_diag = (mid - lo) // BLOCK_M
    n_masked = n_diag + tl.cdiv(SQ - hi, BLOCK_M)
    for i in range(0, GROUP * n_masked):
        g = i // n_masked
        j = i - g * n_masked
        m0 = lo + j * BLOCK_M + tl.where(j < n_diag, 0, hi - mid)
        dk, dv = _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, b, hk * GROUP + g, m0, offs_mb, offs_n,
                            offs_d, d_ok, stride_qb, stride_qs, stride_qh, stride_db, stride_ds, stride_dh,
                            SQ, SK, HQ, delta_pos, qk_scale, True, CAUSAL, BLOCK_M, BLOCK_N)
    n_full = (hi - mid) // BLOCK_M
    for i in range(0, GROUP * n_full):
        g = i // n_full
        m0 = mid + (i - g * n_full) * BLOCK_M
        dk, dv = _dkdv_step(dk, dv, k, v, q_ptr, do_ptr, lse_ptr, delta_ptr, b, hk * GROUP + g, m0, offs_mb, offs_n,
                            offs_d, d_ok, stride_qb, stride_qs, stride_qh, stride_db, stride_ds, stride_dh,
                            SQ, SK, HQ, delta_pos, qk_scale, False, CAUSAL, BLOCK_M, BLOCK_N)
    out = b * SK * HK * D + hk * D + offs_n[:, None] * (HK * D) + offs_d[None, :]
    tl.store(dk_ptr + out, (dk * scale).to(dk_ptr.dtype.element_ty), mask=kv_ok)
    tl.store(dv_ptr + out, dv.to(dv_ptr.dtype.element_ty), mask=kv_ok)


@triton.jit
def _dq_step(dq, q, do, lse, dlt, k_base, v_base, n0, offs_m, offs_nb, offs_d, d_ok, stride_ks, stride_vs,
             SQ, SK, delta_pos, qk_scale,
             MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ += what keys n0 .. n0+BLOCK_N give this query block (lse in base 2). MASKED steps check
    both sequence ends and the diagonal; the others are in range and fully visible. d_ok: the
    head dim's mask (`head_mask`)."""
    offs_n = n0 + offs_nb
    if MASKED:
        col_ok = offs_n < SK
        kv_ok = col_ok[None, :] & d_ok[:, None]
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=kv_ok, other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vs + offs_d[:, None], mask=kv_ok, other=0.0)
    else:
        kt = tl.load(k_base + offs_n[None, :] * stride_ks + offs_d[:, None], mask=d_ok[:, None], other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vs + offs_d[:, None], mask=d_ok[:, None], other=0.0)
    s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)) * qk_scale
    p = tl.exp2(s - lse[:, None])
    if MASKED:
        valid = (offs_m[:, None] < SQ) & col_ok[None, :]
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + delta_pos)
        p = tl.where(valid, p, 0.0)
    dp = dot(do, vt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
    ds = p * (dp - dlt[:, None])
    return dot(ds.to(kt.dtype), tl.trans(kt), dq)


@kernel
def _bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_db, stride_ds, stride_dh,
    SQ, SK, HQ, GROUP, qk_scale, scale,
    CAUSAL: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    qk_scale, scale = fp32(qk_scale), fp32(scale)
    pid_bh = tl.program_id(0)
    # Causal: the last query blocks see the most keys, so they start first.
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1) if CAUSAL else tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, head_block(D))
    d_ok = head_mask(offs_d, D)
    row_ok = offs_m < SQ
    qd_ok = row_ok[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=qd_ok, other=0.0)
    do = tl.load(do_ptr + b * stride_db + h * stride_dh + offs_m[:, None] * stride_ds + offs_d[None, :],
                 mask=qd_ok, other=0.0)
    stat = pid_bh.to(tl.int64) * SQ + offs_m
    lse = tl.load(lse_ptr + stat, mask=row_ok, other=0.0) * _LOG2E
    dlt = tl.load(delta_ptr + stat, mask=row_ok, other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    delta_pos = SK - SQ
    # Key blocks [0, mid) are seen by every row of this block, [mid, hi) cross the diagonal or
    # hold the key sequence's end; all are masked when this block holds the query sequence's end.
    if CAUSAL:
        hi = min(SK, m0 + BLOCK_M + delta_pos)
        mid = min((m0 + delta_pos + 1) // BLOCK_N * BLOCK_N, SK // BLOCK_N * BLOCK_N)
    else:
        hi = SK
        mid = SK // BLOCK_N * BLOCK_N
    mid = tl.where(m0 + BLOCK_M <= SQ, mid, 0)
    dq = tl.zeros((BLOCK_M, head_block(D)), dtype=tl.float32)
    for n0 in range(0, mid, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, dlt, k_base, v_base, n0, offs_m, offs_nb, offs_d, d_ok, stride_ks, stride_vs,
                      SQ, SK, delta_pos, qk_scale, False, CAUSAL, BLOCK_M, BLOCK_N)
    for n0 in range(mid, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, dlt, k_base, v_base, n0, offs_m, offs_nb, offs_d, d_ok, stride_ks, stride_vs,
                      SQ, SK, delta_pos, qk_scale, True, CAUSAL, BLOCK_M, BLOCK_N)
    out = b * SQ * HQ * D + h * D + offs_m[:, None] * (HQ * D) + offs_d[None, :]
    tl.store(dq_ptr + out, (dq * scale).to(dq_ptr.dtype.element_ty), mask=qd_ok)
