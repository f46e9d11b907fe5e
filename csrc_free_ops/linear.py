"""Linear: y = x @ weight.T (+ bias), forward (a split-K path for decode, the shared tiled GEMM
for prefill) and backward.

x [M, K], weight [N, K] (the nn.Linear layout), bias [N] -> y [M, N] in x's dtype,
fp32 accumulation, bias added in fp32.

Prefill (M > DECODE_MAX_M): `common.mm` with one program per BLOCK_M x BLOCK_N tile of y,
tiles visited in GROUP_M-row groups so neighbouring programs share weight tiles in L2.

Decode (M <= DECODE_MAX_M): reading the weight once is the whole cost, and with
N = 1024 a tile per program leaves most of the GPU idle. The K axis is cut into
SPLIT_K slices; program (n, s) writes the fp32 partial product of slice s to a
[SPLIT_K, M, N] buffer and a second kernel sums the slices in a fixed order and
adds the bias (deterministic: no atomics). SPLIT_K = 1 writes y directly.
The per-shape configs come from `bench/ops.py --sweep-splitk` on an H200 and are
kept in DECODE_CONFIGS; nothing is tuned at call time (safe in CUDA graph capture).

Backward, with dy [M, N]:

    dx = dy @ W           [M, N] @ [N, K]
    dW = dy^T @ x         [N, M] @ [M, K]   (the M tokens are the reduction axis: fp32
                                             accumulation, split along M when N x K has few tiles)
    db = sum over rows of dy                (two-pass deterministic column sum)
"""
from typing import NamedTuple

import torch
import triton.language as tl

from .common import TARGET_PROGRAMS, cdiv, column_sum, dot, flat_rows, kernel, mm, next_power_of_2

DECODE_MAX_M = 16


class DecodeConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


# (N, K) -> config: the fastest of `python -m bench.ops --sweep-splitk` on an H200, 2026-11-29
# (bench/results/). Split-K pays where N is small and K long (o_proj, down); shapes with
# enough N tiles run unsplit. Shapes not listed use decode_config's rule.
DECODE_CONFIGS: dict[tuple[int, int], DecodeConfig] = {
    (896, 1024): DecodeConfig(32, 256, 1),     # seed o_proj
    (896, 4864): DecodeConfig(32, 128, 8),     # seed down
    (1024, 2048): DecodeConfig(32, 128, 4),    # Qwen3-0.6B o_proj
    (1024, 3072): DecodeConfig(32, 128, 4),    # Qwen3-0.6B down
    (1536, 896): DecodeConfig(32, 128, 1),     # seed qkv
    (4096, 1024): DecodeConfig(32, 128, 1),    # Qwen3-0.6B qkv
    (6144, 1024): DecodeConfig(64, 256, 1),    # Qwen3-0.6B gate_up
    (9728, 896): DecodeConfig(32, 128, 1),     # seed gate_up
    (151936, 896): DecodeConfig(64, 128, 1),   # lm_head, hidden 896
    (151936, 1024): DecodeConfig(64, 128, 1),  # lm_head, hidden 1024
}


def decode_config(n: int, k: int) -> DecodeConfig:
    """The stored config for (N, K), else: 64-wide N tiles, 128-deep K steps, and
    enough K slices for about two programs per SM."""
    if (n, k) in DECODE_CONFIGS:
        return DECODE_CONFIGS[(n, k)]
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(128, max(16, next_power_of_2(k)))
    tiles, k_blocks = cdiv(n, block_n), cdiv(k, block_k)
    return DecodeConfig(block_n, block_k, min(k_blocks, max(1, cdiv(TARGET_PROGRAMS, tiles))))


@kernel
def _splitk_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn, stride_om, stride_os,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k_lo = pid_s * K_PER_SPLIT
    k_hi = min(k_lo + K_PER_SPLIT, K)
    x_ptrs = x_ptr + rm[:, None] * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + (rn % N).to(tl.int64)[None, :] * stride_wn + (k_lo + rk)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk < k_hi - k0
        a = tl.load(x_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = dot(a, b, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_ptrs = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


@kernel
def _splitk_reduce_kernel(
    part_ptr, b_ptr, y_ptr, N, stride_ps, stride_pm, stride_ym,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def prefill_blocks(m: int, n: int, itemsize: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for the forward GEMM: the largest tile
    that still gives about a wave of programs (256-token prefills of N=1024 would leave most SMs
    idle with 128x128 tiles). fp32 tiles are twice the bytes: half as deep and fewer stages, to
    fit shared memory."""
    if itemsize == 4:
        return (64 if m <= 64 else 128), 128, 32, 8, 2
    for bm, bn, warps, stages in ((128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 4)):
        if cdiv(m, bm) * cdiv(n, bn) >= TARGET_PROGRAMS // 2:
            break
    return bm, bn, 64, warps, stages


def splitk_matmul(x2: torch.Tensor, weight: torch.Tensor, bias, y2: torch.Tensor, cfg: DecodeConfig) -> None:
    """Decode GEMM into y2 (M <= DECODE_MAX_M) with cfg's K split and a separate reduce."""
    m, k = x2.shape
    n = weight.shape[0]
    k_per_split = cdiv(cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = cdiv(k, k_per_split)
    has_bias = bias is not None
    out = y2 if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    _splitk_kernel[(cdiv(n, cfg.block_n), split)](
        x2, weight, bias if has_bias else weight, out, m, n, k, k_per_split,
        x2.stride(0), weight.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
        SPLIT_K=split, HAS_BIAS=has_bias,
        BLOCK_M=DECODE_MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages if x2.element_size() == 2 else 2,
    )
    if split > 1:
        block = 1024
        _splitk_reduce_kernel[(m, cdiv(n, block))](
            out, bias if has_bias else out, y2, n, out.stride(0), out.stride(1), y2.stride(0),
            SPLIT_K=split, HAS_BIAS=has_bias, BLOCK=block, num_warps=4,
        )


def linear(x: torch.Tensor, weight: torch.Tensor, bias, decode_cfg: DecodeConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) -> [..., N]. decode_cfg overrides the table (benchmarks)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return y
    y2 = y.view(m, n)
    if m <= DECODE_MAX_M:
        splitk_matmul(x2, weight, bias, y2, decode_cfg or decode_config(n, k))
    else:
        mm(x2, weight.t(), y2, splits=1, bias=bias, blocks=prefill_blocks(m, n, x2.element_size()))
    return y


def linear_backward(dy, x, weight, need_dx: bool, need_dw: bool, need_db: bool):
    """dy [..., N], x [..., K], weight [N, K] -> (dx [..., K] or None, dW [N, K] or None, db [N] or None)."""
    n, k = weight.shape
    dy2 = flat_rows(dy)  # N or K may be 0
    x2 = flat_rows(x)
    dx = dw = db = None
    if need_dx:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        mm(dy2, weight, flat_rows(dx))
    if need_dw:
        dw = torch.empty((n, k), dtype=weight.dtype, device=weight.device)
        mm(dy2.t(), x2, dw)
    if need_db:
        db = column_sum(dy2, weight.dtype)
    return dx, dw, db
