"""Flash attention for prefill, with GQA and an optional KV prefix.

q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (any strides, last dim contiguous) -> o [B, Sq, Hq, D]:

    o[b, i, h] = softmax(scale * q[b, i, h] . k[b, :, h // (Hq/Hk)]) @ v[b, :, h // (Hq/Hk)]

With `causal`, query i sits at position Sk - Sq + i and sees keys 0..Sk-Sq+i, so
Sk > Sq attends over a cached prefix (chunked prefill / prompt continuation).
Online softmax in fp32 (base 2): the score matrix never leaves registers. GQA
reads each kv head in place (no repeat in memory). Grid: (cdiv(Sq, BLOCK_M), B*Hq).
"""
import math

import torch
import triton
import triton.language as tl

from .triton_helpers import dot

LOG2E = 1.0 / math.log(2.0)
LN2: tl.constexpr = tl.constexpr(math.log(2.0))


@triton.jit
def _attend_block(q, k_base, v_base, n0, offs_m, offs_n, offs_d, stride_ks, stride_vs, SK, delta, qk_scale,
                  m_i, l_i, acc, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WRITE_O: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key block of the online softmax; MASKED blocks check the sequence end and the diagonal.
    Without WRITE_O only the row statistics (m, l) are updated: v is never read."""
    cols = n0 + offs_n
    if MASKED:
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None], mask=cols[None, :] < SK, other=0.0)
    else:
        kt = tl.load(k_base + cols[None, :] * stride_ks + offs_d[:, None])
    s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)) * qk_scale
    if MASKED:
        valid = cols[None, :] < SK
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + delta)
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if WRITE_O:
        if MASKED:
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :], mask=cols[:, None] < SK, other=0.0)
        else:
            v = tl.load(v_base + cols[:, None] * stride_vs + offs_d[None, :])
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh,
    SQ, SK, HQ, GROUP, qk_scale,
    CAUSAL: tl.constexpr, WRITE_O: tl.constexpr, WRITE_LSE: tl.constexpr,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Causal: the last query blocks have the most keys, so they start first.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0) if CAUSAL else tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :],
                mask=offs_m[:, None] < SQ, other=0.0)
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
    acc = tl.zeros((BLOCK_M, D), dtype=tl.float32)
    for n0 in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, n0, offs_m, offs_n, offs_d, stride_ks, stride_vs, SK, delta,
                                      qk_scale, m_i, l_i, acc, False, CAUSAL, WRITE_O, BLOCK_M, BLOCK_N)
    # Every row sees key 0, so after the first block m_i is finite and no row divides by zero.
    for n0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, k_base, v_base, n0, offs_m, offs_n, offs_d, stride_ks, stride_vs, SK, delta,
                                      qk_scale, m_i, l_i, acc, True, CAUSAL, WRITE_O, BLOCK_M, BLOCK_N)
    if WRITE_LSE:  # natural-log log-sum-exp of the scaled scores, for the backward
        tl.store(lse_ptr + pid_bh.to(tl.int64) * SQ + offs_m, (m_i + tl.log2(l_i)) * LN2, mask=offs_m < SQ)
    if WRITE_O:
        o = acc / l_i[:, None]
        tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=offs_m[:, None] < SQ)


def _blocks(d: int, sq: int, itemsize: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per head_dim; BLOCK_M shrunk for short queries
    and halved for fp32 (twice the bytes per tile) to fit shared memory."""
    bm, bn, warps, stages = {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 8, 2)}.get(d, (64, 32, 4, 2))
    if itemsize == 4:
        bm, stages = bm // 2, 2
    return min(bm, max(16, triton.next_power_of_2(sq))), bn, warps, stages


def attention_with_lse(q, k, v, scale: float, causal: bool, write_o: bool = True):
    """-> (o [B, Sq, Hq, D] or None without write_o, lse [B, Hq, Sq] fp32 natural log).
    write_o=False recomputes only the softmax statistics (the backward of plain attention)."""
    bsz, sq, hq, d = q.shape
    o = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device) if write_o else None
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if bsz * sq * hq > 0:
        _launch(q, k, v, o, lse, scale, causal)
    return o, lse


def attention(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    bsz, sq, hq, d = q.shape
    o = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device)
    if bsz * sq * hq > 0:
        _launch(q, k, v, o, None, scale, causal)
    return o


def _launch(q, k, v, o, lse, scale, causal):
    bsz, sq, hq, d = q.shape
    hk = k.shape[2]
    ot = o if o is not None else q  # a placeholder pointer when o is not written
    bm, bn, warps, stages = _blocks(d, sq, q.element_size())
    _attention_kernel[(triton.cdiv(sq, bm), bsz * hq)](
        q, k, v, ot, lse if lse is not None else q,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), ot.stride(0), ot.stride(1), ot.stride(2),
        sq, k.shape[1], hq, hq // hk, scale * LOG2E,
        CAUSAL=causal, WRITE_O=o is not None, WRITE_LSE=lse is not None,
        D=d, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages,
    )
