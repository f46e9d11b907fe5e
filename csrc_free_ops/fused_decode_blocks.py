"""The fused decode GEMVs' building blocks: the device functions fused_decode.py's two kernels
are made of. A program's K slice and the main loop over it (the input RMSNorm folded in), the
fixed-order sums of the split-K partials, and the QKV epilogue's heads read back from them.

x [M, K] (M = batch x new tokens: a few rows), weight [N, K]. Program (n, s, m) (`_program_slice`)
multiplies the BLOCK_M rows rm = m*BLOCK_M.. of x by the BLOCK_N weight rows rn over its K slice
[k_lo, k_hi) = [s*K_PER_SPLIT, min((s+1)*K_PER_SPLIT, K)):

    acc [BLOCK_M, BLOCK_N] fp32 = x'[rm, k_lo:k_hi] @ weight[rn, k_lo:k_hi]^T

either in BLOCK_K-deep steps software-pipelined by Triton (`_gemv_slice`) or, for a slice of one
step whose tiles were loaded ahead, as one product of `_input_slice` and `_weight_slice`
(`_dot_slice`). Weight rows past N wrap to valid rows (their columns are masked at the store);
with ROWS (a head of ROWS rows in a head_block(ROWS) tile) rows past ROWS are not read.

FP8 weights (FP8): weight [N, K] float8_e4m3fn with weight_scale_inv [cdiv(N, 128), cdiv(K, 128)],
the factor of each 128 x 128 block (csrc_free_ops/fp8.py). BLOCK_K divides 128 and a slice starts
at a multiple of BLOCK_K, so a K step lies inside one block column g: each step's tile is widened
to x's dtype (`common.widen_e4m3`, exact) and its fp32 product scaled per
output column by the scale of that column's row block in g (`_block_scales`, through
`common.fp8_block_scales`):

    acc += (x'[rm, step] @ weight[rn, step]^T) * weight_scale_inv[rn // 128, g]

the weight-only GEMV's math (`fp8_block_linear` at decode). Without FP8 the scale arguments are
not read: the bf16 kernels compile as they would without them.

Norm (NORM): rms_norm(x) @ W^T = rsqrt(mean(x^2) + eps) * ((x * (w + offset)) @ W^T), the rsqrt
being one scalar per row. So the main loop multiplies by x' = x * (w + offset), rounded to the
weight dtype like the normed x of the unfused path (fp16 keeps it in fp32 and runs the product on
TF32 tensor cores instead, `_dot_widened`: unnormalised, it could pass fp16's 65504), while it
sums x^2 over its K slice from the same tiles (ss [BLOCK_M]); the kernel's epilogue scales by the
row's rsqrt. No extra pass over x before the weights start streaming. Without NORM, x' = x.

Split sums: part [SPLIT_K, M, N] fp32 holds the slices' products and ss [SPLIT_K, M] their sums of
squares; `_sum_slices` and `_sum_row_slices` add them in slice order (deterministic), read
through L2 where the other programs stored them.

QKV epilogue: `_head_values` is a head's projection as the unfused linear stores it (the sum of
the slices, times the input norm's rsqrt, plus the bias, rounded to the model dtype);
`_rotated_head` adds the per-head RMSNorm and RoPE on its first ROT dims (the math of
csrc_free_ops/rope.py): dimension i pairs with i +- ROT/2, which another thread holds, so the head
is read from `part` twice, once in each order.
"""
import triton
import triton.language as tl

from .common import dot, fp8_block_scales, head_block, head_mask, widen_e4m3
from .rope import rotary_cos_sin


@triton.jit
def _weight_slice(w_ptr, rn, N, k_lo, k_hi, stride_wn, BLOCK_K: tl.constexpr, ROWS: tl.constexpr = None):
    """weight[rn, k_lo:k_lo + BLOCK_K]^T as a [BLOCK_K, BLOCK_N] tile, zero past k_hi; with ROWS
    (a head of ROWS rows in a head_block(ROWS) tile) also zero past the tile's first ROWS rows,
    which are not read."""
    rk = k_lo + tl.arange(0, BLOCK_K)
    mask = (rk < k_hi)[:, None]
    if ROWS is not None:
        mask = mask & head_mask(tl.arange(0, rn.shape[0]), ROWS)[None, :]
    return tl.load(w_ptr + (rn % N).to(tl.int64)[None, :] * stride_wn + rk[:, None], mask=mask, other=0.0)


@triton.jit
def _input_slice(x_ptr, nw_ptr, rm, M, k_lo, k_hi, stride_xm, offset, NORM: tl.constexpr, BLOCK_K: tl.constexpr):
    """(a, ss): a [BLOCK_M, BLOCK_K] = x[rm, k_lo:k_lo + BLOCK_K] (zero outside), or with NORM
    x * (norm weight + offset) in fp32 and ss [BLOCK_M] = the tile's sum of x^2."""
    rk = k_lo + tl.arange(0, BLOCK_K)
    k_ok = rk < k_hi
    a = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
    ss = tl.zeros((a.shape[0],), dtype=tl.float32)
    if NORM:
        a = a.to(tl.float32)
        ss = tl.sum(a * a, axis=1)
        a = a * (tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32) + offset)[None, :]
    return a, ss


@triton.jit
def _dot_slice(a, b, acc, NORM: tl.constexpr):
    """acc + a @ b for an `_input_slice` a and a `_weight_slice` b."""
    if NORM:
        acc = _dot_widened(a, b, acc)
    else:
        acc = dot(a, b, acc)
    return acc


@triton.jit
def _block_scales(sw_ptr, rows, k0, stride_sn, stride_sk, FP8: tl.constexpr):
    """With FP8, the fp32 scales [BLOCK_N] of a weight tile's columns, weight rows `rows`, in the
    block column of K offset k0 (`common.fp8_block_scales`); without, sw_ptr itself (nothing loaded)."""
    scales = sw_ptr
    if FP8:  # one return after the branch: the compiler would type-check a return in each
        scales = fp8_block_scales(sw_ptr, rows, k0, stride_sn, stride_sk)
    return scales


@triton.jit
def _weight_product(a, b, scales, acc, NORM: tl.constexpr, FP8: tl.constexpr, dtype: tl.constexpr):
    """acc + a @ b for an `_input_slice` a and a `_weight_slice` b (`_dot_slice`); with FP8, b is
    an e4m3 tile inside one scale block: widened to dtype (x's, `widen_e4m3`) and its fp32 product scaled per
    column, acc + (a @ b) * scales."""
    if FP8:
        acc += _dot_slice(a, widen_e4m3(b, dtype), tl.zeros(acc.shape, dtype=tl.float32), NORM) * scales[None, :]
    else:
        acc = _dot_slice(a, b, acc, NORM)
    return acc


@triton.jit
def _gemv_slice(x_ptr, nw_ptr, w_ptr, sw_ptr, scale_rows, rm, rn, M, N, k_lo, k_hi, stride_xm, stride_wn, stride_sn,
                stride_sk, offset, NORM: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr = None):
    """(acc, ss): acc [BLOCK_M, BLOCK_N] fp32 = x'[rm, k_lo:k_hi] @ weight[rn, k_lo:k_hi]^T with x' = x,
    or with NORM x' = x * (norm weight + offset) in fp32 and ss [BLOCK_M] = sum of x^2 over the slice;
    BLOCK_K-deep steps, software-pipelined by Triton. With ROWS, weight rows past the tile's first
    ROWS are not read (`_weight_slice`): their columns of acc are zero. With FP8, each step's
    product is scaled by its block's scales (`_block_scales` of the weight rows `scale_rows`)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        b = _weight_slice(w_ptr, rn, N, k0, k_hi, stride_wn, BLOCK_K, ROWS)
        scales = _block_scales(sw_ptr, scale_rows, k0, stride_sn, stride_sk, FP8)
        a, s = _input_slice(x_ptr, nw_ptr, rm, M, k0, k_hi, stride_xm, offset, NORM, BLOCK_K)
        ss += s
        acc = _weight_product(a, b, scales, acc, NORM, FP8, x_ptr.dtype.element_ty)
    return acc, ss


@triton.jit
def _dot_widened(a, b, acc):
    """acc + a @ b for fp32 a and b of the weight dtype: a rounded to bf16 for bf16 weights (the
    same range as fp32), exact fp32 for fp32 weights, TF32 (b widened) for fp16."""
    if b.dtype == tl.float16:
        return tl.dot(a, b.to(tl.float32), acc, input_precision="tf32")
    return dot(a.to(b.dtype), b, acc)


@triton.jit
def _sum_slices(part_ptr, rm, cols, mask, stride_ps, stride_pm, SPLIT_K: tl.constexpr):
    """sum over s of part[s, rm, cols], in slice order (fp32); read through L2, where the other
    programs' stores are."""
    ptrs = part_ptr + rm[:, None] * stride_pm + cols[None, :]
    y = tl.load(ptrs, mask=mask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT_K):  # unrolled: the loads go out together, not one round trip each
        y += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0, cache_modifier=".cg")
    return y


@triton.jit
def _sum_row_slices(ss_ptr, rm, M, SPLIT_K: tl.constexpr):
    """sum over s of ss[s, rm] (the slices' sums of squares), in slice order."""
    ss = tl.zeros(rm.shape, dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        ss += tl.load(ss_ptr + s * M + rm, mask=rm < M, other=0.0, cache_modifier=".cg")
    return ss


@triton.jit
def _program_slice(K, K_PER_SPLIT, BLOCK_M: tl.constexpr):
    """(pid_s, pid_m, rm, k_lo, k_hi) of program (., s, m): its K slice [k_lo, k_hi) and its x rows
    rm, in int64 (x may be a strided view)."""
    pid_s = tl.program_id(1).to(tl.int64)
    pid_m = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    k_lo = pid_s * K_PER_SPLIT
    return pid_s, pid_m, rm, k_lo, min(k_lo + K_PER_SPLIT, K)


@triton.jit
def _head_values(part_ptr, b_ptr, rm, cols, mask, cols_ok, rstd, stride_ps, stride_pm, SPLIT_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, dtype: tl.constexpr):
    """The projection's output at columns `cols` as the unfused linear stores it (scaled by the
    input norm's rsqrt, bias added, rounded to the model dtype), in fp32; zero outside `mask`
    ([BLOCK_M, cols]) and `cols_ok` (the head's real dims, a mask over cols)."""
    y = _sum_slices(part_ptr, rm, cols, mask, stride_ps, stride_pm, SPLIT_K) * rstd[:, None]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=cols_ok, other=0.0).to(tl.float32)[None, :]
    return y.to(dtype).to(tl.float32)


@triton.jit
def _rotated_head(part_ptr, b_ptr, nw_ptr, rm, col0, pos, mask, rstd, stride_ps, stride_pm, eps, offset, log2_theta,
                  SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr,
                  D: tl.constexpr, ROT: tl.constexpr, dtype: tl.constexpr):
    """One head [BLOCK_M, head_block(D)] of q or k after the per-head RMSNorm (HAS_NORM) and RoPE on
    its first ROT dims, fp32, zero past D (`mask` covers the real dims); the math of
    csrc_free_ops/rope.py."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, head_block(D))
    d_ok = head_mask(d, D)
    pd = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))  # RoPE's partner dim (past D: d itself)
    y = _head_values(part_ptr, b_ptr, rm, col0 + d, mask, d_ok, rstd, stride_ps, stride_pm, SPLIT_K, HAS_BIAS,
                     dtype)
    yp = _head_values(part_ptr, b_ptr, rm, col0 + pd, mask, d_ok, rstd, stride_ps, stride_pm, SPLIT_K, HAS_BIAS,
                      dtype)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(y * y, axis=1) / D + eps)[:, None]
        y = y * rstd * (tl.load(nw_ptr + d, mask=d_ok, other=0.0).to(tl.float32) + offset)[None, :]
        yp = yp * rstd * (tl.load(nw_ptr + pd, mask=d_ok, other=0.0).to(tl.float32) + offset)[None, :]
    i = tl.where(d < HALF, d, d - HALF)
    inv_freq = tl.exp2(i.to(tl.float32) * (-2.0 / ROT) * log2_theta)
    cos, sin = rotary_cos_sin(pos[:, None] * inv_freq[None, :])
    sign = tl.where(d < HALF, -1.0, 1.0)[None, :]
    rotated = y * cos + sign * yp * sin
    return tl.where((d < ROT)[None, :], rotated, y)
