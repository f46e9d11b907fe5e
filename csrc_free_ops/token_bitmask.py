"""The token bitmask of constrained sampling applied to logits: bit ``v % 32`` of word ``v // 32``
of a row's mask says whether token v may be sampled (xgrammar's layout, int32 words); a token
whose bit is 0 gets -inf.

    apply_token_bitmask(logits [S, V], bitmask [S, W >= cdiv(V, 32)] int32) -> [S, V]

A row of all-ones words comes out as it went in. Grid: (S, cdiv(V, BLOCK)); no host sync and
no value-dependent branch, so it runs inside a captured CUDA graph.
"""
import torch
import triton.language as tl

from .common import cdiv, kernel

BLOCK = 1024


@kernel
def _apply_token_bitmask_kernel(x_ptr, m_ptr, y_ptr, stride_x, stride_m, stride_y, V, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    words = tl.load(m_ptr + row * stride_m + cols // 32, mask=inside, other=0)
    allowed = ((words >> (cols % 32)) & 1) != 0
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0)
    tl.store(y_ptr + row * stride_y + cols, tl.where(allowed, x, float("-inf")), mask=inside)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [S, V] (last dim contiguous), bitmask [S, W] int32 -> masked logits [S, V]
    (contiguous, logits' dtype)."""
    rows, vocab = logits.shape
    y = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device)
    if rows == 0 or vocab == 0:
        return y
    _apply_token_bitmask_kernel[(rows, cdiv(vocab, BLOCK))](
        logits, bitmask, y, logits.stride(0), bitmask.stride(0), y.stride(0), vocab, BLOCK=BLOCK, num_warps=4)
    return y
