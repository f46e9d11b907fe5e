"""SwiGLU activation, forward and backward: silu(gate) * up, fp32 math, stored in the input dtype.

    silu_mul(gate_up [..., 2I]) = silu(gate_up[..., :I]) * gate_up[..., I:]   (the fused gate+up projection)
    silu_mul_split(gate [..., I], up [..., I])                               (separate projections)

Backward, y = silu(g) * u, s = sigmoid(g), silu(g) = g * s:

    dg = dy * u * s * (1 + g * (1 - s)),   du = dy * silu(g)

Every kernel reads gate and up through their own pointers and row strides, so the fused
layout passes the two halves as views and the split layout (transformers' gate_proj and
up_proj) shares the code. Grid: (cdiv(rows, BLOCK_R), cdiv(I, BLOCK)).
"""
import torch
import triton
import triton.language as tl

from .common import INTERPRET

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


@triton.jit
def _silu_mul_bwd_kernel(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr,
                         stride_dy, stride_g, stride_u, stride_dg, stride_du, ROWS, I,
                         BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    row = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < ROWS) & (cols < I)
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    du = dy * g * s
    tl.store(dg_ptr + row * stride_dg + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_du + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def _launch_bwd(dy2, g2, u2, dg2, du2):
    rows, inter = g2.shape
    if rows == 0 or inter == 0:
        return
    _silu_mul_bwd_kernel[(triton.cdiv(rows, ROWS_PER_PROGRAM), triton.cdiv(inter, BLOCK))](
        dy2, g2, u2, dg2, du2, dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0),
        rows, inter, BLOCK_R=ROWS_PER_PROGRAM, BLOCK=BLOCK, num_warps=4)


def silu_mul_backward(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """dy [..., I], gate_up [..., 2I] -> d gate_up [..., 2I] (contiguous, gate_up's dtype)."""
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter)
    dgu = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    d2 = dgu.view(-1, 2 * inter)
    _launch_bwd(dy.reshape(-1, inter), gu[:, :inter], gu[:, inter:], d2[:, :inter], d2[:, inter:])
    return dgu


def silu_mul_split_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """dy, gate, up [..., I] -> (d gate, d up), contiguous, gate's dtype."""
    inter = gate.shape[-1]
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _launch_bwd(dy.reshape(-1, inter), gate.reshape(-1, inter), up.reshape(-1, inter),
                dg.view(-1, inter), du.view(-1, inter))
    return dg, du
