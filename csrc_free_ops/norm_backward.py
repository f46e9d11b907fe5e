"""Backward of RMSNorm (and of the fused residual add + RMSNorm), plus the deterministic
column-sum used by every weight/bias gradient in the training kernels.

Forward (csrc_free_ops/norm.py), per row of N:  y = x * rstd * w',  rstd = rsqrt(mean(x^2) + eps),
w' = weight + offset.  With xhat = x * rstd and g = dy * w':

    dx      = rstd * (g - xhat * mean(g * xhat))        (+ d_sum for add_rms_norm: the
                                                          residual stream's own gradient)
    dweight = sum over rows of dy * xhat

rstd is recomputed from x (one extra reduction over a row that is read anyway) instead of
being saved by the forward, so the forward kernels stay untouched.

dweight is reduced in two passes, deterministic and free of atomics: each of P programs
walks a fixed, contiguous range of rows and writes its fp32 partial sum to row p of a
[P, N] buffer; `sum_partials` then adds the P rows in a fixed order. P depends only on the
shape, so results are bitwise reproducible run to run.
"""
import torch
import triton
import triton.language as tl

from .triton_helpers import INTERPRET, row_warps

MAX_PROGRAMS = 4 if INTERPRET else 512
"""Programs of a row-reduction kernel (partial-sum rows); the interpreter runs them one by one."""


def num_programs(rows: int) -> int:
    return max(1, min(rows, MAX_PROGRAMS))


@triton.jit
def _sum_partials_kernel(part_ptr, out_ptr, P, N, stride_p, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[n] = sum_p part[p, n], in a fixed order (fp32), stored in out's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        m = ((p0 + rows)[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(part_ptr + (p0 + rows)[:, None].to(tl.int64) * stride_p + cols[None, :], mask=m, other=0.0)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """partial [P, N] fp32 -> [N] in `dtype` (into `out`, contiguous, if given): the second,
    fixed-order pass of a column sum."""
    p, n = partial.shape
    if out is None:
        out = torch.empty(n, dtype=dtype, device=partial.device)
    if n == 0:
        return out
    block_n = min(1024 if INTERPRET else 256, triton.next_power_of_2(n))
    _sum_partials_kernel[(triton.cdiv(n, block_n),)](partial, out, p, n, partial.stride(0),
                                                       BLOCK_P=16, BLOCK_N=block_n, num_warps=4)
    return out


@triton.jit
def _column_sum_kernel(x_ptr, part_ptr, ROWS, N, ROWS_PER_PROG, stride_x, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """part[p, n] = sum of x[r, n] over program p's rows (fp32); grid (P, cdiv(N, BLOCK_N))."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    lo = pid * ROWS_PER_PROG
    hi = min(lo + ROWS_PER_PROG, ROWS)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        r = r0 + rr
        m = (r[:, None] < hi) & (cols[None, :] < N)
        acc += tl.load(x_ptr + r[:, None].to(tl.int64) * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(part_ptr + pid * N + cols, tl.sum(acc, axis=0), mask=cols < N)


def column_sum(x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x2 [R, N] (last dim contiguous) -> sum over rows [N] in `dtype`, deterministic (two passes)."""
    rows, n = x2.shape
    if rows == 0:
        return torch.zeros(n, dtype=dtype, device=x2.device)
    p = num_programs(triton.cdiv(rows, 16))
    per = triton.cdiv(rows, p)
    p = triton.cdiv(rows, per)
    partial = torch.empty((p, n), dtype=torch.float32, device=x2.device)
    block_n = min(128, triton.next_power_of_2(n))
    _column_sum_kernel[(p, triton.cdiv(n, block_n))](x2, partial, rows, n, per, x2.stride(0),
                                                      BLOCK_R=16, BLOCK_N=block_n, num_warps=4)
    return sum_partials(partial, dtype)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, dsum_ptr, dx_ptr, dw_part_ptr,
    stride_dy, stride_x, stride_dsum, stride_dx,
    ROWS, N, ROWS_PER_PROG, eps, offset,
    HAS_DSUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program p: rows [p * ROWS_PER_PROG, ...) in tiles of BLOCK_R rows; dweight partial -> row p."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    col_ok = cols < N
    w = (tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32) + offset)[None, :]
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    lo = pid.to(tl.int64) * ROWS_PER_PROG  # int64 row offsets
    hi = min(lo + ROWS_PER_PROG, ROWS)
    for r0 in range(lo, hi, BLOCK_R):
        r = r0 + rr
        m = (r < hi)[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + r[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)[:, None]
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=1) / N)[:, None])
        if HAS_DSUM:
            dx += tl.load(dsum_ptr + r[:, None] * stride_dsum + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(dx_ptr + r[:, None] * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=m)
        dw_acc += tl.sum(dy * xhat, axis=0)
    tl.store(dw_part_ptr + pid * N + cols, dw_acc, mask=col_ok)


def row_block(block_n: int) -> int:
    """Rows per tile of a row-reduction kernel: about 4K elements (16K under the interpreter, where
    wide tiles are cheap and each operation has a fixed cost)."""
    return max(1, (16384 if INTERPRET else 4096) // block_n)


def rms_norm_backward(dy, x, weight, eps: float, offset: float, dsum=None):
    """dy, x [..., N] (dsum: the gradient reaching add_rms_norm's sum output, or None), weight [N]
    -> (dx [..., N] in x's dtype, dweight [N] in weight's dtype)."""
    n = x.shape[-1]
    x2, dy2 = x.reshape(-1, n), dy.reshape(-1, n)
    rows = x2.shape[0]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0:
        return dx, torch.zeros_like(weight)
    dx2 = dx.view(-1, n)
    ds2 = dsum.reshape(-1, n) if dsum is not None else None
    p = num_programs(rows)
    per = triton.cdiv(rows, p)
    p = triton.cdiv(rows, per)
    partial = torch.empty((p, n), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_bwd_kernel[(p,)](
        dy2, x2, weight, ds2 if ds2 is not None else dy2, dx2, partial,
        dy2.stride(0), x2.stride(0), ds2.stride(0) if ds2 is not None else 0, dx2.stride(0),
        rows, n, per, eps, offset,
        HAS_DSUM=ds2 is not None, BLOCK_R=min(row_block(block), triton.next_power_of_2(per)), BLOCK_N=block,
        num_warps=row_warps(block),
    )
    return dx, sum_partials(partial, weight.dtype)
