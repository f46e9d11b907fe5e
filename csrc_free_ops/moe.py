"""Mixture of experts: the router's top-k, the (token, expert) pairs sorted per expert, the grouped
GEMMs and the combine (vLLM's fused MoE design).

    moe_topk_softmax(logits [M, E], k, renormalize) -> weights [M, k] fp32, ids [M, k] int32
        p = softmax(logits) in fp32; the k largest p of each row, largest first (ties: the lower
        expert id first); divided by their sum when renormalize.
    moe_align_block_size(ids [M, k], E, BM) -> sorted_ids [P], expert_ids [P / BM], num_post_padded [1]
        pair i = (token i // k, its (i % k)-th expert); each expert's pairs in increasing i, padded
        to a multiple of BM with the sentinel M * k, experts one after the other; block b of BM
        rows belongs to expert_ids[b] (-1 past num_post_padded). P = M * k + E * (BM - 1) is the
        worst case, so every size is a function of the shapes (no host sync: CUDA-graph safe).
    fused_moe(x [M, H], w13 [E, 2I, H], w2 [E, H, I], weights, ids, shared [M, H]?, shared_gate [M, 1]?,
              w13_scale_inv [E, cdiv(2I, 128), cdiv(H, 128)]?, w2_scale_inv [E, cdiv(H, 128), cdiv(I, 128)]?)
        y = sum_j weights[:, j] * (silu(x @ w13[e_j, :I].T) * (x @ w13[e_j, I:].T)) @ w2[e_j].T
            (+ sigmoid(shared_gate) * shared)
        A weight given with its scales (fp32) is FP8: float8_e4m3fn in the block format of Qwen's FP8
        checkpoints, expert by expert: w[e, n, k] = weight[e, n, k] * scale_inv[e, n // 128, k // 128].

fused_moe runs, for M > GEMV_MAX_TOKENS: the sort (three kernels: per-chunk counts and ranks;
one program's prefix sums over chunks and experts and the blocks' experts; the scatter), then
`_grouped_gemm_kernel` twice over the sorted rows: gate_up, whose epilogue is SiLU-and-multiply
(the gate and up columns of one tile come from one [BM, 2BN] product, `common.tile_product`), and
down, whose epilogue multiplies by the pair's routing weight. Each writes rows by pair index
([M * k, I], then [M * k, H], in x's dtype); padding rows (the sentinel) are neither read
usefully nor stored; blocks past num_post_padded exit at once. Decode-sized steps (M <=
GEMV_MAX_TOKENS) skip the sort: `_gemv_kernel` gives each pair its own programs (the top-k ids
are the expert of each row). `_combine_kernel` sums each token's k rows in a fixed order (no
atomics) and adds the gated shared expert. fp32 accumulation throughout.

FP8 experts (an `FP8_W` constexpr of both GEMM kernels: the bf16 ones compile as without it) are
weight-only: x and the activation between the GEMMs stay in x's dtype, and each weight tile is
dequantised in registers.
    GEMV:    c[i, n] = sum_k a[k] * (w[e, n, k] * s[e, n // 128, k // 128])          (fp32 tiles)
    grouped: c[i, n] = sum over K steps t of (a[i, t] . w[e, n, t]) * s[e, n // 128, t // 128]
Each grouped step (`common.fp8_weight_tile_product`, the dense FP8 GEMV's main loop) is one dot of
a's tile with the FP8 tile widened to a's dtype (exact), on the tensor-core instructions of
unquantised weights; BLOCK_K is the config's, at most 128, so a step lies in one block.
Weight-only rather than activations quantised per token and group of 128 with FP8 dots
(fp8_block_linear's prefill math): the weights' bytes halve as in decode, the bf16 tile configs
serve unchanged (a tile needs no more shared memory), and no quantisation kernel or activation
scales sit between the GEMMs.

Configs: the device's table moe (`devices`), keyed by (E, N, K) and then by the largest M a config
serves; shapes not listed take `default_config`. gate_up's BLOCK_M is the sort's block; down
takes its BLOCK_N / BLOCK_K / warps / stages from its own entry (E, H, I). FP8 experts take the
configs of x's dtype.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (FP8_BLOCK, INTERPRET, cdiv, fp8_block_scales, fp8_weight_tile_product, grouped_tile, kernel,
                     next_power_of_2, target_programs, tile_product, tuned)

GEMV_MAX_TOKENS = 4
"""Steps of at most this many tokens take the per-pair GEMV path (no sort)."""
MAX_EXPERTS = 1024
"""The router kernel holds a row of logits in one block."""
CHUNK = 64
"""Pairs per program of the sort's count and scatter kernels (a CHUNK x CHUNK comparison gives the ranks)."""


class MoeConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


def default_config(m: int, e: int, n: int, k: int, top_k: int, itemsize: int) -> MoeConfig:
    """A config by the pairs an expert gets on average (M * top_k / E): 16-row blocks where most
    experts see a few rows, 64 and then 128 where they see many. Under the interpreter, small tiles."""
    if INTERPRET:
        return MoeConfig(16, min(32, max(16, next_power_of_2(n))), min(32, max(16, next_power_of_2(k))), 1, 4, 1)
    per_expert = m * top_k / e
    stages = 2 if itemsize == 4 else 3
    if per_expert <= 16:
        return MoeConfig(16, 64, 128 if itemsize == 2 else 64, 1, 4, stages)
    if per_expert <= 128:
        return MoeConfig(64, 64, 64, 8, 4, stages)
    return MoeConfig(128, 128, 64, 8, 8, stages)


def moe_config(m: int, e: int, n: int, k: int, top_k: int, device: torch.device, dtype: torch.dtype) -> MoeConfig:
    """The device's stored config for (E, N, K) (the table moe) of the smallest bucket >= M (the
    largest bucket past them), else `default_config`."""
    buckets = tuned("moe", device, dtype, (e, n, k))
    if not buckets:
        return default_config(m, e, n, k, top_k, dtype.itemsize)
    return MoeConfig(*buckets[min((b for b in buckets if b >= m), default=max(buckets))])


# ------------------------------------------------------------------------------------------- router


@kernel
def _topk_softmax_kernel(logits_ptr, w_ptr, ids_ptr, M, E, stride_l, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < M
    x = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + cols[None, :],
                mask=row_ok[:, None] & (cols[None, :] < E), other=0.0).to(tl.float32)
    x = tl.where(cols[None, :] < E, x, float("-inf"))
    p = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    p = tl.where(cols[None, :] < E, p, -2.0)  # never picked; a picked column becomes -1
    kk = tl.arange(0, BLOCK_K)[None, :]
    top_w = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    top_i = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(p, axis=1, tie_break_left=True)
        value = tl.max(p, axis=1)
        top_w = tl.where(kk == j, value[:, None], top_w)
        top_i = tl.where(kk == j, best[:, None], top_i)
        p = tl.where(cols[None, :] == best[:, None], -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.sum(top_w, axis=1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + kk
    mask = row_ok[:, None] & (kk < TOP_K)
    tl.store(w_ptr + out, top_w, mask=mask)
    tl.store(ids_ptr + out, top_i, mask=mask)


def moe_topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """router_logits [M, E] (last dim contiguous) -> (weights [M, k] fp32, ids [M, k] int32)."""
    m, e = router_logits.shape
    weights = torch.empty((m, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((m, top_k), dtype=torch.int32, device=router_logits.device)
    if m == 0:
        return weights, ids
    block_e = next_power_of_2(e)
    block_r = max(1, min(next_power_of_2(m), (4096 if INTERPRET else 1024) // block_e))
    _topk_softmax_kernel[(cdiv(m, block_r),)](router_logits, weights, ids, m, e, router_logits.stride(0),
                                              TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_R=block_r,
                                              BLOCK_E=block_e, BLOCK_K=next_power_of_2(top_k), num_warps=4)
    return weights, ids


# ------------------------------------------------------------------------------------ the sort


@kernel
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, sorted_ptr, numel, E, padded_size, FILL_PER_PROGRAM,
                  CHUNK: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_FILL: tl.constexpr):
    """Chunk c's pairs: counts[c, e] (pairs of expert e in the chunk), each pair's rank among its
    expert's pairs of the chunk; and the chunk's share of sorted_ids filled with the sentinel."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    e = tl.where((e >= 0) & (e < E), e, BLOCK_E - 1 + 0 * e)  # out of range: the spare bin, never read
    same = (e[:, None] == e[None, :]) & (tl.arange(0, CHUNK)[None, :] < tl.arange(0, CHUNK)[:, None])
    tl.store(rank_ptr + offs, tl.sum(same.to(tl.int32), axis=1), mask=offs < numel)
    bins = tl.arange(0, BLOCK_E)
    counts = tl.sum((e[:, None] == bins[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + c * E + bins, counts, mask=bins < E)
    for f0 in range(0, FILL_PER_PROGRAM, BLOCK_FILL):
        step = f0 + tl.arange(0, BLOCK_FILL)
        f = c * FILL_PER_PROGRAM + step
        tl.store(sorted_ptr + f, numel + 0 * f, mask=(f < padded_size) & (step < FILL_PER_PROGRAM))


@kernel
def _offsets_kernel(counts_ptr, prefix_ptr, starts_ptr, expert_ids_ptr, post_ptr, C, E, BM, num_blocks,
                    BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """One program: prefix[c, e] = pairs of expert e in chunks before c; each expert's padded
    count and start; num_post_padded; the expert of every block (-1 past the last)."""
    bins = tl.arange(0, BLOCK_E)
    running = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for c0 in range(0, C, BLOCK_C):
        cc = c0 + tl.arange(0, BLOCK_C)
        mask = (cc[:, None] < C) & (bins[None, :] < E)
        tile = tl.load(counts_ptr + cc[:, None] * E + bins[None, :], mask=mask, other=0)
        tl.store(prefix_ptr + cc[:, None] * E + bins[None, :], tl.cumsum(tile, axis=0) - tile + running[None, :],
                 mask=mask)
        running += tl.sum(tile, axis=0)
    padded = (running + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_ptr + bins, ends - padded, mask=bins < E)
    total = tl.sum(padded, axis=0)
    tl.store(post_ptr, total)
    for b0 in range(0, num_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        expert = tl.sum((ends[None, :] <= b[:, None] * BM).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + b, tl.where(b * BM < total, expert, -1), mask=b < num_blocks)


@kernel
def _scatter_kernel(ids_ptr, rank_ptr, prefix_ptr, starts_ptr, sorted_ptr, numel, E, CHUNK: tl.constexpr):
    """sorted_ids[start[e] + prefix[c, e] + rank] = pair, for chunk c's pairs of an expert in range."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + offs, mask=offs < numel, other=-1).to(tl.int32)
    ok = (offs < numel) & (e >= 0) & (e < E)
    e = tl.where(ok, e, 0)
    pos = tl.load(starts_ptr + e, mask=ok, other=0) + tl.load(prefix_ptr + c * E + e, mask=ok, other=0) \
        + tl.load(rank_ptr + offs, mask=ok, other=0)
    tl.store(sorted_ptr + pos, offs, mask=ok)


def sorted_sizes(numel: int, num_experts: int, block_size: int):
    """(P, blocks): the sorted ids' worst-case length M * k + E * (BM - 1) and its blocks of BM."""
    padded = numel + num_experts * (block_size - 1)
    return padded, cdiv(padded, block_size)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """topk_ids [M, k] contiguous -> (sorted_ids [P] int32, expert_ids [P / BM] int32,
    num_post_padded [1] int32), see the module doc."""
    numel, dev = topk_ids.numel(), topk_ids.device
    padded, blocks = sorted_sizes(numel, num_experts, block_size)
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(blocks, dtype=torch.int32, device=dev)
    post = torch.empty(1, dtype=torch.int32, device=dev)
    chunks = max(1, cdiv(numel, CHUNK))
    counts = torch.empty((chunks, num_experts), dtype=torch.int32, device=dev)
    prefix = torch.empty_like(counts)
    rank = torch.empty(max(1, numel), dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    block_e = next_power_of_2(num_experts + 1)  # one spare bin for ids out of range
    fill = cdiv(padded, chunks)
    _count_kernel[(chunks,)](topk_ids, counts, rank, sorted_ids, numel, num_experts, padded, fill, CHUNK=CHUNK,
                             BLOCK_E=block_e, BLOCK_FILL=min(1024, next_power_of_2(fill)), num_warps=4)
    _offsets_kernel[(1,)](counts, prefix, starts, expert_ids, post, chunks, num_experts, block_size, blocks,
                          BLOCK_C=max(1, min(next_power_of_2(chunks), 4096 // block_e)), BLOCK_E=block_e,
                          BLOCK_B=max(1, min(next_power_of_2(blocks), 4096 // block_e)), num_warps=4)
    if numel:
        _scatter_kernel[(chunks,)](topk_ids, rank, prefix, starts, sorted_ids, numel, num_experts, CHUNK=CHUNK,
                                   num_warps=4)
    return sorted_ids, expert_ids, post


# ---------------------------------------------------------------------------------- the GEMMs


@triton.jit
def _expert_product(a_ptr, w_ptr, ws_ptr, rows, cols, A_ROWS, N, K, stride_am, stride_wn, stride_wsn,
                    FP8_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile a[rows] @ w[cols].T of one expert's weight w [N, K]: in a's dtype,
    or (FP8_W) float8_e4m3fn dequantised in registers by its block scales ws (`fp8_weight_tile_product`)."""
    if FP8_W:
        acc = fp8_weight_tile_product(a_ptr, w_ptr, ws_ptr, rows.to(tl.int64), cols, A_ROWS, N, 0, K, stride_am,
                                      stride_wn, stride_wsn, 1, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = tile_product(a_ptr, w_ptr, rows, cols, A_ROWS, N, 0, K, stride_am, 1, 1, stride_wn, BLOCK_M, BLOCK_N,
                           BLOCK_K, EVEN_K)
    return acc


@kernel
def _grouped_gemm_kernel(a_ptr, w_ptr, ws_ptr, c_ptr, topk_w_ptr, sorted_ptr, expert_ids_ptr, post_ptr,
                         A_ROWS, N, K, num_pairs, padded_rows, a_row_div, stride_am, stride_we, stride_wn, stride_wse,
                         stride_wsn, stride_cm, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8_W: tl.constexpr,
                         EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
    """Tile (block, n) of the sorted rows: c[pair, n] for the block's pairs, against its expert's
    weight w[e] [N (2N with SILU_MUL), K] (FP8_W: float8_e4m3fn with block scales ws[e]). A row of
    pair i is a[i // a_row_div]."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), padded_rows, N, BLOCK_M, BLOCK_N, GROUP_M)
    if pid_m * BLOCK_M >= tl.load(post_ptr):
        return
    e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_e = w_ptr + e * stride_we
    ws_e = ws_ptr + e * stride_wse
    if SILU_MUL:  # gate columns rn and up columns N + rn in one [BM, 2BN] product
        r2 = tl.arange(0, 2 * BLOCK_N)
        cols = tl.where(r2 < BLOCK_N, pid_n * BLOCK_N + r2, N + pid_n * BLOCK_N + r2 - BLOCK_N)
        acc = _expert_product(a_ptr, w_e, ws_e, pairs // a_row_div, cols, A_ROWS, 2 * N, K, stride_am, stride_wn,
                              stride_wsn, FP8_W, BLOCK_M, 2 * BLOCK_N, BLOCK_K, EVEN_K)
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        y = gate * tl.sigmoid(gate) * up
    else:
        y = _expert_product(a_ptr, w_e, ws_e, pairs // a_row_div, rn, A_ROWS, N, K, stride_am, stride_wn, stride_wsn,
                            FP8_W, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    if MUL_WEIGHT:
        y = y * tl.load(topk_w_ptr + pairs, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + rn[None, :], y.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & (rn[None, :] < N))


@kernel
def _gemv_kernel(a_ptr, w_ptr, ws_ptr, c_ptr, topk_w_ptr, ids_ptr, N, K, E, a_row_div, stride_am, stride_we, stride_wn,
                 stride_wse, stride_wsn, stride_cm, SILU_MUL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
                 FP8_W: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Pair i = program_id(0), columns of tile program_id(1): c[i, n] against w[ids[i]]; a pair
    whose id is outside [0, E) writes nothing (the combine skips it). FP8_W: w is float8_e4m3fn,
    each tile widened to fp32 and multiplied by its rows' block scales ws[e] (BLOCK_K divides
    FP8_BLOCK: a tile's columns lie in one block)."""
    pair = tl.program_id(0)
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_row = a_ptr + (pair // a_row_div).to(tl.int64) * stride_am
    rows = (rn % N).to(tl.int64)
    w_rows = w_ptr + e * stride_we + rows[:, None] * stride_wn
    ws_e = ws_ptr + e * stride_wse
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + rk < K
        x = tl.load(a_row + k0 + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        w = tl.load(w_rows + k0 + rk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
        if FP8_W:
            w = w * fp8_block_scales(ws_e, rows, k0, stride_wsn, 1)[:, None]
        acc += tl.sum(w * x, axis=1)
        if SILU_MUL:
            w_up = tl.load(w_rows + N * stride_wn + k0 + rk[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
            if FP8_W:
                w_up = w_up * fp8_block_scales(ws_e, N + rows, k0, stride_wsn, 1)[:, None]
            acc_up += tl.sum(w_up * x, axis=1)
    if SILU_MUL:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(c_ptr + pair.to(tl.int64) * stride_cm + rn, acc.to(c_ptr.dtype.element_ty), mask=rn < N)


@kernel
def _combine_kernel(y_ptr, ids_ptr, shared_ptr, gate_ptr, out_ptr, M, H, E, stride_g,
                    TOP_K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[m] = sum_j y[m * k + j] (j in order, ids in [0, E) only) + sigmoid(gate[m]) * shared[m]."""
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < M
    mask = row_ok[:, None] & (cols[None, :] < H)
    acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + rows * TOP_K + j, mask=row_ok, other=-1)
        ok = mask & ((e >= 0) & (e < E))[:, None]
        acc += tl.load(y_ptr + (rows * TOP_K + j)[:, None] * H + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    if HAS_SHARED:
        g = tl.load(gate_ptr + rows * stride_g, mask=row_ok, other=0.0).to(tl.float32)
        s = tl.load(shared_ptr + rows[:, None] * H + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += tl.sigmoid(g)[:, None] * s
    tl.store(out_ptr + rows[:, None] * H + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_strides(w_scale_inv) -> tuple[int, int]:
    """The expert and block-row strides of an FP8 weight's scales [E, cdiv(N, 128), cdiv(K, 128)]
    (last dim contiguous); (0, 0) without them."""
    return (0, 0) if w_scale_inv is None else (w_scale_inv.stride(0), w_scale_inv.stride(1))


def _gemm(a, w, w_scale_inv, out, topk_weights, sorted_ids, expert_ids, post, a_row_div: int, silu_mul: bool,
          cfg: MoeConfig, block_m: int):
    """One grouped GEMM over the sorted rows into out [pairs, N] (rows by pair); an FP8 w (with
    w_scale_inv) takes K steps of at most FP8_BLOCK, so that none crosses a scale block."""
    n = out.shape[1]
    k = a.shape[1]
    padded = sorted_ids.shape[0]
    fp8 = w_scale_inv is not None
    block_k = min(cfg.block_k, FP8_BLOCK) if fp8 else cfg.block_k
    grid = (cdiv(padded, block_m) * cdiv(n, cfg.block_n),)
    _grouped_gemm_kernel[grid](a, w, w_scale_inv if fp8 else w, out, topk_weights, sorted_ids, expert_ids, post,
                               a.shape[0], n, k, out.shape[0], padded, a_row_div, a.stride(0), w.stride(0), w.stride(1),
                               *_scale_strides(w_scale_inv), out.stride(0), SILU_MUL=silu_mul, MUL_WEIGHT=not silu_mul,
                               FP8_W=fp8, EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
                               BLOCK_K=block_k, GROUP_M=cfg.group_m, num_warps=cfg.num_warps,
                               num_stages=cfg.num_stages)


def _gemv(a, w, w_scale_inv, out, topk_weights, ids, a_row_div: int, silu_mul: bool):
    """One program per pair and BLOCK_N columns, BLOCK_N halved from 64 (down to 16) until the
    programs fill `target_programs`: a batch-1 step has only k pairs (96 programs of 64 gate_up
    columns at Qwen3-30B-A3B's shape, fewer than the SMs). BLOCK_K (at most 128) divides FP8_BLOCK."""
    n, k = out.shape[1], a.shape[1]
    block_n = min(64, max(16, next_power_of_2(n)))
    while block_n > 16 and out.shape[0] * cdiv(n, block_n) < target_programs(out.device):
        block_n //= 2
    block_k = min(128 if not INTERPRET else 64, max(16, next_power_of_2(k)))
    fp8 = w_scale_inv is not None
    _gemv_kernel[(out.shape[0], cdiv(n, block_n))](a, w, w_scale_inv if fp8 else w, out, topk_weights, ids, n, k,
                                                    w.shape[0], a_row_div, a.stride(0), w.stride(0), w.stride(1),
                                                    *_scale_strides(w_scale_inv), out.stride(0), SILU_MUL=silu_mul,
                                                    MUL_WEIGHT=not silu_mul, FP8_W=fp8, BLOCK_N=block_n,
                                                    BLOCK_K=block_k, num_warps=4)


def fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, shared_output=None, shared_gate=None,
              w13_scale_inv=None, w2_scale_inv=None, path: str | None = None):
    """hidden_states [M, H], w13 [E, 2I, H], w2 [E, H, I] (last dims contiguous), topk_weights
    [M, k], topk_ids [M, k] (contiguous), shared_output [M, H] and shared_gate [M, 1] (or None)
    -> [M, H] in hidden_states' dtype. A weight given with its scales (w13_scale_inv [E, cdiv(2I,
    128), cdiv(H, 128)], w2_scale_inv [E, cdiv(H, 128), cdiv(I, 128)], fp32, last dim contiguous)
    is float8_e4m3fn. `path` ("gemv" or "sorted") overrides the choice by M."""
    m, h = hidden_states.shape
    e, two_i, _ = w13.shape
    top_k = topk_ids.shape[1]
    inter = two_i // 2
    dev, dtype = hidden_states.device, hidden_states.dtype
    out = torch.empty((m, h), dtype=dtype, device=dev)
    if m == 0:
        return out
    pairs = m * top_k
    act = torch.empty((pairs, inter), dtype=dtype, device=dev)
    y = torch.empty((pairs, h), dtype=dtype, device=dev)
    if (path or ("gemv" if m <= GEMV_MAX_TOKENS else "sorted")) == "gemv":
        _gemv(hidden_states, w13, w13_scale_inv, act, topk_weights, topk_ids, top_k, True)
        _gemv(act, w2, w2_scale_inv, y, topk_weights, topk_ids, 1, False)
    else:
        cfg = moe_config(m, e, two_i, h, top_k, dev, dtype)
        down = moe_config(m, e, h, inter, top_k, dev, dtype)
        sorted_ids, expert_ids, post = moe_align_block_size(topk_ids, e, cfg.block_m)
        _gemm(hidden_states, w13, w13_scale_inv, act, topk_weights, sorted_ids, expert_ids, post, top_k, True, cfg,
              cfg.block_m)
        _gemm(act, w2, w2_scale_inv, y, topk_weights, sorted_ids, expert_ids, post, 1, False, down, cfg.block_m)
    block_h = min(1024 if INTERPRET else 256, next_power_of_2(h))
    block_r = max(1, min(next_power_of_2(m), (8192 if INTERPRET else 2048) // block_h))
    has_shared = shared_output is not None
    _combine_kernel[(cdiv(m, block_r), cdiv(h, block_h))](
        y, topk_ids, shared_output if has_shared else y, shared_gate if has_shared else y, out, m, h, e,
        shared_gate.stride(0) if has_shared else 0, TOP_K=top_k, HAS_SHARED=has_shared, BLOCK_R=block_r,
        BLOCK_H=block_h, num_warps=4)
    return out
