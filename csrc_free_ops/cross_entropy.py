"""Fused lm_head + cross-entropy: mean_i CE(hidden_i @ weight^T, target_i) without the [N, V] logits.

hidden [N, H], weight [V, H], targets [N] (int64/int32; `ignore_index` rows count for nothing).
The N tokens are cut into chunks of C rows, C chosen so a chunk's logits stay under a fixed
byte budget. Per chunk (like Liger-Kernel's FusedLinearCrossEntropy):

    logits = h_c @ W^T                [C, V] fp32 (Triton GEMM, csrc_free_ops/linear_backward.mm)
    CE kernel, one program per row:   online max / sum-exp over V in blocks -> lse,
                                      loss_i = lse - logit[target]  (0 for ignored rows),
                                      and, when gradients are wanted, in a second sweep
                                      g = (softmax - onehot(target)) / n_valid  [C, V] in h's dtype
    dh_c  = g @ W                     [C, H]
    dW   += g^T @ h_c                 [V, H] fp32 accumulator, summed over chunks in order

so the gradient is finished in the forward and the backward only scales it by the incoming
gradient of the loss. n_valid = count(targets != ignore_index) stays on the device: the
kernel reads 1/max(n_valid, 1) through a pointer and loss = sum(loss_i) / n_valid is a
device division (NaN when every target is ignored, as torch's mean cross-entropy): no host sync.
"""
import torch
import triton
import triton.language as tl

from .linear_backward import mm
from .triton_helpers import INTERPRET

CHUNK_BYTES = 1 << 30
"""Byte budget of one chunk's logits (fp32) + gradient buffers: 1 GiB (1024 tokens of a 152K
vocabulary in bf16). Fewer, larger chunks mean fewer read-modify-write passes over the fp32
dweight accumulator; dhidden's GEMM (a short M, a K of the whole vocabulary) is split along K."""


@triton.jit
def _ce_rows_kernel(
    logits_ptr, grad_ptr, targets_ptr, loss_ptr, inv_count_ptr,
    stride_l, stride_g, ROWS, V, ignore_index,
    COMPUTE_GRAD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """BLOCK_R rows per program (1 on a GPU, more under the interpreter), V in BLOCK_V column tiles."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    cols = tl.arange(0, BLOCK_V)
    t = tl.load(targets_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    valid = (t != ignore_index) & (t >= 0) & (t < V) & row_ok
    base = logits_ptr + rows[:, None] * stride_l
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        c = v0 + cols[None, :]
        x = tl.load(base + c, mask=row_ok[:, None] & (c < V), other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the end see only -inf
        l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
    lse = tl.where(row_ok, m + tl.log(tl.where(row_ok, l, 1.0)), 0.0)
    x_t = tl.load(logits_ptr + rows * stride_l + tl.where(valid, t, 0), mask=row_ok, other=0.0).to(tl.float32)
    tl.store(loss_ptr + rows, tl.where(valid, lse - x_t, 0.0), mask=row_ok)
    if COMPUTE_GRAD:
        scale = tl.where(valid, tl.load(inv_count_ptr), 0.0)[:, None]
        gbase = grad_ptr + rows[:, None] * stride_g
        for v0 in range(0, V, BLOCK_V):
            c = v0 + cols[None, :]
            mask = row_ok[:, None] & (c < V)
            x = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
            g = tl.exp(x - lse[:, None]) * scale - tl.where(c == t[:, None], scale, 0.0)
            tl.store(gbase + c, g.to(grad_ptr.dtype.element_ty), mask=mask)


def chunk_rows(n: int, v: int, itemsize: int) -> int:
    """Tokens per chunk: the most (a power of two, at least 16) whose logits + gradient fit CHUNK_BYTES."""
    per_row = v * (4 + itemsize)
    c = max(16, triton.next_power_of_2(max(1, CHUNK_BYTES // per_row)) // 2)
    return min(c, max(n, 1))


def linear_cross_entropy(hidden, weight, targets, ignore_index: int, compute_grad: bool, chunk: int | None = None):
    """-> (loss fp32 [], dhidden [N, H] or None, dweight [V, H] or None); the gradients are those of the mean loss."""
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    targets = targets.contiguous()  # the kernel reads row r at offset r
    count = (targets != ignore_index).sum()
    inv_count = 1.0 / count.clamp_min(1).to(torch.float32)
    losses = torch.empty(n, dtype=torch.float32, device=dev)
    dh = torch.empty((n, h), dtype=hidden.dtype, device=dev) if compute_grad else None
    dw_acc = torch.zeros((v, h), dtype=torch.float32, device=dev) if compute_grad else None
    c = chunk or chunk_rows(n, v, hidden.element_size())
    c = min(c, max(n, 1))
    logits = torch.empty((c, v), dtype=torch.float32, device=dev)
    grad = torch.empty((c, v), dtype=hidden.dtype, device=dev) if compute_grad else logits
    block_v = min(triton.next_power_of_2(v), 1024 if INTERPRET else 4096)
    block_r = max(1, 4096 // block_v) if INTERPRET else 1
    wt = weight.t()
    for c0 in range(0, n, c):
        rows = min(c, n - c0)
        h_c = hidden[c0:c0 + rows]
        lg = logits[:rows]
        mm(h_c, wt, lg)
        _ce_rows_kernel[(triton.cdiv(rows, block_r),)](
            lg, grad, targets[c0:c0 + rows], losses[c0:c0 + rows], inv_count,
            lg.stride(0), grad.stride(0), rows, v, ignore_index,
            COMPUTE_GRAD=compute_grad, BLOCK_R=block_r, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
        )
        if compute_grad:
            g = grad[:rows]
            mm(g, weight, dh[c0:c0 + rows])
            mm(g.t(), h_c, dw_acc, accumulate=True)
    loss = losses.sum() / count.to(torch.float32)
    dw = None
    if compute_grad:
        dw = dw_acc if weight.dtype == torch.float32 else dw_acc.to(weight.dtype)
    return loss, dh, dw
