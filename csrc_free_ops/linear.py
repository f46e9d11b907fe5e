"""Linear: y = x @ weight.T (+ bias), forward (a split-K path for decode, the shared tiled GEMM
for prefill) and backward.

x [M, K], weight [N, K] (the nn.Linear layout), bias [N] -> y [M, N] in x's dtype,
fp32 accumulation, bias added in fp32.

Prefill (M > DECODE_MAX_M), 16-bit operands on Hopper: `tma_matmul`, a persistent GEMM whose
operand tiles arrive through TMA tensor descriptors (hardware address generation and bounds: a
tile past M, N or K reads zeros and stores nothing, so the main loop has no masks). PROGRAMS
programs (at most one per SM) walk the list of BLOCK_M x BLOCK_N output tiles, GROUP_M-row groups
at a time so neighbouring programs share weight tiles in L2. Where the output has too few tiles
to fill the GPU (256 tokens against N = 1024), narrow 64 x 32 tiles walking K 256 deep make a wave
of programs, or the K axis is split as at decode (the sweep picks per shape). The configs come
from `bench/ops.py --sweep-prefill` on the GPU they serve, in its table linear_prefill
(`devices`). Other inputs (fp32, pre-Hopper GPUs, strides TMA cannot describe) take `common.mm`,
the shared tiled GEMM.

Decode (M <= DECODE_MAX_M): reading the weight once is the whole cost, and with
N = 1024 a tile per program leaves most of the GPU idle. The K axis is cut into
SPLIT_K slices; program (n, s) writes the fp32 partial product of slice s to a
[SPLIT_K, M, N] buffer and a second kernel sums the slices in a fixed order and
adds the bias (deterministic: no atomics). SPLIT_K = 1 writes y directly.
The per-shape configs come from `bench/ops.py --sweep-splitk` on the GPU they serve, in its table
linear_decode (`devices`); nothing is tuned at call time (safe in CUDA graph capture).

Backward, with dy [M, N]:

    dx = dy @ W           [M, N] @ [N, K]
    dW = dy^T @ x         [N, M] @ [M, K]   (the M tokens are the reduction axis: fp32
                                             accumulation, split along M when N x K has few tiles)
    db = sum over rows of dy                (two-pass deterministic column sum)
"""
from typing import NamedTuple

import torch
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import (DECODE_MAX_M, INTERPRET, DecodeConfig, cdiv, column_sum, cuda_properties, dot,
                    empty_contiguous_like, flat_rows, grouped_tile, is_traced, kernel, linear_rows, mm,
                    next_power_of_2, pdl_launch_dependents, pdl_options, pdl_wait, reduce_slices,
                    set_allocator_unless_set, shared_memory_per_block, target_programs, tuned)

def decode_config(n: int, k: int, device: torch.device, dtype: torch.dtype) -> DecodeConfig:
    """The device's stored config for (N, K) (the table linear_decode), else: 64-wide N tiles,
    128-deep K steps, and enough K slices for `target_programs`."""
    stored = tuned("linear_decode", device, dtype, (n, k))
    if stored is not None:
        return DecodeConfig(*stored)
    block_n = min(64, max(16, next_power_of_2(n)))
    block_k = min(128, max(16, next_power_of_2(k)))
    tiles, k_blocks = cdiv(n, block_n), cdiv(k, block_k)
    return DecodeConfig(block_n, block_k, min(k_blocks, max(1, cdiv(target_programs(device), tiles))))


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


class PrefillConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    split_k: int = 1


PREFILL_M_CLASSES = (32, 64, 128, 256, 512, 1024, 2048)
"""The token counts the prefill configs were swept at; M takes the config of the smallest class
>= M (the largest past 2048) that lists its (N, K)."""


def prefill_m_class(m: int) -> int:
    """The PREFILL_M_CLASSES entry whose configs serve M rows."""
    return next((c for c in PREFILL_M_CLASSES if m <= c), PREFILL_M_CLASSES[-1])


def prefill_config(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> PrefillConfig:
    """The device's stored config for (N, K) at the smallest M class >= M that lists it (the table
    linear_prefill), else the largest tile that still gives about three quarters of a wave of
    programs (`target_programs`), with the K axis split where even the smallest tile leaves half the
    GPU idle."""
    for m_class in PREFILL_M_CLASSES[PREFILL_M_CLASSES.index(prefill_m_class(m)):]:
        stored = tuned("linear_prefill", device, dtype, (m_class, n, k))
        if stored is not None:
            return PrefillConfig(*stored)
    if INTERPRET:  # every tile element costs numpy time there
        return PrefillConfig(32, 32, 32, 4, 1)
    target = target_programs(device)
    for cfg in (PrefillConfig(128, 256, 64, 8, 3), PrefillConfig(128, 128, 64, 4, 4), PrefillConfig(64, 128, 64, 4, 4),
                PrefillConfig(64, 64, 64, 4, 5)):
        tiles = cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n)
        if tiles >= 3 * target // 8:
            return cfg
    return cfg._replace(split_k=min(4, k // 1024)) if tiles < target // 4 and k >= 2048 else cfg


TMA_SHARED_MEMORY = 200 * 1024
"""Shared memory per block (opt-in) a GPU needs for the TMA GEMM's configs (up to ~208 KB)."""


def tma_supported(device: torch.device) -> bool:
    """Whether the TMA GEMM runs on this device: the interpreter, or a Hopper-class GPU (compute
    capability 9+ with the ~227 KB of shared memory per block the configs need; not consumer
    Blackwell's ~99 KB, and not ROCm builds, whose properties lack the field)."""
    if INTERPRET:
        return True
    if device.type != "cuda":
        return False
    return cuda_properties(device).major >= 9 and (shared_memory_per_block(device) or 0) >= TMA_SHARED_MEMORY


def tma_ok(x2: torch.Tensor, weight: torch.Tensor, y2: torch.Tensor) -> bool:
    """Whether `tma_matmul` can take this GEMM: 16-bit operands; rows contiguous, apart (row
    stride >= row length: no broadcast or overlapping rows), with 16-byte aligned starts and
    strides (what a TMA descriptor can describe); on a device `tma_supported` accepts."""
    if x2.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != x2.dtype or not tma_supported(x2.device):
        return False
    for t in (x2, weight, y2):
        if t.stride(-1) != 1 or t.stride(0) < t.shape[1] or (t.stride(0) * t.element_size()) % 16:
            return False
        # Under torch.compile's tracing the tensors have no storage: the allocator's 16-byte
        # aligned bases are assumed, and only the offset is checked
        start = t.storage_offset() * t.element_size() if is_traced() else t.data_ptr()
        if start % 16:
            return False
    return True


@kernel
def _tma_gemm_kernel(
    x, w, y, b_ptr, M, N, K, K_PER_SPLIT, PROGRAMS, stride_xm, stride_wn, stride_ym, stride_ys,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, DEVICE_DESCRIPTORS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_PDL: tl.constexpr, SWIGLU: tl.constexpr = False,
):
    """Program p computes work items p, p + PROGRAMS, ... of SPLIT_K x (output tiles): the tile
    (pid_m, pid_n) over K slice s. One slice: y tile (+ bias) in y's dtype. Several: the fp32
    partial to y[s] of a [SPLIT_K, M, N] buffer.

    x, w, y are TMA descriptors made on the host (block shapes [BLOCK_M, BLOCK_K], [BLOCK_N,
    BLOCK_K], and [BLOCK_M, BLOCK_N], or [1, BLOCK_M, BLOCK_N] for the partials), or, with
    DEVICE_DESCRIPTORS, pointers from which each program makes its own descriptors in global
    scratch that Triton's launcher allocates. Host descriptors are faster for small GEMMs (no
    per-program descriptor write and fence); torch.compile can
    only trace the pointer form. SWIGLU (one slice, no bias): w holds 2N rows, the gate's then
    the up projection's; the tile's products with rows n and N + n are taken side by side and
    y = silu(gate) * up is stored (`linear_silu_mul`). Under PDL a program lets the next kernel
    launch once its last work item's main loop is done."""
    pdl_wait(USE_PDL)
    if DEVICE_DESCRIPTORS:
        x_desc = tl.make_tensor_descriptor(x, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w, [2 * N if SWIGLU else N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
        if SPLIT_K == 1:
            y_desc = tl.make_tensor_descriptor(y, [M, N], [stride_ym, 1], [BLOCK_M, BLOCK_N])
        else:
            y_desc = tl.make_tensor_descriptor(y, [SPLIT_K, M, N], [stride_ys, stride_ym, 1], [1, BLOCK_M, BLOCK_N])
    else:
        x_desc, w_desc, y_desc = x, w, y
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for work in tl.range(tl.program_id(0), tiles * SPLIT_K, PROGRAMS, flatten=True):
        pid_m, pid_n = grouped_tile(work % tiles, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        k_lo = (work // tiles) * K_PER_SPLIT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N if SWIGLU else 1), dtype=tl.float32)
        for k0 in range(k_lo, min(k_lo + K_PER_SPLIT, K), BLOCK_K):
            a = x_desc.load([pid_m * BLOCK_M, k0])
            b = w_desc.load([pid_n * BLOCK_N, k0])
            acc = dot(a, b.T, acc)
            if SWIGLU:  # gate rows past N read up rows: their columns are not stored
                up = dot(a, w_desc.load([N + pid_n * BLOCK_N, k0]).T, up)
        if work + PROGRAMS >= tiles * SPLIT_K:
            pdl_launch_dependents(USE_PDL)
        if SWIGLU:
            acc = acc * tl.sigmoid(acc) * up
        if HAS_BIAS:
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        if SPLIT_K == 1:
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(y_desc.dtype))
        else:
            y_desc.store([work // tiles, pid_m * BLOCK_M, pid_n * BLOCK_N], acc.reshape(1, BLOCK_M, BLOCK_N))


def _scratch(size: int, alignment: int, stream):
    """Triton's allocator of kernel scratch (device-made TMA descriptors): a torch tensor, from the
    caching allocator (or a CUDA graph's pool during capture)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_matmul(x2: torch.Tensor, weight: torch.Tensor, bias, y2: torch.Tensor, cfg: PrefillConfig,
               swiglu: bool = False) -> None:
    """Prefill GEMM into y2 through TMA descriptors (`tma_ok` must hold): y2 = x2 @ weight.T (+ bias).
    Host-made descriptors, except under torch.compile's tracing (Inductor passes tensors). swiglu
    (cfg.split_k 1, no bias): y2 [M, N] = silu(gate) * up of weight [2N, K]'s two halves, cfg's
    block_n columns of each a tile."""
    m, k = x2.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    per = cdiv(cdiv(k, cfg.split_k), bk) * bk
    split = cdiv(k, per)
    has_bias = bias is not None
    out = y2 if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    work = cdiv(m, bm) * cdiv(n, bn) * split
    programs = min(work, cuda_properties(x2.device).multi_processor_count if x2.is_cuda else 4)
    on_device = is_traced()
    if on_device:
        x, w, y = x2, weight, out
        set_allocator_unless_set(_scratch)  # for a graph run outside Inductor (which sets its own)
    else:
        x = TensorDescriptor.from_tensor(x2, [bm, bk])
        w = TensorDescriptor.from_tensor(weight, [bn, bk])
        y = TensorDescriptor.from_tensor(out, [bm, bn] if split == 1 else [1, bm, bn])
    _tma_gemm_kernel[(programs,)](
        x, w, y, bias if has_bias and split == 1 else weight, m, n, k, per, programs,
        x2.stride(0), weight.stride(0), out.stride(-2), out.stride(0) if split > 1 else 0,
        SPLIT_K=split, HAS_BIAS=has_bias and split == 1, DEVICE_DESCRIPTORS=on_device,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SWIGLU=swiglu, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages, **pdl_options(x2),
    )
    if split > 1:
        reduce_slices(out, bias, y2)


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> "torch.Tensor | None":
    """silu(x @ gate.T) * (x @ up.T) -> [..., N] for weight [2N, K] (gate rows, then up rows) in one
    GEMM whose tiles hold the two products side by side (`tma_matmul` with swiglu), or None where
    that GEMM does not run (decode rows, empty inputs, inputs `tma_ok` refuses, a config that splits
    K): the caller composes `linear` and `silu_mul` then. The tile: linear_prefill's config for
    (M, 2N, K), its block_n halved between the two products, so a tile holds as many accumulators
    as that config's."""
    n2, k = weight.shape
    m = x.numel() // k if k else 0
    if m <= DECODE_MAX_M or n2 == 0 or n2 % 2 or k == 0:
        return None
    cfg = prefill_config(m, n2, k, x.device, x.dtype)
    if cfg.split_k > 1 or cfg.block_n < 32:
        return None
    x2 = flat_rows(x)
    y = torch.empty((*x.shape[:-1], n2 // 2), dtype=x.dtype, device=x.device)
    y2 = y.view(m, n2 // 2)
    if not tma_ok(x2, weight, y2):
        return None
    tma_matmul(x2, weight, None, y2, cfg._replace(block_n=cfg.block_n // 2), swiglu=True)
    return y


def prefill_blocks(m: int, n: int, itemsize: int, target: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of `common.mm` for the GEMMs TMA cannot
    take: the largest tile that still gives about a wave of programs (`target` / 2). fp32 tiles are
    twice the bytes: half as deep and fewer stages, to fit shared memory."""
    if itemsize == 4:
        return (64 if m <= 64 else 128), 128, 32, 8, 2
    for bm, bn, warps, stages in ((128, 128, 8, 3), (64, 128, 4, 4), (64, 64, 4, 4)):
        if cdiv(m, bm) * cdiv(n, bn) >= target // 2:
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
        reduce_slices(out, bias, y2)


def linear(x: torch.Tensor, weight: torch.Tensor, bias, config: DecodeConfig | PrefillConfig | None = None,
           ) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) -> [..., N]. `config` overrides the tables (benchmarks,
    tests): a DecodeConfig for M <= DECODE_MAX_M, a PrefillConfig above (which needs the TMA path)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2, y, y2 = linear_rows(x, n, config, PrefillConfig)
    if y2 is None:
        return y
    m = x2.shape[0]
    if m <= DECODE_MAX_M:
        splitk_matmul(x2, weight, bias, y2, config or decode_config(n, k, x2.device, x2.dtype))
    elif k > 0 and tma_ok(x2, weight, y2):
        tma_matmul(x2, weight, bias, y2, config or prefill_config(m, n, k, x2.device, x2.dtype))
    elif config is not None:
        raise ValueError("a PrefillConfig for a GEMM the TMA path cannot take (see tma_ok)")
    else:
        mm(x2, weight.t(), y2, splits=1, bias=bias, blocks=prefill_blocks(m, n, x2.element_size(), target_programs(x2.device)))
    return y


def linear_backward(dy, x, weight, need_dx: bool, need_dw: bool, need_db: bool):
    """dy [..., N], x [..., K], weight [N, K] -> (dx [..., K] or None, dW [N, K] or None, db [N] or None)."""
    n, k = weight.shape
    dy2 = flat_rows(dy)  # N or K may be 0
    x2 = flat_rows(x)
    dx = dw = db = None
    if need_dx:
        dx = empty_contiguous_like(x)
        mm(dy2, weight, flat_rows(dx))
    if need_dw:
        dw = torch.empty((n, k), dtype=weight.dtype, device=weight.device)
        mm(dy2.t(), x2, dw)
    if need_db:
        db = column_sum(dy2, weight.dtype)
    return dx, dw, db
