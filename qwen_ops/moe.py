"""Mixture of experts: qwen::moe_topk_softmax, qwen::moe_align_block_size, qwen::fused_moe.

    moe_topk_softmax(router_logits [M, E], top_k, renormalize) -> (weights [M, k] fp32, ids [M, k] int32)
        p = softmax(router_logits) in fp32; the top_k largest p of a row, largest first, ties to the
        lower expert id; weights / sum(weights) when renormalize.
    moe_align_block_size(topk_ids [M, k], num_experts, block_size)
        -> (sorted_token_ids [P] int32, expert_ids [P / BM] int32, num_tokens_post_padded [1] int32):
        the pairs i = token * k + j grouped by expert (increasing i within one), each expert's run
        padded to a multiple of block_size with the sentinel M * k; P = M * k + E * (BM - 1).
    fused_moe(hidden_states [M, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [M, k], topk_ids [M, k],
              shared_output [M, H] = None, shared_gate [M, 1] = None,
              w13_scale_inv [E, cdiv(2I, 128), cdiv(H, 128)] = None,
              w2_scale_inv [E, cdiv(H, 128), cdiv(I, 128)] = None) -> [M, H]
        sum_j topk_weights[:, j] * down_e(silu(gate_e(x)) * up_e(x)) for e = topk_ids[:, j]
        (+ sigmoid(shared_gate) * shared_output), w13[e] = [gate; up] (transformers' gate_up_proj).
        FP8 experts: a weight given with its scales (fp32) is float8_e4m3fn in the block format of
        Qwen's FP8 checkpoints, expert by expert (qwen::fp8_block_linear's weight and
        weight_scale_inv); the math is weight-only, on dequant(w13[e]) and dequant(w2[e]), the
        activations as they are (not quantised).

The references round where the kernels store: silu(gate) * up to x's dtype, each pair's weighted
down projection to x's dtype, the sum (fp32) and the shared expert's term at the end; FP8 experts
are dequantised (`dequantize_weight_fp8_block`, in fp32) expert by expert first. Inference
only: no autograd. Top-k ids outside [0, E) are rejected on the CPU; on CUDA such a pair adds nothing.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import moe as kernels
from csrc_free_ops.common import FP8_BLOCK, cdiv

from .checks import INDEX_DTYPES, check_float, check_same, fail
from .fp8 import check_fp8_device, dequantize_weight_fp8_block
from .registry import acc_dtype, define, to_dtype

MAX_EXPERTS = kernels.MAX_EXPERTS
"""The most experts the router and the experts' kernels take (modeling.config refuses more)."""


def moe_topk_softmax_reference(router_logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    p = torch.softmax(router_logits.to(acc_dtype(router_logits)), dim=-1)
    values, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    weights = values[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.float().contiguous(), ids[:, :top_k].to(torch.int32).contiguous()


def moe_align_block_size_reference(topk_ids: Tensor, num_experts: int,
                                   block_size: int) -> tuple[Tensor, Tensor, Tensor]:
    flat = topk_ids.reshape(-1).long()
    numel, dev = flat.numel(), flat.device
    padded_size, blocks = kernels.sorted_sizes(numel, num_experts, block_size)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_size - 1) // block_size * block_size
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(numel, device=dev) - (counts.cumsum(0) - counts)[experts]
    sorted_ids = torch.full((padded_size,), numel, dtype=torch.int32, device=dev)
    sorted_ids[starts[experts] + rank] = order.to(torch.int32)
    total = int(ends[-1])
    first_rows = torch.arange(blocks, device=dev) * block_size
    expert_ids = torch.searchsorted(ends, first_rows, right=True).to(torch.int32)
    expert_ids[first_rows >= total] = -1
    return sorted_ids, expert_ids, torch.tensor([total], dtype=torch.int32, device=dev)


def _expert(w: Tensor, scale_inv: Optional[Tensor], e: int, dtype: torch.dtype) -> Tensor:
    """Expert e's weight w[e] in dtype, dequantised when it is FP8 (scale_inv given)."""
    return to_dtype(w[e], dtype) if scale_inv is None else dequantize_weight_fp8_block(w[e], scale_inv[e], dtype)


def fused_moe_reference(hidden_states: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                        shared_output: Optional[Tensor] = None, shared_gate: Optional[Tensor] = None,
                        w13_scale_inv: Optional[Tensor] = None, w2_scale_inv: Optional[Tensor] = None) -> Tensor:
    dt, dtype = acc_dtype(hidden_states), hidden_states.dtype
    m, h = hidden_states.shape
    top_k = topk_ids.shape[1]
    x = to_dtype(hidden_states, dt)
    y = torch.zeros((m * top_k, h), dtype=dt, device=x.device)  # each pair's weighted output, rounded
    pair_ids = topk_ids.reshape(-1).long()
    for e in pair_ids.unique().tolist():
        pairs = (pair_ids == e).nonzero()[:, 0]
        gate, up = F.linear(x[pairs // top_k], _expert(w13, w13_scale_inv, e, dt)).chunk(2, dim=-1)
        act = to_dtype(to_dtype(F.silu(gate) * up, dtype), dt)
        down = F.linear(act, _expert(w2, w2_scale_inv, e, dt)) * to_dtype(topk_weights.reshape(-1)[pairs], dt)[:, None]
        y[pairs] = to_dtype(to_dtype(down, dtype), dt)
    out = y.view(m, top_k, h).sum(1)
    if shared_output is not None:
        out = out + torch.sigmoid(to_dtype(shared_gate, dt)) * to_dtype(shared_output, dt)
    return to_dtype(out, dtype)


def _check_topk_softmax(router_logits, top_k, renormalize):
    op = "moe_topk_softmax"
    check_float(op, "router_logits", router_logits, ndim=2)
    e = router_logits.shape[1]
    if not 1 <= e <= MAX_EXPERTS:
        fail(op, f"router_logits has {e} experts (columns): 1 to {MAX_EXPERTS} are supported")
    if not 1 <= top_k <= e:
        fail(op, f"top_k must be in [1, {e}] (the experts), got {top_k}")


def _check_ids(op: str, topk_ids: Tensor, shape: Optional[tuple] = None):
    if topk_ids.dtype not in INDEX_DTYPES:
        fail(op, f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.dim() != 2 or not topk_ids.is_contiguous():
        fail(op, f"topk_ids must be a contiguous [M, top_k] tensor, got shape {tuple(topk_ids.shape)} "
                 f"strides {topk_ids.stride()}")
    if shape is not None and topk_ids.shape != shape:
        fail(op, f"topk_ids has shape {tuple(topk_ids.shape)} but topk_weights has {tuple(shape)}")


def _check_id_values(op: str, topk_ids: Tensor, num_experts: int):
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        fail(op, f"topk_ids must be in [0, {num_experts}) (the experts), got values from {int(topk_ids.min())} "
                 f"to {int(topk_ids.max())}")


def _check_align(topk_ids, num_experts, block_size):
    op = "moe_align_block_size"
    _check_ids(op, topk_ids)
    if not 1 <= num_experts <= MAX_EXPERTS:
        fail(op, f"num_experts must be in [1, {MAX_EXPERTS}], got {num_experts}")
    if block_size < 16 or block_size > 256 or block_size & (block_size - 1):
        fail(op, f"block_size must be a power of two from 16 to 256, got {block_size}")


def _fake_align(topk_ids, num_experts, block_size):
    padded, blocks = kernels.sorted_sizes(topk_ids.numel(), num_experts, block_size)
    return (topk_ids.new_empty((padded,), dtype=torch.int32), topk_ids.new_empty((blocks,), dtype=torch.int32),
            topk_ids.new_empty((1,), dtype=torch.int32))


def _check_experts(op: str, name: str, w: Tensor, scale_inv: Optional[Tensor], hidden_states: Tensor):
    """w [E, N, K] (last dim contiguous) in hidden_states' dtype, or float8_e4m3fn with scale_inv
    [E, cdiv(N, 128), cdiv(K, 128)] fp32 (last dim contiguous) beside it."""
    if scale_inv is None:
        if w.dtype == torch.float8_e4m3fn:
            fail(op, f"{name} is float8_e4m3fn: its {name}_scale_inv must be given")
        check_float(op, name, w, ndim=3)
        check_same(op, "hidden_states", hidden_states, **{name: w})
        return
    check_fp8_device(op, hidden_states, "hidden_states")
    if w.dtype != torch.float8_e4m3fn:
        fail(op, f"{name} must be float8_e4m3fn where {name}_scale_inv is given, got {w.dtype}")
    if w.dim() != 3 or (w.stride(-1) != 1 and w.shape[-1] > 1):
        fail(op, f"{name} must be [E, N, K], contiguous in its last dim, got shape {tuple(w.shape)} "
                 f"strides {w.stride()}")
    if scale_inv.dtype != torch.float32:
        fail(op, f"{name}_scale_inv must be float32, got {scale_inv.dtype}")
    blocks = (w.shape[0], cdiv(w.shape[1], FP8_BLOCK), cdiv(w.shape[2], FP8_BLOCK))
    if tuple(scale_inv.shape) != blocks or (scale_inv.stride(-1) != 1 and blocks[-1] > 1):
        fail(op, f"{name}_scale_inv must be {blocks} ([E, cdiv(N, {FP8_BLOCK}), cdiv(K, {FP8_BLOCK})] of {name} "
                 f"{tuple(w.shape)}), contiguous in its last dim, got shape {tuple(scale_inv.shape)} strides "
                 f"{scale_inv.stride()}")
    for t, what in ((w, name), (scale_inv, name + "_scale_inv")):
        if t.device != hidden_states.device:
            fail(op, f"{what} is on {t.device} but hidden_states is on {hidden_states.device}")


def _check_fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, shared_output, shared_gate, w13_scale_inv,
                     w2_scale_inv):
    op = "fused_moe"
    check_float(op, "hidden_states", hidden_states, ndim=2)
    _check_experts(op, "w13", w13, w13_scale_inv, hidden_states)
    _check_experts(op, "w2", w2, w2_scale_inv, hidden_states)
    check_float(op, "topk_weights", topk_weights, ndim=2)
    check_same(op, "hidden_states", hidden_states, shared_output=shared_output, shared_gate=shared_gate)
    if topk_weights.device != hidden_states.device:
        fail(op, f"topk_weights is on {topk_weights.device} but hidden_states is on {hidden_states.device}")
    if not topk_weights.is_contiguous():
        fail(op, f"topk_weights must be contiguous, got strides {topk_weights.stride()}")
    _check_ids(op, topk_ids, topk_weights.shape)
    if topk_ids.device != hidden_states.device:
        fail(op, f"topk_ids is on {topk_ids.device} but hidden_states is on {hidden_states.device}")
    m, h = hidden_states.shape
    e, two_i, k = w13.shape
    if k != h or two_i % 2 or two_i == 0:
        fail(op, f"w13 must be [E, 2I, H] with H = {h} (hidden_states' last dim), got {tuple(w13.shape)}")
    if tuple(w2.shape) != (e, h, two_i // 2):
        fail(op, f"w2 must be [E, H, I] = {(e, h, two_i // 2)} (from w13), got {tuple(w2.shape)}")
    if e > MAX_EXPERTS:
        fail(op, f"w13 has {e} experts: at most {MAX_EXPERTS} are supported")
    if topk_weights.shape[0] != m or not 1 <= topk_weights.shape[1] <= e:
        fail(op, f"topk_weights must be [M, top_k] with M = {m} and top_k in [1, {e}], got {tuple(topk_weights.shape)}")
    if (shared_output is None) != (shared_gate is None):
        fail(op, "shared_output and shared_gate are given together or not at all")
    if shared_output is not None:
        if shared_output.shape != hidden_states.shape or not shared_output.is_contiguous():
            fail(op, f"shared_output must be contiguous of hidden_states' shape {(m, h)}, got "
                     f"{tuple(shared_output.shape)} strides {shared_output.stride()}")
        if tuple(shared_gate.shape) != (m, 1):
            fail(op, f"shared_gate must be [M, 1] = {(m, 1)}, got {tuple(shared_gate.shape)}")


moe_topk_softmax = define(
    moe_topk_softmax_reference, kernels.moe_topk_softmax, check=_check_topk_softmax,
    fake=lambda logits, top_k, renormalize: (logits.new_empty((logits.shape[0], top_k), dtype=torch.float32),
                                             logits.new_empty((logits.shape[0], top_k), dtype=torch.int32)))

moe_align_block_size = define(
    moe_align_block_size_reference, kernels.moe_align_block_size, check=_check_align, fake=_fake_align,
    check_values=lambda topk_ids, num_experts, block_size: _check_id_values("moe_align_block_size", topk_ids,
                                                                            num_experts))

fused_moe = define(
    fused_moe_reference, kernels.fused_moe, check=_check_fused_moe,
    fake=lambda hidden_states, *rest: torch.empty_like(hidden_states, memory_format=torch.contiguous_format),
    check_values=lambda hidden_states, w13, w2, topk_weights, topk_ids, *rest: _check_id_values(
        "fused_moe", topk_ids, w13.shape[0]))
