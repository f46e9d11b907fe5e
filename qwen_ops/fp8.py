"""FP8 (e4m3) linears in the block format of Qwen's FP8 checkpoints, and the activation
quantisation they take (csrc_free_ops/fp8.py):

- qwen::fp8_quantize_per_token_group(x [..., K], group_size=128) -> (q [..., K] float8_e4m3fn,
  scale [..., cdiv(K, group_size)] fp32): scale = max(amax of the group, EPS) / 448, q = x / scale
  rounded to nearest even (vLLM's per_token_group_quant_fp8, DeepSeek-V3's activation quantisation).
- qwen::fp8_block_linear(x [..., K], weight [N, K] float8_e4m3fn, weight_scale_inv [cdiv(N, 128),
  cdiv(K, 128)] fp32 or bf16, bias=None) -> [..., N] in x's dtype. Two kinds of math, by
  M = prod(x.shape[:-1]):
    M <= DECODE_MAX_M (16, decode): weight-only, x @ dequant(weight).T, x not quantised;
    M > DECODE_MAX_M (prefill): x quantised per token and group of 128 first (as
    fp8_quantize_per_token_group), dequant(q, scale) @ dequant(weight).T.
  The reference takes the same rule, so a row's result depends on which side of 16 its call's M is.

`quantize_weight_fp8_block` and `dequantize_weight_fp8_block` (plain PyTorch, not ops) make and
undo the checkpoint format: weight_scale_inv[i, j] = max(amax of block (i, j), EPS) / 448, the block
divided by it and rounded to float8_e4m3fn.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import fp8 as kernels
from csrc_free_ops.common import cdiv
from csrc_free_ops.fp8 import BLOCK, EPS, FP8_MAX
from csrc_free_ops.linear import DECODE_MAX_M

from .checks import check_float, check_same, fail
from .registry import define

SCALE_DTYPES = (torch.float32, torch.bfloat16)
GROUP_SIZES = tuple(1 << i for i in range(4, 11))
"""Activation groups fp8_quantize_per_token_group takes: powers of two from 16 to 1024."""


def _scaled_blocks(t: Tensor, rows: int, cols: int) -> tuple[Tensor, Tensor]:
    """t [R, C] (fp32) zero-padded to whole rows x cols blocks, as [R / rows, rows, C / cols, cols],
    and each block's scale max(amax, EPS) / FP8_MAX [R / rows, C / cols]."""
    r, c = t.shape
    blocks = F.pad(t, (0, cdiv(c, cols) * cols - c, 0, cdiv(r, rows) * rows - r))
    blocks = blocks.view(cdiv(r, rows), rows, cdiv(c, cols), cols)
    # A tensor divisor: CUDA turns division by a Python scalar into multiplication by its reciprocal,
    # which can be one ulp off the correctly rounded quotient that the kernel computes.
    return blocks, blocks.abs().amax(dim=(1, 3)).clamp_min(EPS) / torch.full((), FP8_MAX, device=t.device)


def _to_fp8(blocks: Tensor, scale: Tensor, shape) -> Tensor:
    """blocks [R', rows, C', cols] / scale [R', C'] rounded to float8_e4m3fn, cut back to shape [R, C]."""
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).flatten(2).flatten(0, 1)
    return q[:shape[0], :shape[1]].to(torch.float8_e4m3fn)


def _expand(scale: Tensor, rows: int, cols: int, shape) -> Tensor:
    """scale [R', C'] repeated over blocks of rows x cols, cut to shape [R, C]."""
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:shape[0], :shape[1]]


def quantize_weight_fp8_block(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [N, K] (any float dtype) -> (weight float8_e4m3fn [N, K], weight_scale_inv fp32
    [cdiv(N, 128), cdiv(K, 128)]): the format of Qwen's FP8 checkpoints (weight_block_size [128, 128]),
    each block scaled so that its largest magnitude is 448."""
    w = weight.float()
    blocks, scale = _scaled_blocks(w, BLOCK, BLOCK)
    return _to_fp8(blocks, scale, w.shape), scale


def dequantize_weight_fp8_block(weight: Tensor, weight_scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """weight [N, K] float8_e4m3fn * weight_scale_inv [cdiv(N, 128), cdiv(K, 128)] per block -> [N, K] in dtype
    (the product in fp32, or float64 for a float64 dtype)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (weight.to(acc) * _expand(weight_scale_inv.to(acc), BLOCK, BLOCK, weight.shape)).to(dtype)


def fp8_quantize_per_token_group_reference(x: Tensor, group_size: int = 128) -> tuple[Tensor, Tensor]:
    k = x.shape[-1]
    x2 = x.float().reshape(-1, k)
    blocks, scale = _scaled_blocks(x2, 1, group_size)
    q = _to_fp8(blocks, scale, x2.shape)
    return q.view(x.shape), scale.view(*x.shape[:-1], scale.shape[-1])


def fp8_block_linear_reference(x: Tensor, weight: Tensor, weight_scale_inv: Tensor,
                               bias: Optional[Tensor] = None) -> Tensor:
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > DECODE_MAX_M:
        q, scale = fp8_quantize_per_token_group_reference(x2, BLOCK)
        x2 = q.to(acc) * _expand(scale.to(acc), 1, BLOCK, q.shape)
    y = F.linear(x2.to(acc), dequantize_weight_fp8_block(weight, weight_scale_inv, acc),
                 None if bias is None else bias.to(acc))
    return y.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def fp8_supported(device: torch.device) -> bool:
    """Whether the FP8 kernels run on ``device``: a GPU of compute capability 8.9 or newer, or the
    CPU under the Triton interpreter."""
    return kernels.fp8_supported(device)


def check_fp8_device(op: str, x: Tensor, name: str = "x"):
    """The FP8 kernels' GPU: x (called ``name``) on one of compute capability 8.9 or newer where it is on CUDA."""
    if x.is_cuda and not kernels.fp8_supported(x.device):
        major, minor = torch.cuda.get_device_capability(x.device)
        fail(op, f"{name} is on a GPU of compute capability {major}.{minor}; the FP8 kernels need 8.9 or newer")


def _check_quantize(x, group_size):
    op = "fp8_quantize_per_token_group"
    check_float(op, "x", x)
    check_fp8_device(op, x)
    if x.shape[-1] == 0:
        fail(op, "x's last dim (K) must be positive")
    if group_size not in GROUP_SIZES:
        fail(op, f"group_size must be a power of two from {GROUP_SIZES[0]} to {GROUP_SIZES[-1]}, got {group_size}")


def check_fp8_weight(op: str, x: Tensor, name: str, weight: Tensor, weight_scale_inv: Tensor):
    """`name` [N, K] float8_e4m3fn (last dim contiguous) with its scales `<name>_scale_inv`
    [cdiv(N, 128), cdiv(K, 128)] fp32 or bf16, both on x's device, where the FP8 kernels must run
    (a GPU of compute capability 8.9 or newer). Shared by the ops that take FP8 weights
    (`fp8_block_linear`, the fused decode ops)."""
    scale_name = name + "_scale_inv"
    check_fp8_device(op, x)
    if weight.dtype != torch.float8_e4m3fn:
        fail(op, f"{name} must be float8_e4m3fn, got {weight.dtype}")
    if weight.dim() != 2 or (weight.stride(-1) != 1 and weight.shape[-1] > 1):
        fail(op, f"{name} must be [N, K], contiguous in its last dim, got shape {tuple(weight.shape)} "
                 f"strides {weight.stride()}")
    if weight_scale_inv.dtype not in SCALE_DTYPES:
        fail(op, f"{scale_name} must be float32 or bfloat16, got {weight_scale_inv.dtype}")
    blocks = (cdiv(weight.shape[0], BLOCK), cdiv(weight.shape[1], BLOCK))
    if tuple(weight_scale_inv.shape) != blocks:
        fail(op, f"{scale_name} must have shape {blocks} (blocks of {BLOCK} x {BLOCK} of {name} "
                 f"{tuple(weight.shape)}), got {tuple(weight_scale_inv.shape)}")
    for t_name, t in ((name, weight), (scale_name, weight_scale_inv)):
        if t.device != x.device:
            fail(op, f"{t_name} is on {t.device} but x is on {x.device}")


def _check_linear(x, weight, weight_scale_inv, bias):
    op = "fp8_block_linear"
    check_float(op, "x", x)
    check_fp8_weight(op, x, "weight", weight, weight_scale_inv)
    n, k = weight.shape
    if k != x.shape[-1]:
        fail(op, f"weight is {tuple(weight.shape)} ([N, K]) but x's last dim is {x.shape[-1]}")
    if k == 0:
        fail(op, "x's last dim (K) must be positive")
    if bias is not None:
        check_float(op, "bias", bias, ndim=1)
        check_same(op, "x", x, bias=bias)
        if bias.shape[0] != n:
            fail(op, f"bias has {bias.shape[0]} elements but weight has N={n} rows")


def _fake_quantize(x, group_size):
    return (x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
            x.new_empty((*x.shape[:-1], cdiv(x.shape[-1], group_size)), dtype=torch.float32))


fp8_quantize_per_token_group = define(fp8_quantize_per_token_group_reference, kernels.quantize_per_token_group,
                                      check=_check_quantize, fake=_fake_quantize)

fp8_block_linear = define(fp8_block_linear_reference, kernels.block_linear, check=_check_linear,
                          fake=lambda x, weight, weight_scale_inv, bias: x.new_empty((*x.shape[:-1], weight.shape[0])))
