"""RMSNorm and the fused residual add + RMSNorm, forward and backward.

    y = x * rsqrt(mean(x^2) + eps) * (weight + offset)

Forward: one program per row, the row held in registers; math in fp32, stored in the
input dtype. `offset=1.0` gives the zero-centred weight of Qwen3.5.

Backward, per row of N, with rstd = rsqrt(mean(x^2) + eps), w' = weight + offset,
xhat = x * rstd and g = dy * w':

    dx      = rstd * (g - xhat * mean(g * xhat))        (+ d_sum for add_rms_norm: the
                                                          residual stream's own gradient)
    dweight = sum over rows of dy * xhat

rstd is recomputed from x (one extra reduction over a row that is read anyway) instead of
being saved by the forward. dweight is reduced in two passes (`common.sum_partials`),
deterministic and free of atomics.
"""
import torch
import triton.language as tl

from .common import (cdiv, empty_contiguous_like, flat_rows, fp32, kernel, next_power_of_2, num_programs,
                     pdl_launch_dependents, pdl_options, pdl_wait, row_block, row_warps, sum_partials)


@kernel
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr,
    stride_x, stride_res, stride_y, stride_sum,
    N, eps, offset,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, USE_PDL: tl.constexpr,
):
    eps, offset = fp32(eps), fp32(offset)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    pdl_wait(USE_PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    if HAS_RESIDUAL:
        # The stored sum is rounded to the dtype; normalise exactly what the next layer reads.
        x_rounded = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x [..., N], weight [N] -> y [..., N] (contiguous, x.dtype)."""
    y = empty_contiguous_like(x)
    _launch(flat_rows(x), None, weight, flat_rows(y), None, eps, offset)
    return y


def add_rms_norm(x, residual, weight, eps: float, offset: float):
    """x, residual [..., N], weight [N] -> (rms_norm(x + residual), x + residual)."""
    y = empty_contiguous_like(x)
    s = empty_contiguous_like(x)
    _launch(flat_rows(x), flat_rows(residual), weight, flat_rows(y), flat_rows(s), eps, offset)
    return y, s


def _launch(x2, r2, weight, y2, s2, eps, offset):
    rows, n = x2.shape
    if rows == 0 or n == 0:
        return
    block = next_power_of_2(n)
    has_res = r2 is not None
    _rms_norm_kernel[(rows,)](
        x2, r2 if has_res else x2, weight, y2, s2 if has_res else x2,
        x2.stride(0), r2.stride(0) if has_res else 0, y2.stride(0), s2.stride(0) if has_res else 0,
        n, eps, offset,
        HAS_RESIDUAL=has_res, BLOCK_N=block, num_warps=row_warps(block), **pdl_options(x2),
    )


@kernel
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, dsum_ptr, dx_ptr, dw_part_ptr,
    stride_dy, stride_x, stride_dsum, stride_dx,
    ROWS, N, ROWS_PER_PROG, eps, offset,
    HAS_DSUM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Program p: rows [p * ROWS_PER_PROG, ...) in tiles of BLOCK_R rows; dweight partial -> row p."""
    eps, offset = fp32(eps), fp32(offset)
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


def rms_norm_backward(dy, x, weight, eps: float, offset: float, dsum=None):
    """dy, x [..., N] (dsum: the gradient reaching add_rms_norm's sum output, or None), weight [N]
    -> (dx [..., N] in x's dtype, dweight [N] in weight's dtype)."""
    n = x.shape[-1]
    x2, dy2 = flat_rows(x), flat_rows(dy)
    rows = x2.shape[0]
    dx = empty_contiguous_like(x)
    if rows == 0 or n == 0:
        return dx, torch.zeros_like(weight)
    dx2 = dx.view(-1, n)
    ds2 = flat_rows(dsum) if dsum is not None else None
    p = num_programs(rows)
    per = cdiv(rows, p)
    p = cdiv(rows, per)
    partial = torch.empty((p, n), dtype=torch.float32, device=x.device)
    block = next_power_of_2(n)
    _rms_norm_bwd_kernel[(p,)](
        dy2, x2, weight, ds2 if ds2 is not None else dy2, dx2, partial,
        dy2.stride(0), x2.stride(0), ds2.stride(0) if ds2 is not None else 0, dx2.stride(0),
        rows, n, per, eps, offset,
        HAS_DSUM=ds2 is not None, BLOCK_R=min(row_block(block), next_power_of_2(per)), BLOCK_N=block,
        num_warps=row_warps(block),
    )
    return dx, sum_partials(partial, weight.dtype)
