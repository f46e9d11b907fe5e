"""Fused decode GEMVs: each weight matrix of a decode step read once, by one kernel that also does
the small work around it (the norm before it, the residual add, SiLU, RoPE and the KV-cache write
after it), so a decoder layer runs six kernels instead of thirteen (with decode attention's two).

x [M, K] (M = batch x new tokens: a few rows), weight [N, K]. Program (n, s, m) multiplies the
BLOCK_M rows m of x by the BLOCK_N weight rows n over the K slice s. With SPLIT_K > 1 it stores
its fp32 partial product in part [SPLIT_K, M, N] and adds one to the tile's arrival counter; the
program that arrives last sums the SPLIT_K slices in a fixed order (deterministic: the atomics
only count) and runs the epilogue, then sets the counter back to zero. One kernel, no reduce pass.

Norm (NORM): rms_norm(x) @ W^T = rsqrt(mean(x^2) + eps) * ((x * (w + offset)) @ W^T), the rsqrt
being one scalar per row. So the main loop multiplies by x * (w + offset), rounded to the weight
dtype like the normed x of the unfused path (fp16 keeps it in fp32, for a TF32 product), while it
sums x^2 over its K slice from the same tiles; the row's rsqrt scales the sum at the end (with
SPLIT_K > 1 the slices' sums of squares are stored beside the partials and added by the last
program). The main loop, the split sums and the QKV epilogue's per-head values (RMSNorm, RoPE)
are fused_decode_blocks.py's.

Epilogues (y = the fp32 sum over K, rounded to the model dtype wherever the unfused ops would
have stored it, so the fused ops agree with the composition of their references to that
dtype's rounding; only the normed x is rounded at another point, see above):

- `norm_linear`: y (+ bias);
- `linear_residual`: residual + y (the residual stream's add, rounded once more);
- `norm_gate_up_silu`: a tile holds gate rows n and up rows I + n: silu(gate) * up;
- `norm_qkv_rope_store`: a tile is one head of the fused QKV projection (head_dim rows, in a
  power-of-two tile, `common.head_block`, whose rows past head_dim are neither read nor stored):
  query heads get the q RMSNorm and RoPE and go to the output, gate heads (Qwen3.5's gated
  attention) go to the output as they are, key heads get the k RMSNorm and RoPE and value heads
  nothing, and both are written into the paged KV cache at the row's slot (outside the cache:
  not written). RoPE pairs dimension i with i +- R/2, which another thread holds: the epilogue reads
  the summed head from `part` twice, once in each order (so even SPLIT_K = 1 goes through `part`).

The arrival counters are `common.semaphores`.

FP8 weights (the FP8 flag, each op's optional weight_scale_inv): weight [N, K] float8_e4m3fn with
weight_scale_inv [cdiv(N, 128), cdiv(K, 128)] (Qwen's block format, csrc_free_ops/fp8.py). No K
step is deeper than a scale block (FP8_BLOCK, 128): each e4m3 tile is widened to x's dtype (exact)
and its fp32 product scaled per output column by its block's scale,
acc += (x' @ weight[rn, step]^T) * weight_scale_inv[rn // 128, step // 128], so the epilogues see
the weight-only GEMV's fp32 sum (fp8_block_linear at decode). FP8 takes the same configs and
splits as bf16 (`gemv_config`: the device's table under x's dtype); a program prefetches only a
slice of one block or less, others run the loop in 128-deep steps (or shallower: a config's).
Without FP8 the scale arguments are not read and the kernels compile as before.

PDL: with `use_pdl` (`pdl_options`), a kernel's launch and address set-up overlap the previous
kernel's tail; it waits for that kernel (`pdl_wait`) before touching anything but its weights.
Weight prefetch (`PREFETCH`): a program whose K slice fits one register-resident tile
(`PREFETCH_BYTES`) issues the loads of its whole weight slice, lets the next kernel launch, and
only then waits, so while kernel i computes, kernel i+1's resident programs stream their weights
(the compiled SASS has every weight LDG.128 of such a program ahead of its one ACQBULK, the wait).
It shortens the decode step of both models (docs/performance.md, the decode GEMVs); the same
prefetch with the next kernel let in only after the product was slower than none. Other programs (the lm_head's, wide batches') run the
software-pipelined loop after the wait and let the next kernel start once it is done. Tried
earlier and slower: the first weight tile alone before the wait (a hand-written lookahead defeats
Triton's pipeliner), and an L2 prefetch of the program's weights.
"""
import math
import os
from typing import NamedTuple

import torch
import triton.language as tl

from .common import (FP8_BLOCK, INTERPRET, MAX_TILES, arrive, cdiv, empty_contiguous_like, fp32, head_block,
                     head_mask, kernel, next_power_of_2, pdl_launch_dependents, pdl_options, pdl_wait, semaphores,
                     target_programs, tuned)
from .fused_decode_blocks import (_block_scales, _gemv_slice, _head_values, _input_slice, _program_slice,
                                  _rotated_head, _sum_row_slices, _sum_slices, _weight_product, _weight_slice)
from .rope import fp32_position


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def gemv_config(op: str, n: int, k: int, device: torch.device, dtype: torch.dtype, m_blocks: int = 1,
                block_n: int | None = None, fp8: bool = False) -> GemvConfig:
    """The device's stored config for (op, N, K) (the table fused_decode; N: output columns, I for
    gate_up; `fp8`: FP8 weights take the entry under float8_e4m3fn first, from `python -m
    bench.fused_decode --sweep --fp8`, else x's `dtype`'s), else: BLOCK_N rows per tile (`block_n`:
    fixed by the op, one head for qkv), 256-deep K steps, and enough K slices for `target_programs`."""
    stored = tuned("fused_decode", device, torch.float8_e4m3fn, (op, n, k)) if fp8 else None
    if stored is None:
        stored = tuned("fused_decode", device, dtype, (op, n, k))
    if stored is not None:
        return GemvConfig(*stored)
    if INTERPRET:  # programs run one by one: few, wide ones, still split in two where K allows
        block_k = 64
        return GemvConfig(block_n or 64, block_k, min(2, cdiv(k, block_k)))
    block_n = block_n or (64 if n >= 32768 else 32)
    tiles = cdiv(n, block_n) * m_blocks
    return GemvConfig(block_n, 256, min(cdiv(k, 256), max(1, round(target_programs(device) / tiles))))


@kernel
def _gemv_kernel(
    x_ptr, nw_ptr, w_ptr, b_ptr, res_ptr, out_ptr, part_ptr, ss_ptr, sem_ptr,
    M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_rm, stride_om, stride_ps, stride_pm, eps, offset,
    sw_ptr, stride_sn, stride_sk,
    NORM: tl.constexpr, HAS_BIAS: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, FP8: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
):
    """out [M, N] = epilogue(x @ weight^T); with SILU, weight is [2N, K] (gate rows, then up rows);
    with FP8, weight is e4m3 and sw_ptr its scales (fused_decode_blocks.py)."""
    eps, offset = fp32(eps), fp32(offset)
    pid_n = tl.program_id(0)
    pid_s, pid_m, rm, k_lo, k_hi = _program_slice(K, K_PER_SPLIT, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dtype = x_ptr.dtype.element_ty
    scale_rows = rn % N  # the weight rows of the tile's columns, for their FP8 scales
    scale_rows_up = N + rn % N
    if PREFETCH:  # the whole weight slice is in flight before the program waits for its input
        w = _weight_slice(w_ptr, rn, N, k_lo, k_hi, stride_wn, BLOCK_K)
        w_up = w
        scales = _block_scales(sw_ptr, scale_rows, k_lo, stride_sn, stride_sk, FP8)
        scales_up = scales
        if SILU:
            w_up = _weight_slice(w_ptr + N * stride_wn, rn, N, k_lo, k_hi, stride_wn, BLOCK_K)
            scales_up = _block_scales(sw_ptr, scale_rows_up, k_lo, stride_sn, stride_sk, FP8)
        pdl_launch_dependents(USE_PDL)  # the next kernel's programs may load their weights meanwhile
        pdl_wait(USE_PDL)
        a, ss = _input_slice(x_ptr, nw_ptr, rm, M, k_lo, k_hi, stride_xm, offset, NORM, BLOCK_K)
        acc = _weight_product(a, w, scales, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), NORM, FP8, dtype)
        acc_up = acc
        if SILU:
            acc_up = _weight_product(a, w_up, scales_up, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), NORM, FP8,
                                     dtype)
    else:
        pdl_wait(USE_PDL)
        acc, ss = _gemv_slice(x_ptr, nw_ptr, w_ptr, sw_ptr, scale_rows, rm, rn, M, N, k_lo, k_hi, stride_xm,
                              stride_wn, stride_sn, stride_sk, offset, NORM, FP8, BLOCK_M, BLOCK_N, BLOCK_K)
        acc_up = acc
        if SILU:
            acc_up, _ = _gemv_slice(x_ptr, nw_ptr, w_ptr + N * stride_wn, sw_ptr, scale_rows_up, rm, rn, M, N, k_lo,
                                    k_hi, stride_xm, stride_wn, stride_sn, stride_sk, offset, NORM, FP8, BLOCK_M,
                                    BLOCK_N, BLOCK_K)
    if not PREFETCH:
        pdl_launch_dependents(USE_PDL)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tile = pid_m * tl.num_programs(0) + pid_n
    arrived = SPLIT_K - 1
    if SPLIT_K > 1:
        part_ptrs = part_ptr + pid_s * stride_ps + rm[:, None] * stride_pm + rn[None, :]
        tl.store(part_ptrs, acc, mask=mask)
        if SILU:
            tl.store(part_ptrs + N, acc_up, mask=mask)
        if NORM:  # every tile's programs store the same slice sums: identical writes
            tl.store(ss_ptr + pid_s * M + rm, ss, mask=rm < M)
        arrived = arrive(sem_ptr, tile)
    if arrived == SPLIT_K - 1:
        if SPLIT_K > 1:
            tl.atomic_xchg(sem_ptr + tile, 0)  # ready for the next launch
            acc = _sum_slices(part_ptr, rm, rn, mask, stride_ps, stride_pm, SPLIT_K)
            if SILU:
                acc_up = _sum_slices(part_ptr, rm, rn + N, mask, stride_ps, stride_pm, SPLIT_K)
            if NORM:
                ss = _sum_row_slices(ss_ptr, rm, M, SPLIT_K)
        if NORM:
            rstd = tl.rsqrt(ss / K + eps)[:, None]
            acc *= rstd
            acc_up *= rstd
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        if SILU:
            up = acc_up.to(out_ptr.dtype.element_ty).to(tl.float32)
            y = y * tl.sigmoid(y) * up
        if RESIDUAL:
            y += tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@kernel
def _qkv_kernel(
    x_ptr, nw_ptr, w_ptr, b_ptr, qn_ptr, kn_ptr, pos_ptr, slot_ptr, q_ptr, kc_ptr, vc_ptr, part_ptr, ss_ptr, sem_ptr,
    M, SLOTS, K, K_PER_SPLIT, stride_xm, stride_wn, stride_qm, stride_ps, stride_pm, stride_ks, stride_kh,
    stride_vs, stride_vh, eps, offset, log2_theta, sw_ptr, stride_sn, stride_sk,
    HQ: tl.constexpr, HK: tl.constexpr, GATED: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr, FP8: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Tile t of D rows of qkv = rms_norm(x) @ qkv_weight^T: t < QT a query (or, GATED, alternately
    query and gate) head, then HK key heads, then HK value heads. The tile is head_block(D) rows
    wide, those past D masked (not read, not stored). With FP8, qkv_weight is e4m3 and sw_ptr its
    scales (fused_decode_blocks.py)."""
    eps, offset, log2_theta = fp32(eps), fp32(offset), fp32(log2_theta)
    QW: tl.constexpr = 2 if GATED else 1
    QT: tl.constexpr = HQ * QW
    N: tl.constexpr = (QT + 2 * HK) * D
    BLOCK_D: tl.constexpr = head_block(D)
    tile = tl.program_id(0)
    pid_s, pid_m, rm, k_lo, k_hi = _program_slice(K, K_PER_SPLIT, BLOCK_M)
    rn = tile * D + tl.arange(0, BLOCK_D)
    d_ok = head_mask(tl.arange(0, BLOCK_D), D)
    scale_rows = rn % N  # the weight rows of the tile's columns, for their FP8 scales
    if PREFETCH:  # the whole weight slice is in flight before the program waits for its input
        w = _weight_slice(w_ptr, rn, N, k_lo, k_hi, stride_wn, BLOCK_K, D)
        scales = _block_scales(sw_ptr, scale_rows, k_lo, stride_sn, stride_sk, FP8)
        pdl_launch_dependents(USE_PDL)  # the next kernel's programs may load their weights meanwhile
        pdl_wait(USE_PDL)
        a, ss = _input_slice(x_ptr, nw_ptr, rm, M, k_lo, k_hi, stride_xm, offset, True, BLOCK_K)
        acc = _weight_product(a, w, scales, tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32), True, FP8,
                              x_ptr.dtype.element_ty)
    else:
        pdl_wait(USE_PDL)
        acc, ss = _gemv_slice(x_ptr, nw_ptr, w_ptr, sw_ptr, scale_rows, rm, rn, M, N, k_lo, k_hi, stride_xm,
                              stride_wn, stride_sn, stride_sk, offset, True, FP8, BLOCK_M, BLOCK_D, BLOCK_K, D)
    if not PREFETCH:
        pdl_launch_dependents(USE_PDL)
    row_ok = rm < M
    mask = row_ok[:, None] & (rn[None, :] < N) & d_ok[None, :]
    tl.store(part_ptr + pid_s * stride_ps + rm[:, None] * stride_pm + rn[None, :], acc, mask=mask)
    tile_id = pid_m * tl.num_programs(0) + tile
    arrived = SPLIT_K - 1
    if SPLIT_K > 1:
        tl.store(ss_ptr + pid_s * M + rm, ss, mask=row_ok)  # every tile stores the same slice sums
        arrived = arrive(sem_ptr, tile_id)
    else:
        tl.debug_barrier()  # the epilogue reads other threads' columns of the stored head
    if arrived == SPLIT_K - 1:
        if SPLIT_K > 1:
            tl.atomic_xchg(sem_ptr + tile_id, 0)
            ss = _sum_row_slices(ss_ptr, rm, M, SPLIT_K)
        rstd = tl.rsqrt(ss / K + eps)
        dtype = q_ptr.dtype.element_ty
        d = tl.arange(0, BLOCK_D)
        if tile < QT:
            head = tile // QW
            q_ptrs = q_ptr + rm[:, None] * stride_qm + head * (QW * D) + d[None, :]
            if tile % QW == 0:
                pos = fp32_position(tl.load(pos_ptr + rm, mask=row_ok, other=0))  # NaN past +-2^24, as rope's
                q = _rotated_head(part_ptr, b_ptr, qn_ptr, rm, tile * D, pos, mask, rstd, stride_ps, stride_pm, eps,
                                  offset, log2_theta, SPLIT_K, HAS_BIAS, HAS_QK_NORM, D, ROT, dtype)
                tl.store(q_ptrs, q.to(dtype), mask=mask)
            else:
                gate = _head_values(part_ptr, b_ptr, rm, rn, mask, d_ok, rstd, stride_ps, stride_pm, SPLIT_K,
                                    HAS_BIAS, dtype)
                tl.store(q_ptrs + D, gate.to(dtype), mask=mask)
        else:
            slot = tl.load(slot_ptr + rm, mask=row_ok, other=-1).to(tl.int64)
            in_cache = mask & ((slot >= 0) & (slot < SLOTS))[:, None]
            if tile < QT + HK:
                hk = tile - QT
                pos = fp32_position(tl.load(pos_ptr + rm, mask=row_ok, other=0))  # NaN past +-2^24, as rope's
                k = _rotated_head(part_ptr, b_ptr, kn_ptr, rm, tile * D, pos, mask, rstd, stride_ps,
                                  stride_pm, eps, offset, log2_theta, SPLIT_K, HAS_BIAS, HAS_QK_NORM, D, ROT, dtype)
                dst = kc_ptr + slot[:, None] * stride_ks + hk * stride_kh + d[None, :]
                tl.store(dst, k.to(kc_ptr.dtype.element_ty), mask=in_cache)
            else:
                hv = tile - QT - HK
                v = _head_values(part_ptr, b_ptr, rm, rn, mask, d_ok, rstd, stride_ps, stride_pm, SPLIT_K, HAS_BIAS,
                                 dtype)
                dst = vc_ptr + slot[:, None] * stride_vs + hv * stride_vh + d[None, :]
                tl.store(dst, v.to(vc_ptr.dtype.element_ty), mask=in_cache)


def _block_m(m: int) -> int:
    return min(64, max(16, next_power_of_2(m)))


SMEM_BUDGET = 200 << 10
"""Shared memory the pipelined main loop may take (an H200 SM has 227 KB)."""


PREFETCH = os.environ.get("QWEN_DECODE_PREFETCH", "1") != "0"
"""Programs whose weight slice fits PREFETCH_BYTES load all of it before the PDL wait
(QWEN_DECODE_PREFETCH=0: the pipelined loop after the wait for every program)."""
PREFETCH_BYTES = 32 << 10
"""The weight bytes one program of four warps holds in registers (64 registers a thread); its input
tile (fp32) may take half as much again."""


def _launch_shape(op: str, m: int, n: int, k: int, device: torch.device, dtype: torch.dtype, cfg: GemvConfig | None,
                  block_n: int | None = None, halves: int = 1, fp8: bool = False):
    """(BLOCK_M, row blocks, config, K per split, splits, prefetch). A program prefetches when its
    weight slice (`halves` x rows x one power-of-two K step) and its input tile fit PREFETCH_BYTES: its K slice is
    then one BLOCK_K step. Otherwise the config's pipeline is cut down (fewer stages, then shallower K
    steps) until it fits SMEM_BUDGET: fp32 weights or 256-row head tiles would not fit the bf16
    defaults. `dtype` is x's (a weight's unless FP8), the key of the device's table. `fp8` (FP8
    weights, one byte an element): the table's FP8 entry, else x's dtype's config and splits; no K
    step deeper than FP8_BLOCK, so that a step never crosses a scale block (both are powers of two):
    a program prefetches only a slice of one scale block or less."""
    bm = _block_m(m)
    m_blocks = cdiv(m, bm)
    cfg = cfg or gemv_config(op, n, k, device, dtype, m_blocks, block_n, fp8)
    itemsize = 1 if fp8 else dtype.itemsize
    rows = block_n or cfg.block_n
    step = max(16, next_power_of_2(cdiv(k, cfg.split_k)))  # a GPU dot's K is 16 at least (masked past k)
    fits = halves * rows * step * itemsize <= PREFETCH_BYTES and bm * step * 4 <= PREFETCH_BYTES // 2
    if PREFETCH and fits and not (fp8 and step > FP8_BLOCK):
        cfg = cfg._replace(block_k=step, num_stages=1)
        return bm, m_blocks, cfg, step, cdiv(k, step), True
    if fp8:
        cfg = cfg._replace(block_k=min(cfg.block_k, FP8_BLOCK))
    while cfg.num_stages * cfg.block_k * (rows * itemsize + bm * 4) > SMEM_BUDGET and cfg.block_k > 32:
        cfg = cfg._replace(num_stages=2) if cfg.num_stages > 2 else cfg._replace(block_k=cfg.block_k // 2)
    k_per_split = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    # No more stages than K steps: a program of one or two steps has nothing more to pipeline, and
    # spare buffers would only keep other programs (the next kernel's, under PDL) off the SM.
    cfg = cfg._replace(num_stages=max(1, min(cfg.num_stages, k_per_split // cfg.block_k)))
    return bm, m_blocks, cfg, k_per_split, cdiv(k, k_per_split), False


def _partials(split: int, m: int, n: int, norm: bool, device):
    """The fp32 partial products [split, m, n] and the slices' sums of squares [split, m] (empty
    without a split or without a norm)."""
    part = torch.empty((split, m, n) if split > 1 else (0, 0, 0), dtype=torch.float32, device=device)
    ss = torch.empty((split, m) if split > 1 and norm else (0,), dtype=torch.float32, device=device)
    return part, ss


def _scale_args(weight_scale_inv, weight) -> tuple:
    """The kernels' (sw_ptr, stride_sn, stride_sk): an FP8 weight's scales, or (weight, 0, 0), not read."""
    if weight_scale_inv is None:
        return weight, 0, 0
    return weight_scale_inv, weight_scale_inv.stride(0), weight_scale_inv.stride(1)


def _gemv(op, x2, weight, weight_scale_inv, bias, norm_weight, residual, out, eps, offset, silu, cfg=None):
    m, k = x2.shape
    n = out.shape[1]
    fp8 = weight_scale_inv is not None
    bm, m_blocks, cfg, k_per_split, split, prefetch = _launch_shape(op, m, n, k, weight.device, x2.dtype, cfg,
                                                                     halves=2 if silu else 1, fp8=fp8)
    tiles = cdiv(n, cfg.block_n)
    if split > 1 and tiles * m_blocks > MAX_TILES:
        raise ValueError(f"{op}: {tiles * m_blocks} output tiles exceed the {MAX_TILES} arrival counters")
    part, ss = _partials(split, m, (2 if silu else 1) * n, norm_weight is not None, x2.device)
    _gemv_kernel[(tiles, split, m_blocks)](
        x2, norm_weight if norm_weight is not None else x2, weight, bias if bias is not None else weight,
        residual if residual is not None else x2, out, part, ss, semaphores(x2.device),
        m, n, k, k_per_split, x2.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0,
        out.stride(0), part.stride(0), part.stride(1), eps, offset, *_scale_args(weight_scale_inv, weight),
        NORM=norm_weight is not None, HAS_BIAS=bias is not None, RESIDUAL=residual is not None, SILU=silu, FP8=fp8,
        SPLIT_K=split, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PREFETCH=prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x2),
    )
    return out


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def norm_linear(x, norm_weight, weight, bias, eps: float, offset: float, weight_scale_inv=None, cfg=None):
    """rms_norm(x) @ weight^T (+ bias): x [..., K] -> [..., N]. With `weight_scale_inv` [cdiv(N, 128),
    cdiv(K, 128)], weight is float8_e4m3fn, each 128 x 128 block scaled by its factor (so for every
    weight below)."""
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    if out.numel():
        _gemv("norm_linear", _rows(x), weight, weight_scale_inv, bias, norm_weight, None, _rows(out), eps, offset,
              False, cfg)
    return out


def linear_residual(x, weight, residual, weight_scale_inv=None, cfg=None):
    """residual + x @ weight^T: x [..., K], residual [..., N] -> [..., N]."""
    out = empty_contiguous_like(residual)
    if out.numel():
        _gemv("linear_residual", _rows(x), weight, weight_scale_inv, None, None, _rows(residual), _rows(out), 0.0,
              0.0, False, cfg)
    return out


def norm_gate_up_silu(x, norm_weight, gate_up_weight, eps: float, offset: float, gate_up_weight_scale_inv=None,
                      cfg=None):
    """silu_mul(rms_norm(x) @ gate_up_weight^T): x [..., K] -> [..., I], gate_up_weight [2I, K]."""
    out = x.new_empty((*x.shape[:-1], gate_up_weight.shape[0] // 2))
    if out.numel():
        _gemv("norm_gate_up_silu", _rows(x), gate_up_weight, gate_up_weight_scale_inv, None, norm_weight, None,
              _rows(out), eps, offset, True, cfg)
    return out


def norm_qkv_rope_store(x, norm_weight, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, k_cache, v_cache,
                        positions, slot_mapping, eps: float, offset: float, theta: float, rotary_dim: int,
                        num_heads: int, gated: bool, qkv_weight_scale_inv=None, cfg=None):
    """x [N, K] -> q [N, Hq, D] rotated at `positions` (with `gated`, [N, Hq, 2D]: per head query
    then gate); the rotated keys and the values go into the paged k_cache/v_cache [num_blocks,
    block_size, Hk, D] at `slot_mapping` (a slot outside the cache: not written). qkv_weight may be
    FP8 with its `qkv_weight_scale_inv`."""
    m, k = x.shape
    num_blocks, block_size, hk, d = k_cache.shape
    qw = 2 if gated else 1
    q = x.new_empty((m, num_heads, qw * d))
    if m == 0:
        return q
    x2 = _rows(x)
    n = qkv_weight.shape[0]
    fp8 = qkv_weight_scale_inv is not None
    bm, m_blocks, cfg, k_per_split, split, prefetch = _launch_shape("norm_qkv_rope_store", m, n, k,
                                                                    qkv_weight.device, x2.dtype, cfg,
                                                                    block_n=next_power_of_2(d), fp8=fp8)
    tiles = n // d
    if split > 1 and tiles * m_blocks > MAX_TILES:
        raise ValueError(f"norm_qkv_rope_store: {tiles * m_blocks} tiles exceed the {MAX_TILES} arrival counters")
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device)  # even unsplit: RoPE reads it back
    ss = torch.empty((split, m) if split > 1 else (0,), dtype=torch.float32, device=x.device)
    has_norm = q_norm_weight is not None
    _qkv_kernel[(tiles, split, m_blocks)](
        x2, norm_weight, qkv_weight, qkv_bias if qkv_bias is not None else qkv_weight,
        q_norm_weight if has_norm else x2, k_norm_weight if has_norm else x2, positions.contiguous(),
        slot_mapping.contiguous(), q, k_cache, v_cache, part, ss, semaphores(x.device),
        m, num_blocks * block_size, k, k_per_split, x2.stride(0), qkv_weight.stride(0), num_heads * qw * d,
        part.stride(0), part.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1), v_cache.stride(2),
        eps, offset, math.log2(theta), *_scale_args(qkv_weight_scale_inv, qkv_weight),
        HQ=num_heads, HK=hk, GATED=gated, D=d, ROT=rotary_dim, HAS_BIAS=qkv_bias is not None,
        HAS_QK_NORM=has_norm, FP8=fp8, SPLIT_K=split, BLOCK_M=bm, BLOCK_K=cfg.block_k, PREFETCH=prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_options(x),
    )
    return q
