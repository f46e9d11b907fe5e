"""Flash-decoding: a few new queries per sequence against a KV cache.

q [B, Tq, Hq, D], k_cache/v_cache [B, L, Hk, D], cache_seqlens [B] (valid entries,
the Tq new tokens included) -> o [B, Tq, Hq, D]. Query t of sequence b sits at
position cache_seqlens[b] - Tq + t and attends to cache[b, :position + 1]. A head of D (any
multiple of 16 up to 256) is held in a `head_block(D)` block, masked past D.

Pass 1, grid (B*Hk, NUM_SPLITS): program (b, kv head, s) takes the cache slice
[s*SPLIT_LEN, (s+1)*SPLIT_LEN) and every query of that kv head's group (Tq x Hq/Hk
rows, so each cached key is read once for the whole group) and writes the
normalised partial output and its log-sum-exp (base 2, fp32).
Pass 2, grid (B*Tq*Hq,): weights the splits by exp2(lse - max lse) and sums them.

The split count depends only on (B, Hk, L), never on cache_seqlens (which live on
the device), so one CUDA graph serves every length; splits past the sequence end
do no work and contribute weight 0. cache_seqlens is clamped to [0, L] on the
device (checking it would cost a host sync), so no length reads outside the cache;
a query row that sees no key (length < Tq) outputs zeros.

With PDL (`common.pdl_options`) both passes wait for their predecessor before reading anything,
and the combine lets the next kernel (the o_proj GEMV) launch at once.
"""
import torch
import triton.language as tl

from .common import (LOG2E, TARGET_PROGRAMS, cdiv, dot, empty_contiguous_like, fp32, head_block, head_mask, kernel,
                    next_power_of_2, pdl_launch_dependents, pdl_options, pdl_wait, softmax_headroom)


@kernel
def _decode_split_kernel(
    q_ptr, kc_ptr, vc_ptr, seqlens_ptr, po_ptr, plse_ptr,
    stride_qb, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    TQ, HQ, HK, GROUP, CACHE_LEN, SPLIT_LEN, NUM_SPLITS, qk_scale,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEADROOM: tl.constexpr, P_SCALE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    qk_scale = fp32(qk_scale)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    b = (pid_bh // HK).to(tl.int64)
    hk = pid_bh % HK
    pdl_wait(USE_PDL)
    # Clamped to [0, CACHE_LEN] before narrowing: a bad length never reads past the cache.
    seqlen = tl.minimum(tl.maximum(tl.load(seqlens_ptr + b).to(tl.int64), 0), CACHE_LEN).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    t = rows // GROUP
    h = hk * GROUP + rows % GROUP
    row_ok = rows < TQ * GROUP
    offs_d = tl.arange(0, head_block(D))
    d_ok = head_mask(offs_d, D)
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b * stride_qb + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = seqlen - TQ + t
    lo = split * SPLIT_LEN
    hi = min(lo + SPLIT_LEN, seqlen)
    k_base = kc_ptr + b * stride_kb + hk * stride_kh
    v_base = vc_ptr + b * stride_vb + hk * stride_vh
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, head_block(D)), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        cols = n0 + offs_n
        kt = tl.load(k_base + cols[None, :].to(tl.int64) * stride_ks + offs_d[:, None],
                     mask=(cols[None, :] < hi) & d_ok[:, None], other=0.0)
        s = dot(q, kt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)) * qk_scale
        s = tl.where((cols[None, :] < hi) & (cols[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row whose keys are all masked so far keeps m = -inf: shift by 0 instead of NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None]) * P_SCALE  # P_SCALE = 2^-HEADROOM: p <= 2^-HEADROOM, exactly (common.SOFTMAX_HEADROOM)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vs + offs_d[None, :],
                    mask=(cols[:, None] < hi) & d_ok[None, :], other=0.0)
        acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    pdl_launch_dependents(USE_PDL)
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + HEADROOM + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    part_row = ((b * TQ + t) * HQ + h) * NUM_SPLITS + split
    tl.store(po_ptr + part_row[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(plse_ptr + part_row, lse, mask=row_ok)


@kernel
def _decode_combine_kernel(po_ptr, plse_ptr, o_ptr, NUM_SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr,
                           USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b * TQ + t) * HQ + h: o is contiguous [B, TQ, HQ, D]
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)  # the next kernel (o_proj) may start its launch now
    s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, head_block(D))
    d_ok = head_mask(offs_d, D)
    lse = tl.load(plse_ptr + row * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, axis=0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    parts = tl.load(po_ptr + (row * NUM_SPLITS + s)[:, None] * D + offs_d[None, :],
                    mask=(s[:, None] < NUM_SPLITS) & d_ok[None, :], other=0.0)
    w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)  # normalised before the sum: |out| <= max |part|, no overflow
    out = tl.sum(parts * w[:, None], axis=0)
    tl.store(o_ptr + row * D + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def split_plan(bsz: int, hk: int, cache_len: int, block_n: int):
    """(num_splits, split_len): about two waves of programs, each split a whole number of key blocks."""
    splits = min(cdiv(cache_len, block_n), max(1, cdiv(TARGET_PROGRAMS, bsz * hk)))
    split_len = cdiv(cdiv(cache_len, splits), block_n) * block_n
    return cdiv(cache_len, split_len), split_len


def decode_attention(q, k_cache, v_cache, cache_seqlens, scale: float) -> torch.Tensor:
    bsz, tq, hq, d = q.shape
    cache_len, hk = k_cache.shape[1], k_cache.shape[2]
    group = hq // hk
    o = empty_contiguous_like(q)
    if bsz * tq * hq == 0:  # no query rows (hq = 0 would make the group size 0)
        return o
    block_n = 64 if d <= 128 else 32
    num_splits, split_len = split_plan(bsz, hk, cache_len, block_n)
    part_out = torch.empty((bsz, tq, hq, num_splits, d), dtype=torch.float32, device=q.device)
    cache_seqlens = cache_seqlens.contiguous()  # the kernel reads element b at offset b
    part_lse = torch.empty((bsz, tq, hq, num_splits), dtype=torch.float32, device=q.device)
    headroom = softmax_headroom(v_cache.dtype)
    pdl = pdl_options(q)
    _decode_split_kernel[(bsz * hk, num_splits)](
        q, k_cache, v_cache, cache_seqlens, part_out, part_lse,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tq, hq, hk, group, cache_len, split_len, num_splits, scale * LOG2E,
        D=d, BLOCK_M=max(16, next_power_of_2(tq * group)), BLOCK_N=block_n,
        HEADROOM=headroom, P_SCALE=2.0 ** -headroom, num_warps=4, num_stages=2, **pdl,
    )
    _decode_combine_kernel[(bsz * tq * hq,)](
        part_out, part_lse, o, num_splits, D=d, BLOCK_S=next_power_of_2(num_splits),
        num_warps=4, **pdl,
    )
    return o
