"""FP8 weights: Qwen's FP8 checkpoints as they are, or a checkpoint quantised as it loads
(``quantization="fp8"``), in the block format of those checkpoints.

A linear weight W [N, K] (a layer's ``linear_weights``, a sparse MLP's shared expert) stays FP8
where the kernels take it (``keeps_fp8``): W holds float8_e4m3fn, ``W_scale_inv`` [cdiv(N_8, 128),
cdiv(K, 128)] fp32 the factor that multiplies each 128 x 128 block back (w = W * W_scale_inv per
block), and ``W_tail`` [N - N_8, K] (model dtype, or None) the trailing rows the checkpoint keeps
unquantised (Qwen3.5's Gated DeltaNet in_proj_b and in_proj_a):

    linear(h, W) = cat(fp8_block_linear(h, W, W_scale_inv, bias[:N_8]), linear(h, W_tail, bias[N_8:]))

A fused decode step (``kernels="fused"``) passes the scales to the fused decode ops, which read the
FP8 weight as it is; a tail takes a second ``norm_linear`` (``norm_linear`` here). Which decode
kernels take FP8 weights: ``DecoderLayer.supports_fused_decode`` and
``QwenForCausalLM.supports_persistent_decode``.

A mixture-of-experts layer's experts X [E, N, K] (``SparseMoeBlock.EXPERT_WEIGHTS``) stay FP8 there
too, expert by expert in the same format: X float8_e4m3fn, ``X_scale_inv`` [E, cdiv(N, 128),
cdiv(K, 128)] fp32, both passed to ``fused_moe`` (weight-only: the activations are not quantised).

Where ``keeps_fp8`` is false, and where a weight's parts do not stack into one block grid
(``modeling.model.loader``), an FP8 weight is dequantised as it loads into the model's dtype.
"""
from typing import Iterable, Optional

import torch
from torch import Tensor, nn

import qwen_ops
from qwen_ops.registry import runs_kernels

ops = torch.ops.qwen

BLOCK = 128
"""The side of a quantisation block (``weight_block_size`` [128, 128])."""


def keeps_fp8(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether FP8 weights stay FP8 in a model of ``dtype`` on ``device``: where the ops run their
    Triton kernels and those take FP8 (not the CPU's reference ops, float64 models, GPUs before
    compute capability 8.9; there the weights are dequantised)."""
    return runs_kernels(device.type, dtype) and qwen_ops.fp8_supported(device)


def linear(h: Tensor, weight: Tensor, bias: Optional[Tensor] = None, scale_inv: Optional[Tensor] = None,
           tail: Optional[Tensor] = None) -> Tensor:
    """``linear(h, weight, bias)``, or with ``scale_inv`` the FP8 weight's (module doc)."""
    if scale_inv is None:
        return ops.linear(h, weight, bias)
    n8 = weight.shape[0]
    y = ops.fp8_block_linear(h, weight, scale_inv, None if bias is None else bias[:n8])
    if tail is None:
        return y
    return torch.cat([y, ops.linear(h, tail, None if bias is None else bias[n8:])], dim=-1)


def norm_linear(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, offset: float,
                scale_inv: Optional[Tensor] = None, tail: Optional[Tensor] = None) -> Tensor:
    """``norm_linear(x, norm_weight, weight, bias, eps, offset)`` (the fused decode op), or with
    ``scale_inv`` the FP8 weight's, its tail through a second ``norm_linear``."""
    if tail is None:
        return ops.norm_linear(x, norm_weight, weight, bias, eps, offset, scale_inv)
    n8 = weight.shape[0]
    y = ops.norm_linear(x, norm_weight, weight, None if bias is None else bias[:n8], eps, offset, scale_inv)
    return torch.cat([y, ops.norm_linear(x, norm_weight, tail, None if bias is None else bias[n8:], eps, offset)],
                     dim=-1)


def register_parts(module: nn.Module, linears: Iterable[str] = (), experts: Iterable[str] = ()) -> None:
    """The FP8 parts of ``module``'s weights, None until the loader sets them: ``<name>_scale_inv``
    and ``<name>_tail`` of each linear weight, ``<name>_scale_inv`` of each experts' weight."""
    for name in linears:
        module.register_parameter(name + "_scale_inv", None)
        module.register_parameter(name + "_tail", None)
    for name in experts:
        module.register_parameter(name + "_scale_inv", None)


def module_linear(module: nn.Module, h: Tensor, name: str, bias: Optional[Tensor] = None) -> Tensor:
    """``linear(h, <name>, bias)`` of ``module``'s linear weight ``name``, FP8 or not (its parts as
    ``register_parts`` names them)."""
    scale_inv, tail = getattr(module, name + "_scale_inv"), getattr(module, name + "_tail")
    return linear(h, getattr(module, name), bias, scale_inv, tail)


def module_gate_up_silu(module: nn.Module, h: Tensor) -> Tensor:
    """``silu_mul(linear(h, gate_up_weight))`` of ``module``'s gate_up weight: one GEMM with the
    SwiGLU in its epilogue (``linear_silu_mul``, inference only) for a 16-bit weight outside
    autograd, else the two ops (``module_linear``, whose FP8 path and backward they have)."""
    weight = module.gate_up_weight
    needs_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)
    if module.gate_up_weight_scale_inv is None and not needs_grad:
        return ops.linear_silu_mul(h, weight)
    return ops.silu_mul(module_linear(module, h, "gate_up_weight"))


def quantize(weight: Tensor) -> tuple[Tensor, Tensor]:
    """weight [..., N, K] -> (float8_e4m3fn [..., N, K], scale_inv fp32 [..., cdiv(N, 128), cdiv(K, 128)])
    (``qwen_ops.quantize_weight_fp8_block``; fused experts: one leading dim, quantised expert by expert)."""
    if weight.dim() == 2:
        return qwen_ops.quantize_weight_fp8_block(weight)
    parts = [quantize(w) for w in weight]
    return torch.stack([w for w, _ in parts]), torch.stack([s for _, s in parts])


def dequantize(weight: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    """weight [..., N, K] float8_e4m3fn with scale_inv [..., cdiv(N, 128), cdiv(K, 128)] -> [..., N, K]
    in ``dtype`` (fused experts: one leading dim)."""
    if weight.dim() == 2:
        return qwen_ops.dequantize_weight_fp8_block(weight, scale_inv.float(), torch.float32).to(dtype)
    return torch.stack([dequantize(w, s, dtype) for w, s in zip(weight, scale_inv)])
