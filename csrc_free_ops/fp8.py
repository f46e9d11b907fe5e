"""FP8 (e4m3) block-scaled linears and the per-token-group activation quantisation they take.

The format of Qwen's (and DeepSeek's) FP8 checkpoints: a weight [N, K] in float8_e4m3fn with
`weight_scale_inv` [cdiv(N, BLOCK), cdiv(K, BLOCK)] (fp32 or bf16, BLOCK = 128), the factor that
multiplies a block back to the real weight: w[n, k] = weight[n, k] * weight_scale_inv[n // 128, k // 128].
The last block row and column may be partial.

Activations are quantised per token and group of G elements (G = BLOCK for the GEMM):

    scale[m, g] = max(max |x[m, gG:(g+1)G]|, EPS) / FP8_MAX                       (fp32, FP8_MAX = 448)
    q[m, k]     = e4m3(clamp(x[m, k] / scale[m, g], -FP8_MAX, FP8_MAX))           (round to nearest even)

both divisions IEEE (`tl.div_rn`), so the quantisation is bit-exact against PyTorch's.

Kernels:
- `_quantize_kernel`: program (row block, group) quantises BLOCK_M rows of one group.
- `_w8a8_kernel` (prefill, M > DECODE_MAX_M): x quantised first (`quantize_per_token_group`), then
  y[m, n] = sum over K blocks g of (q[m, g] . weight[n, g]) * scale[m, g] * weight_scale_inv[n // 128, g]
  (+ bias). Each block's product is its own FP8 tensor-core dot with fp32 accumulation, scaled and
  added to the fp32 accumulator (the promotion every 128 elements of DeepSeek-V3's FP8 GEMM).
- `_weight_only_kernel` (decode, M <= DECODE_MAX_M): x is not quantised;
  y[m, n] = sum over K blocks g of (x[m, g] . weight[n, g]) * weight_scale_inv[n // 128, g] (+ bias).
  The fp8 weight tile is widened to x's dtype in registers (exact: every e4m3 value is a bf16 and
  an fp16 value), and each block's fp32 product is scaled (`common.fp8_weight_tile_product`, the
  FP8 experts' main loop too). The K axis is split as in linear's
  decode kernel (slices of whole blocks), the slices summed in a fixed order by its reduce kernel.

Output in x's dtype, bias added in fp32. GPUs of compute capability 8.9 or newer (`fp8_supported`).

Under Triton's interpreter (3.9): fp8 loads and stores, fp8 -> fp32 and a `tl.dot` of fp8 tiles
(the interpreter widens its operands to fp16, exactly) are right; the fp32 -> e4m3 conversion is
not: it rounds half up, loses the carry out of the mantissa where the exponent is odd (124.3
becomes 64), truncates subnormals (1.7 x 2^-9 becomes 2^-9) and does not saturate. So under the
interpreter `to_e4m3` first rounds to the e4m3 grid in fp32 (round to nearest even, bit-exact),
which the conversion then takes without rounding. On a GPU the conversion is the hardware's
(`cvt.rn.satfinite.e4m3x2.f32`, which tests/test_ops_fp8.py finds in the kernel compiled for sm_90).
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .common import (DECODE_MAX_M, FP8_BLOCK, INTERPRET, DecodeConfig, cdiv, cuda_properties, flat_rows,
                     fp8_weight_tile_product, grouped_tile, kernel, linear_rows, next_power_of_2, reduce_slices,
                     target_programs, tuned)

BLOCK = FP8_BLOCK
"""The weight block (both axes) of Qwen's FP8 checkpoints (`common.FP8_BLOCK`), and the activation
group of the GEMM."""
FP8_MAX = 448.0
"""The largest float8_e4m3fn value."""
EPS = 1e-10
"""The smallest amax a group's scale is taken from (an all-zero group gets scale EPS / FP8_MAX)."""



def fp8_supported(device: torch.device) -> bool:
    """Whether the kernels run on this device: the interpreter's CPU, or a GPU of compute capability
    8.9 or newer (Ada, Hopper), the first with e4m3 conversions and tensor-core products in Triton."""
    if device.type != "cuda":
        return INTERPRET
    props = cuda_properties(device)
    return (props.major, props.minor) >= (8, 9)


_FP8_MAX = tl.constexpr(FP8_MAX)
_EPS = tl.constexpr(EPS)
_ROUND_IN_FP32 = tl.constexpr(INTERPRET)


@triton.jit
def to_e4m3(v):
    """fp32 v clamped to [-FP8_MAX, FP8_MAX] and rounded to nearest even float8_e4m3fn. Under the
    interpreter the rounding is done in fp32 first (module doc): normal values (|v| >= 2^-6) keep 3
    mantissa bits (round to nearest even on the bits, a carry moving into the exponent), subnormal
    ones round to a multiple of 2^-9 through an fp32 add at 1.5 * 2^14, whose ulp is 2^-9, and keep
    their sign bit (-0.0 and values that round to zero stay negative zeros)."""
    v = tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX)
    if _ROUND_IN_FP32:
        bits = v.to(tl.uint32, bitcast=True)
        normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20).to(tl.float32, bitcast=True)
        small = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.uint32, bitcast=True) | ((bits >> 31) << 31)
        v = tl.where(tl.abs(v) < 0.015625, small.to(tl.float32, bitcast=True), normal)
    return v.to(tl.float8e4nv)


@kernel
def _quantize_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm,
                     GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """q[rows, group g] and scale[rows, g] (module doc) of program (row block, g)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    g = tl.program_id(1)
    rk = g * GROUP + tl.arange(0, GROUP)
    rows = rm.to(tl.int64)
    mask = (rm[:, None] < M) & (rk[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0).to(tl.float32)
    scale = tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), _EPS), _FP8_MAX)
    q = to_e4m3(tl.div_rn(x, scale[:, None]))
    tl.store(q_ptr + rows[:, None] * stride_qm + rk[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + g, scale, mask=rm < M)


def quantize_per_token_group(x: torch.Tensor, group: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (last dim contiguous, K > 0, group a power of two) -> (q [..., K] float8_e4m3fn,
    scale [..., cdiv(K, group)] fp32), both contiguous."""
    k = x.shape[-1]
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((*x.shape[:-1], cdiv(k, group)), dtype=torch.float32, device=x.device)
    x2 = flat_rows(x)
    m = x2.shape[0]
    if m == 0:
        return q, s
    block_m = min(next_power_of_2(m), max(1, (16384 if INTERPRET else 2048) // group))
    _quantize_kernel[(cdiv(m, block_m), s.shape[-1])](
        x2, q, s, m, k, x2.stride(0), k, s.shape[-1], GROUP=group, BLOCK_M=block_m, num_warps=4)
    return q, s


@kernel
def _w8a8_kernel(
    q_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, y_ptr, M, N, K,
    stride_qm, stride_sxm, stride_wn, stride_swn, stride_swk, stride_ym,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """Tile (pid_m, pid_n) of y = dequantised q @ dequantised weight.T (+ bias), the K axis walked a
    whole block (BLOCK_K = BLOCK) a step. Rows past M and columns past N read wrapped (valid) rows,
    masked at the store; K past the end reads zeros."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rows = (rm % M).to(tl.int64)
    cols = (rn % N).to(tl.int64)
    q_ptrs = q_ptr + rows[:, None] * stride_qm + rk[None, :]
    w_ptrs = w_ptr + cols[None, :] * stride_wn + rk[:, None]
    sx_ptrs = sx_ptr + rows * stride_sxm
    sw_ptrs = sw_ptr + (cols // BLOCK_K) * stride_swn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(q_ptrs)
            b = tl.load(w_ptrs)
        else:
            k_ok = rk < K - g * BLOCK_K
            a = tl.load(q_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        sa = tl.load(sx_ptrs + g)
        sb = tl.load(sw_ptrs + g * stride_swk).to(tl.float32)
        acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
        q_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


class PrefillTiles(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8


def prefill_tiles(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype) -> PrefillTiles:
    """The w8a8 GEMM's tiles for x of `dtype`: the device's stored tiles for (N, K) (the table
    fp8_prefill, swept at 4096 rows), else vLLM's default for block FP8 (64 x 128, 4 warps) with 3
    stages; under the interpreter, shrunk to the problem."""
    if INTERPRET:
        return PrefillTiles(min(64, max(16, next_power_of_2(m))), min(64, max(16, next_power_of_2(n))), 4, 1)
    stored = tuned("fp8_prefill", device, dtype, (n, k))
    return PrefillTiles(*stored) if stored is not None else PrefillTiles(64, 128)


def w8a8_matmul(q2, sx, weight, weight_scale_inv, bias, y2, tiles: PrefillTiles | None = None) -> None:
    """y2 [M, N] = (q2 [M, K] fp8 with scales sx [M, cdiv(K, BLOCK)]) @ (weight [N, K] fp8 with
    weight_scale_inv).T (+ bias), dequantised block by block. `tiles` overrides `prefill_tiles`
    (benchmarks, tests)."""
    m, k = q2.shape
    n = weight.shape[0]
    t = tiles or prefill_tiles(m, n, k, y2.device, y2.dtype)
    _w8a8_kernel[(cdiv(m, t.block_m) * cdiv(n, t.block_n),)](
        q2, sx, weight, weight_scale_inv, bias if bias is not None else sx, y2, m, n, k,
        q2.stride(0), sx.stride(0), weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1),
        y2.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % BLOCK == 0,
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=BLOCK, GROUP_M=t.group_m, num_warps=t.num_warps,
        num_stages=t.num_stages,
    )


@kernel
def _weight_only_kernel(
    x_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_swn, stride_swk, stride_om, stride_os,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Program (n tile, K slice s): the fp32 product of slice s (whole blocks of BLOCK_K = BLOCK),
    to out[s] of a [SPLIT_K, M, N] buffer; one slice: y (+ bias) in y's dtype."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_s * K_PER_SPLIT
    acc = fp8_weight_tile_product(x_ptr, w_ptr, sw_ptr, rm, rn, M, N, k_lo, min(k_lo + K_PER_SPLIT, K), stride_xm,
                                  stride_wn, stride_swn, stride_swk, BLOCK_M, BLOCK_N, BLOCK_K)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_ptrs = out_ptr + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptrs, acc, mask=mask)


def decode_config(n: int, k: int, device: torch.device) -> DecodeConfig:
    """64-wide N tiles (16 under the interpreter), one block of K a step, and enough K slices of
    whole blocks for `target_programs`."""
    block_n = min(16 if INTERPRET else 64, max(16, next_power_of_2(n)))
    tiles, k_blocks = cdiv(n, block_n), cdiv(k, BLOCK)
    return DecodeConfig(block_n, BLOCK, min(k_blocks, max(1, cdiv(target_programs(device), tiles))))


def weight_only_matmul(x2, weight, weight_scale_inv, bias, y2, cfg: DecodeConfig) -> None:
    """y2 [M, N] = x2 [M, K] @ (weight [N, K] fp8 with weight_scale_inv).T (+ bias), M <= DECODE_MAX_M."""
    m, k = x2.shape
    n = weight.shape[0]
    k_per_split = cdiv(cdiv(k, cfg.split_k), BLOCK) * BLOCK
    split = cdiv(k, k_per_split)
    out = y2 if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x2.device)
    _weight_only_kernel[(cdiv(n, cfg.block_n), split)](
        x2, weight, weight_scale_inv, bias if bias is not None else weight_scale_inv, out, m, n, k, k_per_split,
        x2.stride(0), weight.stride(0), weight_scale_inv.stride(0), weight_scale_inv.stride(1),
        out.stride(-2), out.stride(0) if split > 1 else 0, SPLIT_K=split, HAS_BIAS=bias is not None,
        BLOCK_M=DECODE_MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages if x2.element_size() == 2 else 2,
    )
    if split > 1:
        reduce_slices(out, bias, y2)


def block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_inv: torch.Tensor, bias,
                 config: DecodeConfig | PrefillTiles | None = None) -> torch.Tensor:
    """x [..., K] @ dequantised weight [N, K].T (+ bias) -> [..., N] in x's dtype: weight-only for
    M <= DECODE_MAX_M rows, x quantised per token and group of BLOCK above (module doc). `config`
    overrides the tiles (benchmarks, tests): a DecodeConfig (its block_k is BLOCK) for M <=
    DECODE_MAX_M, PrefillTiles above."""
    n = weight.shape[0]
    x2, y, y2 = linear_rows(x, n, config, PrefillTiles)
    if y2 is None:
        return y
    if x2.shape[0] <= DECODE_MAX_M:
        weight_only_matmul(x2, weight, weight_scale_inv, bias, y2, config or decode_config(n, x.shape[-1], x.device))
    else:
        q2, sx = quantize_per_token_group(x2)
        w8a8_matmul(q2, sx, weight, weight_scale_inv, bias, y2, config)
    return y
