"""Building blocks every kernel family shares: one GEMM main loop and launcher, deterministic
reductions, tile pickers, and the interpreter workarounds. Kernel families import from here,
never from each other.

- `dot`, `tile_product`, `mm`: fp32-accumulating tile products; `mm(a, b, out)` is the one
  strided GEMM (out[M, N] = a[M, K] @ b[K, N] (+ bias[N]) (+ out)), split along K into fp32
  partials summed in a fixed order when the output has too few tiles to fill the GPU.
- `FP8_BLOCK`, `fp8_block_scales`, `widen_e4m3`, `fp8_weight_tile_product`: weights in the block format of Qwen's
  FP8 checkpoints (float8_e4m3fn [N, K], each FP8_BLOCK x FP8_BLOCK block times its scale
  ws[n // FP8_BLOCK, k // FP8_BLOCK]): a block's scales (read by the FP8 experts' GEMV and the
  fused decode GEMVs), and the weight-only tile product (the dense FP8 GEMV's and the FP8 experts'
  main loop).
- `sum_partials`, `column_sum`: two-pass column sums, deterministic and free of atomics: each
  of P programs writes the fp32 partial sum of a fixed, contiguous range of rows to row p of
  a [P, N] buffer, and a second kernel adds the P rows in a fixed order. P depends only on the
  shape, so results are bitwise reproducible run to run.
- `semaphores`, `arrive`: per-tile arrival counters, so the last program of a split reduction
  finishes it in the same kernel (the fused decode GEMVs).
- `cdiv`, `next_power_of_2`: host-side integer helpers (Triton's cost microseconds a call).
- `head_block`, `head_mask`: a power-of-two block over a head dim and its mask (below).
- `fp32`: float arguments as fp32 whoever launches the kernel.
- `kernel`, `is_traced`, `INTERPRET` (from `launch`): how kernels are launched, whether the
  launch is being traced by torch.compile, whether Triton runs on the CPU interpreter.
- `set_allocator_unless_set` (from `private_apis`): Triton's scratch allocator for kernels that
  build TMA descriptors on the device.
- `cuda_properties`, `shared_memory_per_block`, `device_name`, `target_programs`, `tuned` (from
  `devices`): a device's properties, the grid size launchers aim for on it, its tuning tables.
- `use_pdl`, `pdl_options`, `pdl_wait`, `pdl_launch_dependents`: Programmatic Dependent Launch (Hopper).
- `grouped_tile`, `row_warps`, `row_block`, `num_programs`: grid shaping.
- `flat_rows`, `empty_contiguous_like`: launchers' views and outputs, cheap on the host.
"""
import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .launch import INTERPRET, is_traced, kernel  # noqa: F401 (is_traced: for the families)
from .private_apis import set_allocator_unless_set  # noqa: F401 (for the families)
from .devices import (cuda_properties, device_name, shared_memory_per_block, target_programs,  # noqa: F401
                      tuned)


LOG2E = 1.0 / math.log(2.0)
"""Softmax kernels work in base 2: exp(x) = exp2(x * LOG2E)."""

SOFTMAX_HEADROOM = 20.0
"""Online softmax (attention, paged_attention): every probability exp2(s - max) is scaled by
2^-SOFTMAX_HEADROOM (exact: a power of two, applied after the exp2, so the exponent's argument
keeps its precision), so each is at most 2^-20 and the unnormalised accumulator sum_j p_j v_j
stays within max|v| for up to 2^20 keys: values near the bf16/fp32 maximum cannot overflow it
where the normalised output is finite. The scale cancels in the division by sum_j p_j, and the
log-sum-exp adds SOFTMAX_HEADROOM back. fp16 gets none (see `softmax_headroom`)."""


def softmax_headroom(dtype: torch.dtype) -> float:
    """SOFTMAX_HEADROOM, or 0 for fp16 operands: p is rounded to the value dtype for the P @ V
    product, and p <= 2^-20 would be subnormal in fp16 (fp16 values, <= 65504, cannot overflow
    the fp32 accumulator anyway). bf16 and fp32 have fp32's exponent range: the shift is exact."""
    return 0.0 if dtype == torch.float16 else SOFTMAX_HEADROOM


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of host ints. Launchers use this, not `triton.cdiv`, which is a constexpr
    function whose wrapper costs microseconds a call (several per launch)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for host ints (as `cdiv`)."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


@triton.constexpr_function
def head_block(d):
    """The power-of-two block (tl.arange's width) a kernel lays over a head dim of `d` elements:
    `d` itself when it is a power of two. Head dims are multiples of 16 up to 256
    (qwen_ops.checks.HEAD_DIMS), so 48 takes a block of 64, 80 and 96 of 128, 160 of 256."""
    return triton.next_power_of_2(d)


@triton.jit
def head_mask(offs, D: tl.constexpr):
    """offs < D for offsets inside a head_block(D) block: the loads and stores of a head that is not
    a power of two are masked (zeros read past D, so sums over the head are those of its D
    elements). When D is a power of two the mask is a constant all-true tensor, which the compiler
    drops from every load and store: those dims compile to the unmasked code."""
    if D == head_block(D):
        return tl.full(offs.shape, 1, tl.int1)
    else:
        return offs < D


@triton.jit
def fp32(x):
    """A float argument as fp32. Triton passes Python floats to a kernel as fp32; Inductor, which
    launches the kernels of a graph torch.compile traced into them, passes them as fp64 (whose
    math would be slow, and which tl.dot's fp32 accumulators refuse)."""
    return tl.cast(x, tl.float32)


_PDL_OFF = os.environ.get("QWEN_PDL", "1") == "0"


def use_pdl(t: torch.Tensor) -> bool:
    """Programmatic Dependent Launch for the kernels that support it (the decode and prefill paths'):
    on CUDA devices of compute capability 9 or more (Hopper), unless QWEN_PDL=0. Such a kernel is launched with
    `launch_pdl=True`, may start while the previous kernel in the stream finishes, and calls
    `gdc_wait` before it reads or writes anything but its weights (see `pdl_wait`). Never under
    the interpreter, which has no griddepcontrol instruction."""
    return not _PDL_OFF and t.is_cuda and cuda_properties(t.device).major >= 9


_pdl_capable: dict = {}  # device index -> use_pdl's answer while PDL is not switched off


def pdl_options(t: torch.Tensor) -> dict:
    """The launch arguments of a kernel that takes a USE_PDL constexpr: USE_PDL, and `launch_pdl`
    where PDL is on (`use_pdl`, its device query cached per device)."""
    if _PDL_OFF:
        return {"USE_PDL": False}
    index = t.get_device()
    capable = _pdl_capable.get(index)
    if capable is None:
        capable = _pdl_capable[index] = use_pdl(t)
    return {"USE_PDL": True, "launch_pdl": True} if capable else {"USE_PDL": False}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel of the stream has finished and its writes are visible (a no-op
    without PDL). Nothing before this point may touch memory another kernel writes."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Let the next kernel of the stream start its prologue (it still waits for this one to finish
    before touching shared memory state)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


MAX_TILES = 1 << 16
"""Arrival counters per device: output tiles x row blocks of one launch."""

_device_buffers: dict = {}


def device_buffer(name: str, size: int, device: torch.device, before_capture: str) -> torch.Tensor:
    """The device's int32 buffer `name` [size], created zeroed on first use and shared by every
    call after. Creating it inside a CUDA graph capture raises (`before_capture` says what to call
    first): a graph must replay the buffer that exists, never allocate one."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (name, str(device))
    if key not in _device_buffers:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{name}: {before_capture} before capturing a CUDA graph")
        _device_buffers[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _device_buffers[key]


def semaphores(device: torch.device) -> torch.Tensor:
    """The device's arrival counters: int32, zero between launches (the last program of a tile
    sets its counter back), created zeroed on first use. One buffer per device, so two kernels
    that count arrivals must not run at the same time on one device (concurrent streams are not
    supported). Create it before a CUDA graph capture (`reserve`), never inside one."""
    return device_buffer("kernels that count arrivals", MAX_TILES, device,
                         "call qwen_ops.reserve_semaphores(device)")


def reserve(device) -> None:
    """Create the device's arrival counters now (the model does this when it builds a cache)."""
    semaphores(torch.device(device))


@triton.jit
def arrive(sem_ptr, tile):
    """Split reductions without a second kernel: each program of a tile stores its partial result,
    then counts itself in; the count returned is how many arrived before it, so the one that gets
    (number of programs - 1) is last and may read every partial (and must reset the counter)."""
    tl.debug_barrier()  # every thread's partial is stored before the arrival is published
    return tl.atomic_add(sem_ptr + tile, 1, sem="acq_rel")


_DOT_IN_FP32 = tl.constexpr(INTERPRET)


@triton.jit
def dot(a, b, acc):
    """acc + a @ b with fp32 accumulation.

    fp32 operands use exact fp32 products (`ieee`), not tf32, so fp32 models keep
    fp32 accuracy. The Triton interpreter (3.9) returns garbage for a bf16
    `tl.dot`, so under the interpreter the operands are widened to fp32 first.
    """
    if _DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid`, visiting output tiles in GROUP_M-row groups so that
    neighbouring programs share operand tiles in L2."""
    num_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_n
    first_m = (pid // group_size) * GROUP_M
    rows_in_group = min(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % group_size) % rows_in_group, (pid % group_size) // rows_in_group


def row_warps(block: int) -> int:
    """Warps for a one-row-per-program kernel over `block` elements."""
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def row_block(block_n: int) -> int:
    """Rows per tile of a row-reduction kernel: about 4K elements (16K under the interpreter, where
    wide tiles are cheap and each operation has a fixed cost)."""
    return max(1, (16384 if INTERPRET else 4096) // block_n)


MAX_PROGRAMS = 4 if INTERPRET else 512
"""Programs of a row-reduction kernel (partial-sum rows); the interpreter runs them one by one."""


def flat_rows(t: torch.Tensor, keep: int = 1) -> torch.Tensor:
    """t [..., *last `keep` dims] -> [R, *last dims] (a view where the strides allow, as reshape).
    Unlike reshape(-1, ...), it works when the kept dims hold no elements (N = 0 or no heads),
    where the -1 would be ambiguous."""
    lead = t.dim() - keep
    if lead == 1:  # already [R, *last dims]: the common case
        return t
    return t.flatten(0, lead - 1) if lead > 1 else t.unsqueeze(0)


def empty_contiguous_like(t: torch.Tensor) -> torch.Tensor:
    """A new contiguous tensor of t's shape, dtype and device: `torch.empty_like` in the contiguous
    format, which costs the host half of `torch.empty(t.shape, dtype=..., device=...)`."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def num_programs(rows: int) -> int:
    return max(1, min(rows, MAX_PROGRAMS))


@kernel
def _sum_partials_kernel(part_ptr, out_ptr, P, N, stride_p, out_offset, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[out_offset + n] = sum_p part[p, n], in a fixed order (fp32), stored in out's dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        m = ((p0 + rows)[:, None] < P) & (cols[None, :] < N)
        acc += tl.load(part_ptr + (p0 + rows)[:, None].to(tl.int64) * stride_p + cols[None, :], mask=m, other=0.0)
    tl.store(out_ptr + out_offset + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)


def sum_partials(partial: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None,
                 out_offset: int = 0) -> torch.Tensor:
    """partial [P, N] fp32 -> [N] in `dtype` (into out[out_offset:out_offset + N], out 1-D
    contiguous, if given): the second, fixed-order pass of a column sum."""
    p, n = partial.shape
    if out is None:
        out = torch.empty(n, dtype=dtype, device=partial.device)
    if n == 0:
        return out
    block_n = min(1024 if INTERPRET else 256, next_power_of_2(n))
    _sum_partials_kernel[(cdiv(n, block_n),)](partial, out, p, n, partial.stride(0), out_offset,
                                                       BLOCK_P=16, BLOCK_N=block_n, num_warps=4)
    return out


@kernel
def _column_sum_kernel(x_ptr, part_ptr, ROWS, N, ROWS_PER_PROG, stride_x, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """part[p, n] = sum of x[r, n] over program p's rows (fp32); grid (P, cdiv(N, BLOCK_N))."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rr = tl.arange(0, BLOCK_R)
    lo = pid * ROWS_PER_PROG
    hi = min(lo + ROWS_PER_PROG, ROWS)
    acc = tl.zeros((BLOCK_R, BLOCK_N), dtype=tl.float32)
    for r0 in range(lo, hi, BLOCK_R):
        r = r0 + rr
        m = (r[:, None] < hi) & (cols[None, :] < N)
        acc += tl.load(x_ptr + r[:, None].to(tl.int64) * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(part_ptr + pid * N + cols, tl.sum(acc, axis=0), mask=cols < N)


def column_sum(x2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x2 [R, N] (last dim contiguous) -> sum over rows [N] in `dtype`, deterministic (two passes)."""
    rows, n = x2.shape
    if rows == 0 or n == 0:
        return torch.zeros(n, dtype=dtype, device=x2.device)
    p = num_programs(cdiv(rows, 16))
    per = cdiv(rows, p)
    p = cdiv(rows, per)
    partial = torch.empty((p, n), dtype=torch.float32, device=x2.device)
    block_n = min(128, next_power_of_2(n))
    _column_sum_kernel[(p, cdiv(n, block_n))](x2, partial, rows, n, per, x2.stride(0),
                                                      BLOCK_R=16, BLOCK_N=block_n, num_warps=4)
    return sum_partials(partial, dtype)


@triton.jit
def tile_product(a_ptr, b_ptr, rm, rn, M, N, k_lo, k_hi, stride_am, stride_ak, stride_bk, stride_bn,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr = False):
    """fp32 [BLOCK_M, BLOCK_N] tile a[rm, k_lo:k_hi] @ b[k_lo:k_hi, rn]: the one GEMM main loop.
    Rows/cols past M/N read a valid (wrapped) row: their values are garbage, for the caller to
    mask at the store. EVEN_K (k_hi - k_lo a multiple of BLOCK_K) drops the K masks."""
    rk = k_lo + tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rm % M).to(tl.int64)[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = b_ptr + rk[:, None] * stride_bk + (rn % N).to(tl.int64)[None, :] * stride_bn
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            a = tl.load(a_ptrs, mask=kk[None, :] < k_hi - k0, other=0.0)
            b = tl.load(b_ptrs, mask=kk[:, None] < k_hi - k0, other=0.0)
        acc = dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@kernel
def _mm_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr, M, N, K, K_PER_SPLIT,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_cs, c_row0,
    HAS_BIAS: tl.constexpr, ACCUMULATE: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Tile (pid_m, pid_n) of c[c_row0:c_row0 + M], over the K slice [pid_s * K_PER_SPLIT, ...) of
    program axis 1 (one slice: the whole K). With several slices c is a [SPLIT, M, N] fp32 partial
    buffer (c_row0 0). The bias (fp32 add) is only given with one slice."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_s = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_s.to(tl.int64) * K_PER_SPLIT
    acc = tile_product(a_ptr, b_ptr, rm, rn, M, N, k_lo, min(k_lo + K_PER_SPLIT, K),
                       stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_rows = c_row0 + rm.to(tl.int64)
    c_ptrs = c_ptr + pid_s * stride_cs + c_rows[:, None] * stride_cm + rn.to(tl.int64)[None, :] * stride_cn
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if ACCUMULATE:
        acc += tl.load(c_ptrs, mask=mask, other=0.0)
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def gemm_blocks(m: int, n: int, k: int, itemsize: int):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Under the interpreter, tiles shrink to
    the problem (each tile element costs numpy time there)."""
    if INTERPRET:
        clamp = lambda v, hi: min(hi, max(16, next_power_of_2(v)))  # noqa: E731
        return clamp(m, 64), clamp(n, 64), clamp(k, 32), 4, 1
    if itemsize == 4:
        return 64, 128, 32, 8, 2
    return 128, 128, 64, 8, 3


def split_k(m: int, n: int, k: int, bm: int, bn: int, bk: int, target: int) -> int:
    """K slices for a GEMM whose output has too few tiles to fill the GPU but a long K (dW over
    all tokens, dhidden against a 150K vocabulary): about `target` programs (`target_programs`),
    each slice at least 16 K-steps long. A function of the shape and the device only
    (deterministic)."""
    if INTERPRET:
        return 1
    tiles = cdiv(m, bm) * cdiv(n, bn)
    if tiles >= target // 2:
        return 1
    return max(1, min(cdiv(target, tiles), k // (16 * bk)))


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False, splits: int | None = None,
       bias: torch.Tensor | None = None, blocks: tuple | None = None, out_row0: int = 0) -> torch.Tensor:
    """out[M, N] = a[M, K] @ b[K, N] (+ bias[N]) (+ out if accumulate, out fp32). Any strides; a and
    b one dtype. `blocks` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) overrides `gemm_blocks`.

    `out_row0`: the product goes to rows [out_row0, out_row0 + M) of a taller `out`. Launchers
    write row ranges this way, never through a slice of `out`: under torch.compile's tracing, a
    kernel writing into a view becomes a scatter of the view into a copy of its whole base, and a
    loop of them copies the base once per pass.

    A short, deep GEMM is split along K (`split_k`, or `splits`): each slice writes an fp32 partial
    [S, M, N] and `sum_partials` adds them in a fixed order (no atomics)."""
    m, k = a.shape
    n = b.shape[1]
    if m == 0 or n == 0:
        return out
    if k == 0:
        rows = out.narrow(0, out_row0, m)
        if not accumulate:
            rows.zero_()
        if bias is not None:
            rows += bias
        return out
    bm, bn, bk, warps, stages = blocks or gemm_blocks(m, n, k, a.element_size())
    if accumulate:
        stages = min(stages, 2)  # the fp32 output tile read at the end needs the registers
    if splits is None:
        splits = 1 if accumulate or bias is not None else split_k(m, n, k, bm, bn, bk, target_programs(a.device))
    s = splits
    per = cdiv(cdiv(k, s), bk) * bk
    s = cdiv(k, per)
    if s > 1 and (accumulate or bias is not None or not out.is_contiguous()):
        raise ValueError("split-K needs a contiguous output, no accumulate and no bias")
    target = out if s == 1 else torch.empty((s, m, n), dtype=torch.float32, device=out.device)
    grid = (cdiv(m, bm) * cdiv(n, bn), s)
    _mm_kernel[grid](
        a, b, bias if bias is not None else b, target, m, n, k, per, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        target.stride(-2), target.stride(-1), target.stride(0) if s > 1 else 0, out_row0 if s == 1 else 0,
        HAS_BIAS=bias is not None, ACCUMULATE=accumulate, EVEN_K=k % bk == 0 and s == 1,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )
    if s > 1:
        sum_partials(target.view(s, m * n), out.dtype, out=out.view(-1), out_offset=out_row0 * n)
    return out


# ------------------------------------------------------------------------------------ linear layers

DECODE_MAX_M = 16
"""Rows (tokens) up to which a linear takes its decode path (split-K GEMV; FP8: weight-only)."""


class DecodeConfig(NamedTuple):
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def linear_rows(x: torch.Tensor, n: int, config, prefill_type: type):
    """(x2 [M, K], y [..., N] in x's dtype, y2 [M, N], a view of y) for a linear of x [..., K] with N
    outputs; y2 is None when y is empty. ``config`` (None, a DecodeConfig for M <= DECODE_MAX_M or a
    ``prefill_type`` above) must match M: a ValueError otherwise."""
    x2 = flat_rows(x)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    m = x2.shape[0]
    if m == 0 or n == 0:
        return x2, y, None
    if config is not None and isinstance(config, DecodeConfig) != (m <= DECODE_MAX_M):
        raise ValueError(f"a {type(config).__name__} for M = {m} (DecodeConfig for M <= {DECODE_MAX_M}, "
                         f"{prefill_type.__name__} above)")
    return x2, y, flat_rows(y)


@kernel
def _splitk_reduce_kernel(
    part_ptr, b_ptr, y_ptr, N, stride_ps, stride_pm, stride_ym,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    pdl_wait(USE_PDL)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * stride_ps + m * stride_pm + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_launch_dependents(USE_PDL)
    tl.store(y_ptr + m * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def reduce_slices(part: torch.Tensor, bias, y2: torch.Tensor) -> None:
    """y2 [M, N] = sum over s of part[s] (fp32 [S, M, N], in slice order) (+ bias), in y2's dtype."""
    split, m, n = part.shape
    _splitk_reduce_kernel[(m, cdiv(n, 1024))](
        part, bias if bias is not None else part, y2, n, part.stride(0), part.stride(1), y2.stride(0),
        SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=1024, num_warps=4, **pdl_options(y2),
    )


# ------------------------------------------------------------------------------------- FP8 weights

FP8_BLOCK = 128
"""The weight block (both axes) of Qwen's FP8 checkpoints (`weight_block_size` [128, 128]): w[n, k] =
weight[n, k] * weight_scale_inv[n // FP8_BLOCK, k // FP8_BLOCK]; the last block row and column may be partial."""
_FP8_BLOCK = tl.constexpr(FP8_BLOCK)


_E4M3_TO_BF16 = tl.constexpr(" ".join((
    "{",
    ".reg .b32 lo, hi, sign, scale;",
    "mov.b32 scale, 0x7B807B80;",
    "prmt.b32 lo, $2, 0, 0x1404;",
    "prmt.b32 hi, $2, 0, 0x3424;",
    "and.b32 sign, lo, 0x80008000;",
    "shr.b32 lo, lo, 4;",
    "and.b32 lo, lo, 0x07F007F0;",
    "or.b32 lo, lo, sign;",
    "mul.rn.bf16x2 $0, lo, scale;",
    "and.b32 sign, hi, 0x80008000;",
    "shr.b32 hi, hi, 4;",
    "and.b32 hi, hi, 0x07F007F0;",
    "or.b32 hi, hi, sign;",
    "mul.rn.bf16x2 $1, hi, scale;",
    "}",
)))
"""Four e4m3 bytes ($2) to four bf16 ($0, $1): each byte's exponent and mantissa bits moved into a
bf16's (bits 4-10), its sign into bit 15, then times 2^120 (bf16 0x7B80), the two formats' bias
apart. Exact for every finite e4m3 value, subnormals included (a bf16 subnormal times 2^120 is
normal); e4m3's NaN (0x7F, 0xFF) becomes +-480, which a checkpoint's weights never hold."""


@triton.jit
def widen_e4m3(w, dtype: tl.constexpr):
    """float8_e4m3fn w in dtype, exactly (every finite e4m3 value is a bf16, fp16 and fp32 value).
    To bf16 on the GPU by bit moves (`_E4M3_TO_BF16`): Triton's own conversion goes through fp16
    and fp32 with two F2F instructions an element, a quarter-rate unit that caps an FP8 GEMV's
    weight stream below the memory's bandwidth (the SASS of the fused decode GEMVs for sm_90)."""
    if dtype == tl.bfloat16 and not _DOT_IN_FP32:
        out = tl.inline_asm_elementwise(_E4M3_TO_BF16, "=r,=r,r", [w.to(tl.uint8, bitcast=True)], dtype=tl.bfloat16,
                                        is_pure=True, pack=4)
    else:
        out = w.to(dtype)
    return out


@triton.jit
def fp8_block_scales(ws_ptr, rows, k, stride_wsn, stride_wsk):
    """The fp32 scales of an FP8 weight's rows `rows` at column k: ws[rows // FP8_BLOCK, k // FP8_BLOCK]."""
    return tl.load(ws_ptr + (rows // _FP8_BLOCK) * stride_wsn + (k // _FP8_BLOCK) * stride_wsk).to(tl.float32)


@triton.jit
def fp8_weight_tile_product(a_ptr, w_ptr, ws_ptr, rm, rn, M, N, k_lo, k_hi, stride_am, stride_wn, stride_wsn,
                            stride_wsk, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] tile a[rm, k_lo:k_hi] @ dequant(w)[rn, k_lo:k_hi].T, weight-only: w is
    float8_e4m3fn [N, K] with block scales ws (`fp8_block_scales`), a in the model's dtype (both
    contiguous along K). Each BLOCK_K step is its own dot of a's tile with the FP8 tile widened to
    a's dtype (`widen_e4m3`), scaled per column by its
    block's scale and added to the fp32 accumulator; BLOCK_K divides FP8_BLOCK and k_lo is a
    multiple of FP8_BLOCK, so a step never crosses a block. Rows past M and K past k_hi read zeros;
    columns past N read a valid (wrapped) row, for the caller to mask at the store. `rm` is int64
    where a row times stride_am may pass 2^31."""
    rk = tl.arange(0, BLOCK_K)
    cols = (rn % N).to(tl.int64)
    a_ptrs = a_ptr + rm[:, None] * stride_am + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + (k_lo + rk)[:, None]
    ws_ptrs = ws_ptr + (cols // _FP8_BLOCK) * stride_wsn + (k_lo // _FP8_BLOCK) * stride_wsk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk < k_hi - k0
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        block = dot(a, widen_e4m3(w, a.dtype), tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32))
        acc += block * tl.load(ws_ptrs).to(tl.float32)[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        if BLOCK_K == _FP8_BLOCK:
            ws_ptrs += stride_wsk
        else:  # the next block's scales once the next step starts it
            ws_ptrs += tl.where((k0 + BLOCK_K) // _FP8_BLOCK > k0 // _FP8_BLOCK, stride_wsk, 0)
    return acc
