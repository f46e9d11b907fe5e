"""A generic strided Triton matmul and the linear backward built on it.

`mm(a, b, out)`: out[M, N] (+)= a[M, K] @ b[K, N] for any strides (transposes are just
strides), fp32 accumulation, stored in out's dtype; with `accumulate`, out (fp32) is read
and added to, which the fused linear + cross-entropy uses to sum dhidden over vocabulary slices.

Linear backward, y = x @ W^T + b with x [M, K], W [N, K], dy [M, N]:

    dx = dy @ W           [M, N] @ [N, K]
    dW = dy^T @ x         [N, M] @ [M, K]   (the M tokens are the reduction axis: fp32
                                             accumulation, split along M when N x K has few tiles)
    db = sum over rows of dy                (two-pass deterministic column sum)
"""
import torch
import triton
import triton.language as tl

from .norm_backward import column_sum, sum_partials
from .triton_helpers import INTERPRET, TARGET_PROGRAMS, dot, grouped_tile


@triton.jit
def tile_product(a_ptr, b_ptr, rm, rn, M, N, k_lo, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile a[rm, k_lo:k_hi] @ b[k_lo:k_hi, rn]. Rows/cols past M/N read a
    valid (wrapped) row: their values are garbage, for the caller to mask at the store."""
    rk = k_lo + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + (rn % N).to(tl.int64)[None, :] * stride_bn
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        a = tl.load(a_ptrs, mask=kk[None, :] < k_hi - k0, other=0.0)
        b = tl.load(b_ptrs, mask=kk[:, None] < k_hi - k0, other=0.0)
        acc = dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _mm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K, K_PER_SPLIT,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_cs,
    ACCUMULATE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """Tile (pid_m, pid_n) of c, over the K slice [pid_s * K_PER_SPLIT, ...) of program axis 1
    (one slice: the whole K). With several slices c is a [SPLIT, M, N] fp32 partial buffer."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_s.to(tl.int64) * K_PER_SPLIT
    acc = tile_product(a_ptr, b_ptr, rm, rn, M, N, k_lo, min(k_lo + K_PER_SPLIT, K),
                       stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K)
    c_ptrs = c_ptr + pid_s * stride_cs + rm.to(tl.int64)[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def gemm_blocks(m: int, n: int, k: int, itemsize: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Under the interpreter, tiles shrink to
    the problem (each tile element costs numpy time there)."""
    if INTERPRET:
        clamp = lambda v, hi: min(hi, max(16, triton.next_power_of_2(v)))  # noqa: E731
        return clamp(m, 64), clamp(n, 64), clamp(k, 32), 4, 1
    if itemsize == 4:
        return 64, 128, 32, 8, 2
    return 128, 128, 64, 8, 3


def split_k(m: int, n: int, k: int, bm: int, bn: int, bk: int) -> int:
    """K slices for a GEMM whose output has too few tiles to fill the GPU but a long K (dW over
    all tokens, dhidden against a 150K vocabulary): about two waves of programs, each slice at
    least 16 K-steps long. A function of the shape only (deterministic)."""
    if INTERPRET:
        return 1
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if tiles >= TARGET_PROGRAMS // 2:
        return 1
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), k // (16 * bk)))


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False, splits: int | None = None) -> torch.Tensor:
    """out[M, N] = a[M, K] @ b[K, N] (+ out if accumulate, out fp32). Any strides; a and b one dtype.

    A short, deep GEMM is split along K (`split_k`, or `splits`): each slice writes an fp32 partial
    [S, M, N] and norm_backward.sum_partials adds them in a fixed order (no atomics)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        if not accumulate:
            out.zero_()
        return out
    bm, bn, bk, warps, stages = gemm_blocks(m, n, k, a.element_size())
    if accumulate:
        stages = min(stages, 2)  # the fp32 output tile read at the end needs the registers
    s = splits if splits is not None else (1 if accumulate else split_k(m, n, k, bm, bn, bk))
    per = triton.cdiv(triton.cdiv(k, s), bk) * bk
    s = triton.cdiv(k, per)
    if s > 1 and (accumulate or not out.is_contiguous()):
        raise ValueError("split-K needs a contiguous output and no accumulate")
    target = out if s == 1 else torch.empty((s, m, n), dtype=torch.float32, device=out.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), s)
    _mm_kernel[grid](
        a, b, target, m, n, k, per, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        target.stride(-2), target.stride(-1), target.stride(0) if s > 1 else 0,
        ACCUMULATE=accumulate, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )
    if s > 1:
        sum_partials(target.view(s, m * n), out.dtype, out=out.view(m * n))
    return out


def linear_backward(dy, x, weight, need_dx: bool, need_dw: bool, need_db: bool):
    """dy [..., N], x [..., K], weight [N, K] -> (dx [..., K] or None, dW [N, K] or None, db [N] or None)."""
    n, k = weight.shape
    dy2 = dy.reshape(-1, n)
    x2 = x.reshape(-1, k)
    dx = dw = db = None
    if need_dx:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        mm(dy2, weight, dx.view(-1, k))
    if need_dw:
        dw = torch.empty((n, k), dtype=weight.dtype, device=weight.device)
        mm(dy2.t(), x2, dw)
    if need_db:
        db = column_sum(dy2, weight.dtype)
    return dx, dw, db
