"""Flash attention for prefill, the forward kernel: the online softmax over key blocks, GQA,
an optional KV prefix, the log-sum-exp for the backward. Launched by attention.py
(`attention`, `attention_with_lse`), which picks its tiles.

q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (any strides, last dim contiguous) -> o [B, Sq, Hq, D] and,
with WRITE_LSE, lse [B, Hq, Sq] fp32:

    o[b, i, h] = softmax(scale * q[b, i, h] . k[b, :, h // (Hq/Hk)]) @ v[b, :, h // (Hq/Hk)]
    lse[b, h, i] = ln sum_j exp(scale * q[b, i, h] . k[b, j, h // (Hq/Hk)])  (over the keys j that query i sees)

With CAUSAL, query i sits at position Sk - Sq + i and sees keys 0..Sk-Sq+i. A head is held in a
`head_block(D)` block, masked past D (`head_mask`, which compiles to nothing at powers of two).
Online softmax in fp32 (base 2): the score matrix never leaves registers. GQA
reads each kv head in place (no repeat in memory). Grid: (B*Hq, cdiv(Sq, BLOCK_M)), heads
fastest; in causal attention the last query blocks (the most keys) start first.
The running maximum is kept on the raw scores q.k and the scale applied after the subtraction,
p = exp2((q.k - max) * scale * log2e) (scale > 0), so the row maximum gives exactly exp2(0):
scaling first lets the compiler fuse the scaling into the subtraction (one FMA, whose unrounded
product differs from the rounded maximum by up to 1e30 at scores near 1e37, and exp2 of that is
inf or 0). Every p is scaled by P_SCALE = 2^-HEADROOM (`common.softmax_headroom`), which the
division by the row sum cancels and the lse adds back.

Masking: only key blocks that cross the causal diagonal or hold the sequence end run the masked
body (masked loads, `tl.where` on the scores); all others run a body without bounds checks or
per-element compares. Without WRITE_O only the row statistics are computed (v is never read).
"""
import triton
import triton.language as tl

from .common import LOG2E, dot, fp32, head_block, head_mask, kernel, pdl_launch_dependents, pdl_wait
LN2: tl.constexpr = tl.constexpr(1.0 / LOG2E)


@triton.jit
def _attend_block(q, k_base, v_base, n0, offs_m, offs_n, offs_d, d_ok, stride_ks, stride_vs, SK, delta, qk_scale,
                  m_i, l_i, acc, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WRITE_O: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADROOM: tl.constexpr, P_SCALE: tl.constexpr):
    """One key block of the online softmax; MASKED blocks check the sequence end and the diagonal.
    Without WRITE_O only the row statistics (m, l) are updated: v is never read. d_ok: the head
    dim's mask (`head_mask`), all true for power-of-two head dims."""
    cols = n0 + offs_n
    if MASKED:
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=(cols[None, :] < SK) & d_ok[:, None],
                     other=0.0)
    else:
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=d_ok[:, None], other=0.0)
    s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))  # raw q.k: m_i, m_new are raw maxima
    if MASKED:
        valid = cols[None, :] < SK
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + delta)
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2((m_i - m_new) * qk_scale)
    p = tl.exp2((s - m_new[:, None]) * qk_scale) * P_SCALE  # P_SCALE = 2^-HEADROOM: p <= 2^-HEADROOM, exactly (common.SOFTMAX_HEADROOM)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if WRITE_O:
        if MASKED:
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=(cols[:, None] < SK) & d_ok[None, :],
                        other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=d_ok[None, :], other=0.0)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@kernel
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    SQ, SK, HQ, GROUP, qk_scale,
    CAUSAL: tl.constexpr, WRITE_O: tl.constexpr, WRITE_LSE: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADROOM: tl.constexpr, P_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    qk_scale = fp32(qk_scale)
    # Heads vary fastest; in causal attention the last query blocks (the most keys) start first.
    pid_m = tl.num_programs(1) - 1 - tl.program_id(1) if CAUSAL else tl.program_id(1)
    pid_bh = tl.program_id(0)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, head_block(D))
    d_ok = head_mask(offs_d, D)
    pdl_wait(USE_PDL)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=(offs_m[:, None] < SQ) & d_ok[None, :], other=0.0)
    k_base = k_ptr + b * stride_kb + hk * stride_kh
    v_base = v_ptr + b * stride_vb + hk * stride_vh
    delta = SK - SQ
    # Blocks before `full_end` need no mask: every row of this query block sees all their keys.
    if CAUSAL:
        full_end = min((pid_m * BLOCK_M + delta + 1) // BLOCK_N * BLOCK_N, SK // BLOCK_N * BLOCK_N)
        hi = min(SK, (pid_m + 1) * BLOCK_M + delta)
    else:
        full_end = SK // BLOCK_N * BLOCK_N
        hi = SK
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, head_block(D)), dtype=tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, n0, offs_m, offs_n, offs_d, d_ok, stride_ks, stride_vs, SK,
                                      delta, qk_scale, m_i, l_i, acc, False, CAUSAL, WRITE_O, BLOCK_M, BLOCK_N, HEADROOM,
                                      P_SCALE)
    # Every row sees key 0, so after the first block m_i is finite and no row divides by zero.
    for n0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, n0, offs_m, offs_n, offs_d, d_ok, stride_ks, stride_vs, SK,
                                      delta, qk_scale, m_i, l_i, acc, True, CAUSAL, WRITE_O, BLOCK_M, BLOCK_N, HEADROOM,
                                      P_SCALE)
    pdl_launch_dependents(USE_PDL)
    if WRITE_LSE:  # natural-log log-sum-exp of the scaled scores, for the backward
        tl.store(lse_ptr + pid_bh.to(tl.int64) * SQ + offs_m, (m_i * qk_scale + HEADROOM + tl.log2(l_i)) * LN2,
                 mask=offs_m < SQ)
    if WRITE_O:
        o = acc / l_i[:, None]
        tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=(offs_m[:, None] < SQ) & d_ok[None, :])
