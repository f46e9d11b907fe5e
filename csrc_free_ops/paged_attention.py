"""A paged KV cache: its slot write and attention over it, for decode rows and prefill chunks.

The cache layout (fixed):
- per attention layer, k_cache and v_cache: [num_blocks, block_size, Hk, D], contiguous,
  block_size a power of two >= 16 (the engine picks it; kernels take any such);
- a token's KV slot is block_id * block_size + offset_in_block (= its row in the
  [num_blocks * block_size, Hk, D] view);
- a sequence's block table: block_table [num_seqs, max_blocks_per_seq] int32, entry j the block
  holding its positions [j * block_size, (j + 1) * block_size); entries past the sequence's
  length are unused (may be anything, e.g. 0 or -1: never read);
- seq_lens [num_seqs] int32: the number of cached positions of each sequence INCLUDING this
  step's new tokens (their KV is written before attention runs).

`kv_cache_store_slots(k, v, k_cache, v_cache, slot_mapping)`: k, v [N, Hk, D] (last dim
contiguous, other strides free); row slot_mapping[i] of the [num_blocks * block_size, Hk, D]
views gets k[i] and v[i]. A slot < 0 or >= num_blocks * block_size (padding tokens pass -1) is
not written. Grid (N,): one program copies one token's Hk x D keys and values.

`paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, max_query_len)`:
q [N, Hq, D] holds the new tokens of every sequence, sequence i's at rows
cu_seqlens_q[i]:cu_seqlens_q[i + 1]; query t of sequence i (qlen_i = cu[i + 1] - cu[i]) sits at
position seq_lens[i] - qlen_i + t and attends causally to the cached positions 0..position, read
through the block table: slot = block_table[i, p // block_size] * block_size + p % block_size,
gathered per key position, so the key tile (BLOCK_N) does not depend on block_size.

One kernel serves decode and prefill. A program owns a query tile of one sequence and one kv
head: BLOCK_Q consecutive tokens x the GROUP = Hq / Hk query heads that read that kv head, in
BLOCK_M rows (row r: token r // GROUP, head r % GROUP; BLOCK_Q = BLOCK_M // GROUP), so each
gathered key is read once for the whole group. Decode and prefill
differ only in the tile shape and in how a program finds its rows, not in the loop over keys
(paged gather, online softmax in fp32 base 2 with the softmax headroom, as attention.py's
forward), so that loop exists once. `plan` picks the mode from the host int max_query_len:
- one tile per sequence (decode, short chunks: max_query_len * GROUP rows fit one query tile):
  BLOCK_M = that many rows rounded up to a power of two (16 at least), program axis 0 is the
  sequence;
- query tiles (prefill chunks): sequence i's tiles are numbered from cu[i] // BLOCK_Q + i
  (strictly increasing in i, and at least cdiv(qlen_i, BLOCK_Q) apart), so N // BLOCK_Q +
  num_seqs tiles cover any batch of N tokens however it is split; a program finds its sequence
  by binary search over cu_seqlens_q, and tiles past their sequence's end exit at once. The grid
  runs in reverse: the last tiles of a chunk, which see the most keys, start first.
Key blocks that every row of the tile sees in full run without masks or compares; the others
mask the causal diagonal and the sequence end.

Grid (tiles, Hk, NUM_SPLITS). Flash-decoding's KV splits: the count comes from the shapes only
(the tile count, Hk and the table's reach max_blocks_per_seq * block_size), never from device
values, so one CUDA graph serves every length; the keys a tile sees, [0, kv_end), are shared
among them on the device, split s taking [s * L, (s + 1) * L) with L = kv_end / NUM_SPLITS
rounded up to whole key tiles (BLOCK_N), as the persistent decode kernel shares a sequence's
length. A split cut from the reach would leave a short sequence's keys to the first splits.
With one split the kernel writes o; with several, each program writes its rows' normalised
partial output and base-2 log-sum-exp, and the combine pass (`_combine_kernel`, grid (N * Hq,)) weights and sums them.

Device values are clamped, never checked (a check would cost a host sync; qwen_ops checks them
on CPU tensors): cu_seqlens_q to [0, N], seq_lens to [0, max_blocks_per_seq * block_size], block
ids to [0, num_blocks), so no value reads or writes outside the tensors. A query at a negative
position (seq_len < qlen, e.g. padding tokens in a sequence of length 0) sees no key and outputs
zeros; a sequence with qlen 0 has no rows. The kernel never loads a key slot outside
[0, seq_len) of its sequence.

PDL (`common.pdl_options`): both kernels wait for their predecessor before reading anything and
let the next kernel launch once their main loop is done.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (INTERPRET, LOG2E, cdiv, dot, fp32, head_block, head_mask, kernel,
                     next_power_of_2, pdl_launch_dependents, pdl_options, pdl_wait, softmax_headroom, target_programs)


@kernel
def _store_slots_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
    stride_kn, stride_kh, stride_vn, stride_vh, stride_slot, NUM_SLOTS, HK,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    slot = tl.load(slot_ptr + i * stride_slot).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)  # BLOCK_D = D for the head dims attention takes
    heads_to_write = tl.where((slot >= 0) & (slot < NUM_SLOTS), HK, 0)
    mask = (heads[:, None] < heads_to_write) & (d[None, :] < D)
    k = tl.load(k_ptr + i * stride_kn + heads[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + i * stride_vn + heads[:, None] * stride_vh + d[None, :], mask=mask)
    pdl_launch_dependents(USE_PDL)
    row = slot * (HK * D) + heads[:, None] * D + d[None, :]  # the caches are contiguous
    tl.store(kc_ptr + row, k, mask=mask)
    tl.store(vc_ptr + row, v, mask=mask)


def kv_cache_store_slots(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Writes into the caches in place (see the module doc)."""
    n, hk, d = k.shape
    if n * hk * d == 0:
        return
    _store_slots_kernel[(n,)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        slot_mapping.stride(0), k_cache.shape[0] * k_cache.shape[1], hk,
        D=d, BLOCK_H=next_power_of_2(hk), BLOCK_D=next_power_of_2(d), num_warps=4, **pdl_options(k),
    )


@triton.jit
def _load_clamped(ptr, lo, hi):
    """*ptr clamped to [lo, hi], as int64 until clamped (a bad int64 value is never truncated)."""
    return tl.minimum(tl.maximum(tl.load(ptr).to(tl.int64), lo), hi).to(tl.int32)


@triton.jit
def _find_tile(cu_ptr, stride_cu, tile, N, NUM_SEQS, SEARCH_STEPS, BLOCK_Q: tl.constexpr):
    """(sequence, its first tile) of query tile `tile`: the last i whose tiles start at or before
    it, sequence i's tiles starting at cu[i] // BLOCK_Q + i (binary search, SEARCH_STEPS >= log2)."""
    lo = 0
    hi = NUM_SEQS
    for _ in range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        right = _load_clamped(cu_ptr + mid * stride_cu, 0, N) // BLOCK_Q + mid <= tile
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo, _load_clamped(cu_ptr + lo * stride_cu, 0, N) // BLOCK_Q + lo


@triton.jit
def _attend_keys(q, kc_ptr, vc_ptr, table_row, stride_tb, n0, hi, q_pos, offs_n, offs_d, d_ok, head_off, qk_scale,
                 m_i, l_i, acc, NUM_BLOCKS, MASKED: tl.constexpr, HK: tl.constexpr, D: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, WIDE_OFFSETS: tl.constexpr, HEADROOM: tl.constexpr, P_SCALE: tl.constexpr):
    """One key tile of the online softmax over positions n0 + offs_n, gathered through the block
    table (the paged loader: K and V rows share one offset tile, K transposed after the load).
    MASKED tiles load only positions < hi and mask the causal diagonal; the others lie wholly
    before hi and every row's position. The running maximum is kept on the raw scores, scaled
    after the subtraction (attention.py's forward)."""
    pos = n0 + offs_n
    if MASKED:
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_tb, mask=pos < hi, other=0)
    else:
        block = tl.load(table_row + (pos // BLOCK_SIZE) * stride_tb)
    if WIDE_OFFSETS:  # a cache of 2^31 elements or more
        block = block.to(tl.int64)
    block = tl.minimum(tl.maximum(block, 0), NUM_BLOCKS - 1)  # a bad id never reads outside the cache
    offs = ((block * BLOCK_SIZE + pos % BLOCK_SIZE) * (HK * D) + head_off)[:, None] + offs_d[None, :]
    if MASKED:
        k = tl.load(kc_ptr + offs, mask=(pos[:, None] < hi) & d_ok[None, :], other=0.0)
    else:
        k = tl.load(kc_ptr + offs, mask=d_ok[None, :], other=0.0)
    s = dot(q, tl.trans(k), tl.zeros((q.shape[0], offs_n.shape[0]), dtype=tl.float32))
    if MASKED:
        s = tl.where((pos[None, :] < hi) & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    if MASKED:  # a row whose keys are all masked so far keeps m = -inf: shift by 0 instead of NaN
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new_safe = m_new
    alpha = tl.exp2((m_i - m_new_safe) * qk_scale)
    p = tl.exp2((s - m_new_safe[:, None]) * qk_scale) * P_SCALE  # p <= 2^-HEADROOM (common.SOFTMAX_HEADROOM)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(vc_ptr + offs, mask=(pos[:, None] < hi) & d_ok[None, :], other=0.0)
    else:
        v = tl.load(vc_ptr + offs, mask=d_ok[None, :], other=0.0)
    acc = dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@kernel
def _paged_attention_kernel(
    q_ptr, kc_ptr, vc_ptr, cu_ptr, lens_ptr, table_ptr, o_ptr, po_ptr, plse_ptr,
    stride_qn, stride_qh, stride_cu, stride_lens, stride_ts, stride_tb,
    N, HQ, NUM_SEQS, SEARCH_STEPS, NUM_BLOCKS, MAX_CONTEXT, NUM_SPLITS, qk_scale,
    HK: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_TILE_PER_SEQ: tl.constexpr, SPLIT: tl.constexpr,
    WIDE_OFFSETS: tl.constexpr, HEADROOM: tl.constexpr, P_SCALE: tl.constexpr, USE_PDL: tl.constexpr,
):
    qk_scale = fp32(qk_scale)
    hk = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(USE_PDL)
    if ONE_TILE_PER_SEQ:
        seq = tl.program_id(0)
        q_first = 0
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the last (longest) tiles start first
        seq, seq_tile = _find_tile(cu_ptr, stride_cu, tile, N, NUM_SEQS, SEARCH_STEPS, BLOCK_Q)
        q_first = (tile - seq_tile) * BLOCK_Q  # this tile's first token within its sequence's chunk
    start = _load_clamped(cu_ptr + seq * stride_cu, 0, N)
    qlen = _load_clamped(cu_ptr + (seq + 1) * stride_cu, start, N) - start
    if q_first >= qlen:  # a tile past its sequence's new tokens, or a sequence without any
        return
    seq_len = _load_clamped(lens_ptr + seq * stride_lens, 0, MAX_CONTEXT)
    rows = tl.arange(0, BLOCK_M)
    t = q_first + rows // GROUP
    h = hk * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (t < qlen)
    tok = (start + t).to(tl.int64)
    offs_d = tl.arange(0, head_block(D))  # D not a power of two: the dims past it masked
    d_ok = head_mask(offs_d, D)
    q = tl.load(q_ptr + tok[:, None] * stride_qn + h[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = seq_len - qlen + t
    first_pos = seq_len - qlen + q_first  # the tile's first query; its last sees keys < kv_end
    kv_end = seq_len - qlen + min(q_first + BLOCK_Q, qlen)
    split_len = tl.cdiv(tl.cdiv(tl.maximum(kv_end, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = min(lo + split_len, kv_end)
    full_end = lo + tl.maximum(min(first_pos + 1, hi) - lo, 0) // BLOCK_N * BLOCK_N  # every row sees [lo, full_end)
    table_row = table_ptr + seq.to(tl.int64) * stride_ts
    offs_n = tl.arange(0, BLOCK_N)
    head_off = hk * D
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, head_block(D)), dtype=tl.float32)
    for n0 in range(lo, full_end, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, kc_ptr, vc_ptr, table_row, stride_tb, n0, hi, q_pos, offs_n, offs_d, d_ok,
                                     head_off, qk_scale, m_i, l_i, acc, NUM_BLOCKS, False, HK, D, BLOCK_SIZE,
                                     WIDE_OFFSETS, HEADROOM, P_SCALE)
    for n0 in range(full_end, hi, BLOCK_N):
        m_i, l_i, acc = _attend_keys(q, kc_ptr, vc_ptr, table_row, stride_tb, n0, hi, q_pos, offs_n, offs_d, d_ok,
                                     head_off, qk_scale, m_i, l_i, acc, NUM_BLOCKS, True, HK, D, BLOCK_SIZE,
                                     WIDE_OFFSETS, HEADROOM, P_SCALE)
    pdl_launch_dependents(USE_PDL)
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]  # a row that sees no key: zeros
    o_row = tok * HQ + h  # o is contiguous [N, Hq, D]
    if SPLIT:
        lse = tl.where(has_keys, m_i * qk_scale + HEADROOM + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part_row = o_row * NUM_SPLITS + split
        tl.store(po_ptr + part_row[:, None] * D + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(plse_ptr + part_row, lse, mask=row_ok)
    else:
        tl.store(o_ptr + o_row[:, None] * D + offs_d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])



@kernel
def _combine_kernel(po_ptr, plse_ptr, o_ptr, NUM_SPLITS, D: tl.constexpr, BLOCK_S: tl.constexpr,
                           USE_PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # n * HQ + h: o is contiguous [N, HQ, D]
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


def split_count(splits: int, cache_len: int, block_n: int) -> int:
    """`splits` lowered so that sharing `cache_len` keys among them in whole key tiles of `block_n`
    leaves none empty."""
    return cdiv(cache_len, cdiv(cdiv(cache_len, splits), block_n) * block_n)


class Plan(NamedTuple):
    """One paged_attention launch: the mode, the tile (BLOCK_Q tokens x GROUP heads in BLOCK_M
    rows, BLOCK_N keys), the grid's tile count, the KV split count and the warps."""
    one_tile_per_seq: bool
    block_q: int
    block_m: int
    block_n: int
    tiles: int
    num_splits: int
    num_warps: int


def plan(n: int, num_seqs: int, hk: int, group: int, d: int, max_query_len: int, max_context: int, itemsize: int,
         target: int, num_splits: "int | None" = None) -> Plan:
    """The launch for these shapes and host ints (see the module doc) on a device whose grids aim
    for `target` programs (`target_programs`); `num_splits` overrides the split count (tests).
    Query tiles: 64 rows (32 at head_dim 256) and 8 warps for 16-bit operands, 16 x 16 tiles and 4
    warps for fp32 (exact fp32 dots; the interpreter, where wide tiles cost nothing, takes the
    16-bit ones); at least one group of rows. One tile per sequence: as few
    rows as its queries need (16 at least, for tl.dot), 4 warps. None of these spills registers
    on sm_90 (ptxas) at head_dims 64 to 256."""
    if itemsize == 4 and not INTERPRET:
        block_n, tile_rows, tile_warps = 16, 16, 4
    else:
        block_n, tile_rows, tile_warps = (64, 64, 8) if d <= 128 else (32, 32, 8)
    tile_rows = max(tile_rows, next_power_of_2(group))
    max_query_len = min(max_query_len, n)
    one_tile = max_query_len * group <= tile_rows
    block_m = max(16, next_power_of_2(max_query_len * group)) if one_tile else tile_rows
    block_q = block_m // group  # >= max_query_len with one tile per sequence
    tiles = num_seqs if one_tile else n // block_q + num_seqs
    warps = 4 if one_tile else tile_warps
    context = max(max_context, 1)
    if num_splits is None:  # about `target` programs, at most one split a key tile of the reach
        num_splits = min(cdiv(context, block_n), max(1, cdiv(target, tiles * hk)))
    return Plan(one_tile, block_q, block_m, block_n, tiles, split_count(num_splits, context, block_n), warps)


def paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale: float, max_query_len: int,
                    num_splits: "int | None" = None) -> torch.Tensor:
    """o [N, Hq, D] in q's dtype (see the module doc); `num_splits` overrides `plan`'s (tests)."""
    n, hq, d = q.shape
    num_blocks, block_size, hk, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    o = torch.empty((n, hq, d), dtype=q.dtype, device=q.device)
    if n * hq == 0 or num_seqs == 0:
        return o
    group = hq // hk
    max_context = block_table.shape[1] * block_size
    p = plan(n, num_seqs, hk, group, d, max_query_len, max_context, q.element_size(), target_programs(q.device),
             num_splits)
    if p.num_splits > 1:
        part_out = torch.empty((n, hq, p.num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((n, hq, p.num_splits), dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = o  # placeholders: with one split the kernel writes o
    headroom = softmax_headroom(v_cache.dtype)
    pdl = pdl_options(q)
    _paged_attention_kernel[(p.tiles, hk, p.num_splits)](
        q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, o, part_out, part_lse,
        q.stride(0), q.stride(1), cu_seqlens_q.stride(0), seq_lens.stride(0), block_table.stride(0),
        block_table.stride(1), n, hq, num_seqs, num_seqs.bit_length(), num_blocks, max_context, p.num_splits,
        scale * LOG2E, HK=hk, GROUP=group, D=d, BLOCK_SIZE=block_size, BLOCK_Q=p.block_q, BLOCK_M=p.block_m,
        BLOCK_N=p.block_n, ONE_TILE_PER_SEQ=p.one_tile_per_seq, SPLIT=p.num_splits > 1,
        WIDE_OFFSETS=k_cache.numel() >= 2**31, HEADROOM=headroom, P_SCALE=2.0 ** -headroom,
        num_warps=p.num_warps, num_stages=2, **pdl,
    )
    if p.num_splits > 1:
        _combine_kernel[(n * hq,)](part_out, part_lse, o, p.num_splits, D=d,
                                          BLOCK_S=next_power_of_2(p.num_splits), num_warps=4, **pdl)
    return o
