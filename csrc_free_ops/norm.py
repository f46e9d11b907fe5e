"""RMSNorm and the fused residual add + RMSNorm.

    y = x * rsqrt(mean(x^2) + eps) * (weight + offset)

One program per row, the row held in registers; math in fp32, stored in the
input dtype. `offset=1.0` gives the zero-centred weight of Qwen3.5.
"""
import torch
import triton
import triton.language as tl

from .triton_helpers import row_warps


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, y_ptr, sum_ptr,
    stride_x, stride_res, stride_y, stride_sum,
    N, eps, offset,
    HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # The stored sum is rounded to the dtype; normalise exactly what the next layer reads.
        x_rounded = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x_rounded, mask=mask)
        x = x_rounded.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32) + offset
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float) -> torch.Tensor:
    """x [..., N], weight [N] -> y [..., N] (contiguous, x.dtype)."""
    x2 = _rows(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, x.shape[-1])
    _launch(x2, None, weight, y2, None, eps, offset)
    return y


def add_rms_norm(x, residual, weight, eps: float, offset: float):
    """x, residual [..., N], weight [N] -> (rms_norm(x + residual), x + residual)."""
    x2, r2 = _rows(x), _rows(residual)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x2, r2, weight, y.view(-1, x.shape[-1]), s.view(-1, x.shape[-1]), eps, offset)
    return y, s


def _launch(x2, r2, weight, y2, s2, eps, offset):
    rows, n = x2.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    has_res = r2 is not None
    _rms_norm_kernel[(rows,)](
        x2, r2 if has_res else x2, weight, y2, s2 if has_res else y2,
        x2.stride(0), r2.stride(0) if has_res else 0, y2.stride(0), s2.stride(0) if has_res else 0,
        n, eps, offset,
        HAS_RESIDUAL=has_res, BLOCK_N=block, num_warps=row_warps(block),
    )
