"""SwiGLU activation on the fused gate+up projection output.

    gate_up [..., 2I] -> silu(gate) * up [..., I],  gate = gate_up[..., :I], up = gate_up[..., I:]

fp32 math, stored in the input dtype. Grid: (rows, cdiv(I, BLOCK)).
"""
import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, stride_gu, stride_y, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + row * stride_gu + I + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter)
    y = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0] == 0 or inter == 0:
        return y
    y2 = y.view(-1, inter)
    grid = (gu.shape[0], triton.cdiv(inter, _BLOCK))
    _silu_mul_kernel[grid](gu, y2, gu.stride(0), y2.stride(0), inter, BLOCK=_BLOCK, num_warps=4)
    return y
