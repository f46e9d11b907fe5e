"""SwiGLU activation, forward and backward: silu(gate) * up, fp32 math, stored in the input dtype.

    silu_mul(gate_up [..., 2I]) = silu(gate_up[..., :I]) * gate_up[..., I:]   (the fused gate+up projection)
    silu_mul_split(gate [..., I], up [..., I])                               (separate projections)

Backward, y = silu(g) * u, s = sigmoid(g), silu(g) = g * s:

    dg = dy * u * s * (1 + g * (1 - s)),   du = dy * silu(g)

Every kernel reads gate and up through their own pointers and row strides, so the split layout
(transformers' gate_proj and up_proj) shares the code. The forward reads up `up_col` columns into
its rows: the fused layout passes gate_up as both with up_col = I (no views to make on the host,
which costs microseconds a call). The backward writes d gate and d up, which must be two tensors
for torch.compile's functionalization of the kernel's stores: the fused layout passes views of
the two halves. Grid: (cdiv(rows, BLOCK_R), cdiv(I, BLOCK)).
"""
import torch
import triton.language as tl

from .common import (INTERPRET, cdiv, empty_contiguous_like, flat_rows, kernel, next_power_of_2, pdl_launch_dependents,
                     pdl_options, pdl_wait)

BLOCK = 1024
ROWS_PER_PROGRAM = 16 if INTERPRET else 1  # the interpreter pays per program, a GPU does not


@kernel
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, stride_g, stride_u, stride_y, ROWS, I, up_col,
                     BLOCK_R: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    row = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (row < ROWS) & (cols < I)
    pdl_wait(USE_PDL)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + up_col + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    tl.store(y_ptr + row * stride_y + cols, (g * tl.sigmoid(g) * u).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(g2, u2, y2, up_col: int):
    rows, inter = y2.shape
    if rows == 0 or inter == 0:
        return
    _silu_mul_kernel[(cdiv(rows, ROWS_PER_PROGRAM), cdiv(inter, BLOCK))](
        g2, u2, y2, g2.stride(0), u2.stride(0), y2.stride(0), rows, inter, up_col,
        BLOCK_R=ROWS_PER_PROGRAM, BLOCK=BLOCK, num_warps=4, **pdl_options(y2))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> [..., I] (contiguous, gate_up's dtype)."""
    inter = gate_up.shape[-1] // 2
    gu = flat_rows(gate_up)
    y = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    _launch(gu, gu, flat_rows(y), inter)
    return y


def silu_mul_split(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> silu(gate) * up [..., I] (contiguous, gate's dtype)."""
    y = empty_contiguous_like(gate)
    _launch(flat_rows(gate), flat_rows(up), flat_rows(y), 0)
    return y


@kernel
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
    _silu_mul_bwd_kernel[(cdiv(rows, ROWS_PER_PROGRAM), cdiv(inter, BLOCK))](
        dy2, g2, u2, dg2, du2, dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0),
        rows, inter, BLOCK_R=ROWS_PER_PROGRAM, BLOCK=BLOCK, num_warps=4)


def silu_mul_backward(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """dy [..., I], gate_up [..., 2I] -> d gate_up [..., 2I] (contiguous, gate_up's dtype)."""
    inter = gate_up.shape[-1] // 2
    gu = flat_rows(gate_up)
    dgu = empty_contiguous_like(gate_up)
    d2 = flat_rows(dgu)
    _launch_bwd(flat_rows(dy), gu[:, :inter], gu[:, inter:], d2[:, :inter], d2[:, inter:])
    return dgu


def silu_mul_split_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor):
    """dy, gate, up [..., I] -> (d gate, d up), contiguous, gate's dtype."""
    dg = empty_contiguous_like(gate)
    du = empty_contiguous_like(gate)
    _launch_bwd(flat_rows(dy), flat_rows(gate), flat_rows(up), flat_rows(dg), flat_rows(du))
    return dg, du


# ----------------------------------------------------------------------------- output gate (Qwen3.5)
#
#   sigmoid_mul(x [..., H, N], gate [..., H, N]) = x * sigmoid(gate)       (gated attention's output gate)
#
# sigmoid_mul reads x and gate through two strides each (rows, heads), so the gate can be a view
# of the fused q projection (per head [query | gate]) without a copy.


@kernel
def _sigmoid_mul_kernel(x_ptr, g_ptr, y_ptr, stride_xr, stride_xh, stride_gr, stride_gh, ROWS, H, N,
                        BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    r = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]  # over R * H
    cols = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    mask = (r < ROWS) & (cols < N)
    outer, inner = r // H, r % H
    x = tl.load(x_ptr + outer * stride_xr + inner * stride_xh + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + outer * stride_gr + inner * stride_gh + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + r * N + cols, (x * tl.sigmoid(g)).to(y_ptr.dtype.element_ty), mask=mask)


def _rows3(t: torch.Tensor) -> torch.Tensor:
    """[..., H, N] -> [R, H, N] (a view when the leading dims flatten to one stride); [N] -> [1, 1, N]."""
    if t.dim() == 1:
        return t.view(1, 1, t.shape[0])
    lead = 1
    for s in t.shape[:-2]:
        lead *= s
    return t.reshape(lead, t.shape[-2], t.shape[-1])


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [..., N] (one shape; last dim contiguous, other strides free) -> x * sigmoid(gate)
    [..., N] (contiguous, x's dtype), fp32 math."""
    y = empty_contiguous_like(x)
    if y.numel() == 0:
        return y
    x3, g3 = _rows3(x), _rows3(gate)
    _, h, n = x3.shape
    rows = x3.shape[0] * h
    block = min(1024, next_power_of_2(n))
    block_r = min(next_power_of_2(rows), max(1, (16384 if INTERPRET else 2048) // block))
    _sigmoid_mul_kernel[(cdiv(rows, block_r), cdiv(n, block))](
        x3, g3, y, x3.stride(0), x3.stride(1), g3.stride(0), g3.stride(1), rows, h, n,
        BLOCK_R=block_r, BLOCK=block, num_warps=4)
    return y
