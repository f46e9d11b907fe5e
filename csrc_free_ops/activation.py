"""SwiGLU activation: silu(gate) * up, fp32 math, stored in the input dtype.

    silu_mul(gate_up [..., 2I]) = silu(gate_up[..., :I]) * gate_up[..., I:]   (the fused gate+up projection)
    silu_mul_split(gate [..., I], up [..., I])                               (separate projections)

One kernel serves both: it reads gate and up through their own pointers and row strides,
so the fused layout passes the two halves as views. Grid: (cdiv(rows, BLOCK_R), cdiv(I, BLOCK)).
"""
import torch
import triton
import triton.language as tl

from .triton_helpers import INTERPRET

BLOCK = 1024
ROWS_PER_PROGRAM = 16 if INTERPRET else 1  # the interpreter pays per program, a GPU does not


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, ROWS, I,
                     BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    row = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < ROWS) & (cols < I)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(g2, u2, y2):
    rows, inter = g2.shape
    if rows == 0 or inter == 0:
        return
    _silu_mul_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(inter, BLOCK))](
        g2, u2, y2, g2.stride(0), u2.stride(0), y2.stride(0), rows, inter,
        BLOCK_R=ROWS_PER_PROGRAM, BLOCK=BLOCK, num_warps=4)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> [..., I] (contiguous, gate_up's dtype)."""
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter)
    y = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    _launch(gu[:, :inter], gu[:, inter:], y.view(-1, inter))
    return y


def silu_mul_split(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] (contiguous, gate's dtype)."""
    inter = gate.shape[-1]
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _launch(gate.reshape(-1, inter), up.reshape(-1, inter), y.view(-1, inter))
    return y
