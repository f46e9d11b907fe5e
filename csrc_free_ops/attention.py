"""Flash attention for prefill, with GQA and an optional KV prefix.

q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (any strides, last dim contiguous) -> o [B, Sq, Hq, D]:

    o[b, i, h] = softmax(scale * q[b, i, h] . k[b, :, h // (Hq/Hk)]) @ v[b, :, h // (Hq/Hk)]

With `causal`, query i sits at position Sk - Sq + i and sees keys 0..Sk-Sq+i, so
Sk > Sq attends over a cached prefix (chunked prefill / prompt continuation).
D is any multiple of 16 up to 256: every kernel here holds a head in a `head_block(D)` block,
masked past D (`head_mask`, which compiles to nothing at powers of two).
Online softmax in fp32 (base 2): the score matrix never leaves registers. GQA
reads each kv head in place (no repeat in memory). Grid: (B*Hq, cdiv(Sq, BLOCK_M)).
The running maximum is kept on the raw scores q.k and the scale applied after the subtraction,
p = exp2((q.k - max) * scale * log2e) (scale > 0), so the row maximum gives exactly exp2(0):
scaling first lets the compiler fuse the scaling into the subtraction (one FMA, whose unrounded
product differs from the rounded maximum by up to 1e30 at scores near 1e37, and exp2 of that is
inf or 0).

The forward can also return lse [B, Hq, Sq] fp32, the natural-log log-sum-exp of the scaled
scores (`attention_with_lse`), which the backward needs.

Backward (FlashAttention-2 style), same layouts (dO like q). Nothing of size Sq x Sk is stored: every kernel recomputes its tile of P = exp(s - lse).

1. lse, when the forward did not keep it: the forward kernel run for the row
   statistics only (`attention_with_lse(..., write_o=False)`).
2. preprocess: delta_i = sum_d dO_id * O_id (minus dlse_i when lse itself gets a gradient),
   grid (cdiv(Sq, BLOCK), B*Hq).
3. dK/dV (`dkdv_backward`), grid (B*Hk, cdiv(Sk, BLOCK_N)): a program owns one key block of
   one kv head, holds k, v and the fp32 accumulators dk, dv and walks every (query head of its
   GQA group, query block that sees the key block) pair:
       P^T = exp2(k q^T * scale*log2e - lse*log2e),  dV += P^T dO,
       dP^T = v dO^T,  dS^T = P^T * (dP^T - delta),  dK += dS^T q
   GQA's sum over the heads of a group is this walk: a fixed order, no atomics.
4. dQ (`dq_backward`), grid (B*Hq, cdiv(Sq, BLOCK_M)): a program owns one query block and walks
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

Launch order, forward and backward: heads vary fastest (grid axis 0) and, in causal attention,
the blocks with the most work start first (the last query blocks for the forward and dQ, the
first key blocks for dK/dV), so the short programs fill the tail of the launch.

Tiles: the forward's `Tiles(block_m, block_n, num_warps, num_stages)` from `forward_tiles`
(head_dim, query length, dtype) or `attention(..., tiles=)`; the backward's `BwdBlocks`, one
`Tiles` per kernel, chosen by `backward_blocks` from head_dim and dtype or passed as
`attention_backward(..., blocks=)`. `python -m bench.ops --sweep-attn-fwd` / `--sweep-attn-bwd`
time candidates against SDPA.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (INTERPRET, LOG2E, cdiv, dot, fp32, head_block, head_mask, kernel, next_power_of_2,
                     pdl_launch_dependents, pdl_options, pdl_wait, shared_memory_per_block, softmax_headroom)
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


FWD_TILES = {64: (64, 128, 4, 3), 128: (64, 64, 4, 3), 256: (64, 64, 4, 3)}
"""The head dim's block (`head_block`: 128 for head dims 80 to 128) -> the forward's (BLOCK_M,
BLOCK_N, num_warps, num_stages) for 16-bit operands; other blocks get (64, 32, 4, 2). From
`python -m bench.ops --sweep-attn-fwd` (H200, causal, 256 and 2048 tokens:
bench/results/2026-11-30-h200-attn-fwd-sweep.md)."""


def forward_tiles(d: int, sq: int, itemsize: int, shared_memory: "int | None" = None) -> "Tiles":
    """The forward's tiles: FWD_TILES, BLOCK_M shrunk for short queries and halved for fp32 (twice
    the bytes per tile); with `shared_memory` (bytes per block), fewer stages and then narrower key
    blocks until the q tile and `num_stages` k and v tiles fit (head_dim 256 needs 224 KB as
    stored, which Hopper has and most other GPUs do not). A head dim that is not a power of two
    takes the tiles of its block, which is what the kernel holds."""
    d = next_power_of_2(d)
    bm, bn, warps, stages = FWD_TILES.get(d, (64, 32, 4, 2))
    if itemsize == 4:
        bm, stages = bm // 2, 2
    bm = min(bm, max(16, next_power_of_2(sq)))
    if shared_memory is not None:
        def footprint():
            return (bm + 2 * stages * bn) * d * itemsize
        while stages > 2 and footprint() > shared_memory:
            stages -= 1
        while bn > 16 and footprint() > shared_memory:
            bn //= 2
    return Tiles(bm, bn, warps, stages)


def attention_with_lse(q, k, v, scale: float, causal: bool, write_o: bool = True, tiles: "Tiles | None" = None):
    """-> (o [B, Sq, Hq, D] or None without write_o, lse [B, Hq, Sq] fp32 natural log).
    write_o=False recomputes only the softmax statistics (the backward of plain attention).
    `tiles` overrides `forward_tiles` (benchmarks, tests)."""
    bsz, sq, hq, d = q.shape
    o = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device) if write_o else None
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if bsz * sq * hq > 0:
        _launch(q, k, v, o, lse, scale, causal, tiles)
    return o, lse


def attention(q, k, v, scale: float, causal: bool, tiles: "Tiles | None" = None) -> torch.Tensor:
    bsz, sq, hq, d = q.shape
    o = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device)
    if bsz * sq * hq > 0:
        _launch(q, k, v, o, None, scale, causal, tiles)
    return o


def _launch(q, k, v, o, lse, scale, causal, tiles):
    bsz, sq, hq, d = q.shape
    hk = k.shape[2]
    ot = o if o is not None else q  # a placeholder pointer when o is not written
    if tiles is not None:
        _check_tiles(tiles)
    bm, bn, warps, stages = tiles or forward_tiles(
        d, sq, q.element_size(), shared_memory_per_block(q.device) if q.is_cuda else None)
    headroom = softmax_headroom(v.dtype)
    _attention_kernel[(bsz * hq, cdiv(sq, bm))](
        q, k, v, ot, lse if lse is not None else q,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), ot.stride(0), ot.stride(1), ot.stride(2),
        sq, k.shape[1], hq, hq // hk, scale * LOG2E,
        CAUSAL=causal, WRITE_O=o is not None, WRITE_LSE=lse is not None,
        D=d, BLOCK_M=bm, BLOCK_N=bn, HEADROOM=headroom, P_SCALE=2.0 ** -headroom, num_warps=warps, num_stages=stages,
        **pdl_options(q),
    )


_LOG2E: tl.constexpr = tl.constexpr(LOG2E)


class Tiles(NamedTuple):
    """One kernel's launch: steps of BLOCK_M queries x BLOCK_N keys (the forward and dQ own a
    query block and walk key blocks, dK/dV the reverse). The blocks need not divide each other."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class BwdBlocks(NamedTuple):
    dkdv: Tiles
    dq: Tiles


def _check_tiles(t: Tiles):
    """tl.arange needs powers of two, tl.dot at least 16 rows/columns."""
    for name, x in (("block_m", t.block_m), ("block_n", t.block_n), ("num_warps", t.num_warps)):
        assert x > 0 and x & (x - 1) == 0, f"{name}={x} must be a power of two"
    assert t.block_m >= 16 and t.block_n >= 16, f"blocks {t.block_m}x{t.block_n}: tl.dot needs at least 16"
    assert t.num_stages >= 1, f"num_stages={t.num_stages}"


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


def backward_blocks(d: int, itemsize: int) -> BwdBlocks:
    """Default tiles per head_dim. bf16/fp16 at head_dim 64 and 128: the fastest of
    `python -m bench.ops --sweep-attn-bwd` on the H200 (2026-11-29, triton 3.6; B=4, S=2048,
    causal): 0.54 ms for Qwen3's 16/8 heads x 128 against 1.43 ms with the earlier (32, 64, 8, 2) /
    (64, 64, 8, 2) tiles and 0.48 ms for cuDNN. fp32 (ieee dots) needs much smaller tiles. The
    thresholds are powers of two, so a head dim takes its block's tiles (80 and 96 those of 128)."""
    if INTERPRET:
        t = Tiles(32, 32, 4, 1)
        return BwdBlocks(t, t)
    if itemsize == 4:
        t = Tiles(32, 32, 8, 1) if d <= 64 else Tiles(16, 16, 4, 1)
        return BwdBlocks(t, t)
    if d <= 64:
        return BwdBlocks(Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3))
    if d <= 128:
        return BwdBlocks(Tiles(32, 64, 4, 3), Tiles(128, 64, 8, 3))
    t = Tiles(32, 32, 8, 1)
    return BwdBlocks(t, t)


def _qstrides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def bwd_delta(o, do, dlse=None):
    """delta [B, Hq, Sq] fp32 = rowsum(dO * O) - dlse."""
    bsz, sq, hq, d = o.shape
    delta = torch.empty((bsz, hq, sq), dtype=torch.float32, device=o.device)
    block = max(16, 4096 // next_power_of_2(d))
    _bwd_preprocess_kernel[(cdiv(sq, block), bsz * hq)](
        o, do, dlse if dlse is not None else o, delta, *_qstrides(o), *_qstrides(do),
        sq, hq, HAS_DLSE=dlse is not None, D=d, BLOCK_M=block, num_warps=4,
    )
    return delta


def dkdv_backward(do, q, k, v, lse, delta, dk, dv, scale: float, causal: bool, tiles: Tiles):
    """Writes dk, dv (contiguous [B, Sk, Hk, D]); returns the launched kernel (its n_regs, n_spills
    and metadata.shared are what the tile sweep reports)."""
    _check_tiles(tiles)
    bsz, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    return _bwd_dkdv_kernel[(bsz * hk, cdiv(sk, tiles.block_n))](
        q, k, v, do, lse, delta, dk, dv, *_qstrides(q), *_qstrides(k), *_qstrides(v), *_qstrides(do),
        sq, sk, hq, hk, hq // hk, scale * LOG2E, scale,
        CAUSAL=causal, D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def dq_backward(do, q, k, v, lse, delta, dq, scale: float, causal: bool, tiles: Tiles):
    """Writes dq (contiguous [B, Sq, Hq, D]); returns the launched kernel, as dkdv_backward."""
    _check_tiles(tiles)
    bsz, sq, hq, d = q.shape
    return _bwd_dq_kernel[(bsz * hq, cdiv(sq, tiles.block_m))](
        q, k, v, do, lse, delta, dq, *_qstrides(q), *_qstrides(k), *_qstrides(v), *_qstrides(do),
        sq, k.shape[1], hq, hq // k.shape[2], scale * LOG2E, scale,
        CAUSAL=causal, D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def attention_backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, blocks: BwdBlocks | None = None):
    """Gradients of o = attention(q, k, v): (dq, dk, dv), contiguous, input dtype. lse: the forward's
    [B, Hq, Sq] fp32 (natural log), or None to recompute it; dlse: a gradient reaching lse, or None;
    blocks: the kernels' tiles instead of `backward_blocks`'s."""
    bsz, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dq = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((bsz, sk, hk, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((bsz, sk, hk, d), dtype=v.dtype, device=v.device)
    if bsz == 0 or sk == 0:
        return dq, dk, dv
    if sq * hq == 0:  # no query sees the keys: their gradients are zero
        return dq, dk.zero_(), dv.zero_()
    if lse is None:
        _, lse = attention_with_lse(q, k, v, scale, causal, write_o=False)
    delta = bwd_delta(o, do, dlse)
    blocks = blocks or backward_blocks(d, q.element_size())
    dkdv_backward(do, q, k, v, lse, delta, dk, dv, scale, causal, blocks.dkdv)
    dq_backward(do, q, k, v, lse, delta, dq, scale, causal, blocks.dq)
    return dq, dk, dv
