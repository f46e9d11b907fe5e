"""qwen::decode_layers: every layer of an attention-only Qwen decoder (Qwen3, Qwen2/2.5) for one
decode step, in one persistent kernel (csrc_free_ops/decode_layers.py).

    decode_layers(x, positions, cache_seqlens, block_table, input_norm, qkv_weight, qkv_bias,
                  q_norm, k_norm, o_weight, post_norm, gate_up_weight, down_weight, k_cache, v_cache,
                  eps, offset, theta, rotary_dim, num_heads, num_splits, qkv_weight_scale_inv=None,
                  o_weight_scale_inv=None, gate_up_weight_scale_inv=None, down_weight_scale_inv=None)
        -> x after the last layer

x [M, H]: the new token of each of M <= 8 sequences (M = 0: nothing to do) (the embeddings); positions [M] int32/int64 its
position; cache_seqlens [M] int32 the cached positions including it; the paged cache k_cache,
v_cache [NL, NB, BS, Hk, D] with block_table [M, max_blocks] int32 (position p of sequence m at
block block_table[m, p // BS], offset p % BS: the engine's layout, one block table for every
layer; a contiguous [NL, B, L, Hk, D] cache is NB = B, BS = L, block_table[m] = [m]). The weights
are the layers' stacked [NL, ...]: input_norm, post_norm [NL, H]; qkv_weight [NL, (Hq + 2Hk) D, H],
qkv_bias [NL, (Hq + 2Hk) D] or None; q_norm, k_norm [NL, D] or None (both or neither); o_weight
[NL, H, Hq D]; gate_up_weight [NL, 2I, H]; down_weight [NL, H, I]. num_splits (>= 1) splits each
(sequence, kv head)'s attention; the result does not depend on it beyond fp32 rounding. FP8
weights: the four linear weights float8_e4m3fn, each with its stacked block scales
``<name>_scale_inv`` [NL, cdiv(N, 128), cdiv(K, 128)] fp32 or bf16 (all four or none; Qwen's
block format, ``fp8_block_linear``), on a GPU of compute capability 8.9 or newer; the math is
the fused decode ops' over the dequantised weights (x is never quantised).

By definition, per layer l (the reference composes the ops' references):

    qkv = linear(rms_norm(x, input_norm[l]), qkv_weight[l], qkv_bias[l]); q, k, v = its heads
    q, k = rope(q, k, positions, theta, rotary_dim, q_norm[l], k_norm[l], eps, offset)
    kv_cache_store_slots(k, v, k_cache[l], v_cache[l], slots of positions)
    x = linear_residual(paged_attention(q, k_cache[l], v_cache[l], ..., cache_seqlens, block_table), o_weight[l], x)
    x = linear_residual(norm_gate_up_silu(x, post_norm[l], gate_up_weight[l]), down_weight[l], x)

Mutates k_cache and v_cache (the new tokens' keys and values at their positions). A row writes
only where its position is below its cache_seqlens and within the block table's reach, so a
padding row of a captured step (cache_seqlens 0, whatever its block table row holds) writes
nothing. No autograd: inference decode only.
"""
from typing import Optional

import torch
from torch import Tensor

from csrc_free_ops import decode_layers as kernels
from csrc_free_ops.common import cdiv
from csrc_free_ops.decode_layers import MAX_ROWS
from csrc_free_ops.decode_layers import default_splits as decode_layers_splits  # noqa: F401  (exported)

from .checks import check_float, check_head_dim, check_index, check_same, fail
from .fp8 import BLOCK as FP8_BLOCK, SCALE_DTYPES, check_fp8_device
from .fused_decode import (linear_residual_reference, norm_gate_up_silu_reference, norm_linear_reference,
                           reserve_semaphores)
from .paged_attention import kv_cache_store_slots_reference, paged_attention_reference
from .registry import define
from .rope import rope_reference


def decode_layers_reference(
    x: Tensor, positions: Tensor, cache_seqlens: Tensor, block_table: Tensor, input_norm: Tensor, qkv_weight: Tensor,
    qkv_bias: Optional[Tensor], q_norm: Optional[Tensor], k_norm: Optional[Tensor], o_weight: Tensor,
    post_norm: Tensor, gate_up_weight: Tensor, down_weight: Tensor, k_cache: Tensor, v_cache: Tensor, eps: float,
    offset: float, theta: float, rotary_dim: int, num_heads: int, num_splits: int = 1,
    qkv_weight_scale_inv: Optional[Tensor] = None, o_weight_scale_inv: Optional[Tensor] = None,
    gate_up_weight_scale_inv: Optional[Tensor] = None, down_weight_scale_inv: Optional[Tensor] = None,
) -> Tensor:
    m = x.shape[0]
    bs, hk, d = k_cache.shape[2:]
    pos = positions.long()
    reach = (pos >= 0) & (pos < cache_seqlens.long()) & (pos < block_table.shape[1] * bs)
    rows = torch.arange(m, device=x.device)
    blocks = block_table[rows, pos.clamp(0, block_table.shape[1] * bs - 1) // bs].long()
    slots = torch.where(reach, blocks * bs + pos % bs, -1)
    cu = torch.arange(m + 1, dtype=torch.int32, device=x.device)
    q_rows = num_heads * d
    scales = (qkv_weight_scale_inv, o_weight_scale_inv, gate_up_weight_scale_inv, down_weight_scale_inv)
    for layer in range(qkv_weight.shape[0]):
        bias = qkv_bias[layer] if qkv_bias is not None else None
        s_qkv, s_o, s_gu, s_down = (t[layer] if t is not None else None for t in scales)
        qkv = norm_linear_reference(x, input_norm[layer], qkv_weight[layer], bias, eps, offset, s_qkv)
        q = qkv[:, :q_rows].reshape(m, 1, num_heads, d)
        k = qkv[:, q_rows:q_rows + hk * d].reshape(m, 1, hk, d)
        v = qkv[:, q_rows + hk * d:].reshape(m, hk, d)
        q, k = rope_reference(q, k, pos[:, None], theta, rotary_dim, q_norm[layer] if q_norm is not None else None,
                              k_norm[layer] if k_norm is not None else None, eps, offset)
        kv_cache_store_slots_reference(k[:, 0], v, k_cache[layer], v_cache[layer], slots)
        o = paged_attention_reference(q[:, 0], k_cache[layer], v_cache[layer], cu, cache_seqlens, block_table,
                                      d ** -0.5, 1)
        x = linear_residual_reference(o.reshape(m, q_rows), o_weight[layer], x, s_o)
        h = norm_gate_up_silu_reference(x, post_norm[layer], gate_up_weight[layer], eps, offset, s_gu)
        x = linear_residual_reference(h, down_weight[layer], x, s_down)
    return x


def check_rows(op: str, x: Tensor) -> tuple:
    """x [M, H], M <= MAX_ROWS, contiguous: (M, H)."""
    check_float(op, "x", x, ndim=2)
    if x.shape[0] > MAX_ROWS:
        fail(op, f"x must hold at most {MAX_ROWS} rows (one new token per sequence), got {x.shape[0]}")
    if not x.is_contiguous():
        fail(op, f"x must be contiguous, got strides {x.stride()}")
    return tuple(x.shape)


def check_kv_caches(op: str, k_cache: Tensor, v_cache: Tensor, layers: str, num_layers: Optional[int],
                    num_heads: int) -> tuple:
    """k_cache and v_cache [``layers``, NB, BS, Hk, D] alike, contiguous over [BS, Hk, D] (with
    ``num_layers`` layers, when given), num_heads a multiple of Hk: (Hk, D)."""
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(op, name, t, ndim=5)
        if t.shape != k_cache.shape or (num_layers is not None and t.shape[0] != num_layers) or \
                t.stride(3) != t.shape[4] or t.stride(2) != t.shape[3] * t.shape[4]:
            fail(op, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be "
                     f"[{layers}, NB, BS, Hk, D], contiguous over [BS, Hk, D] and with the same strides")
    if k_cache.stride() != v_cache.stride():
        fail(op, f"k_cache and v_cache must have the same strides, got {k_cache.stride()} and {v_cache.stride()}")
    hk, d = k_cache.shape[3:]
    check_head_dim(op, d)
    if num_heads <= 0 or hk == 0 or num_heads % hk:
        fail(op, f"num_heads ({num_heads}) must be a positive multiple of the cache's kv heads ({hk})")
    return hk, d


def check_stacked(op: str, shapes: dict, fp8: tuple = ()) -> None:
    """Each tensor of ``shapes`` (name -> (tensor or None, shape)) a float tensor (those named in
    ``fp8``: float8_e4m3fn, their dtype checked by ``check_fp8_stacks``), contiguous, of that shape."""
    for name, (t, shape) in shapes.items():
        if t is None:
            continue
        if name not in fp8:
            check_float(op, name, t)
        if tuple(t.shape) != shape or not t.is_contiguous():
            fail(op, f"{name} must be contiguous with shape {shape} (layers stacked), got {tuple(t.shape)}")


def check_step(op: str, m: int, positions: Tensor, cache_seqlens: Tensor, block_table: Tensor, theta: float,
               rotary_dim: int, head_dim: int, num_splits: int) -> None:
    """The step's rows (positions, cache_seqlens [M] int32, contiguous; block_table [M, max_blocks] int32),
    RoPE and the attention splits."""
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        fail(op, f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    if not 0.0 < theta < float("inf"):
        fail(op, f"theta (the RoPE base) must be positive and finite, got {theta}")
    if not 1 <= num_splits <= 64:
        fail(op, f"num_splits must be in [1, 64], got {num_splits}")
    check_index(op, "positions", positions, (m,))
    check_index(op, "cache_seqlens", cache_seqlens, (m,))
    for name, t in (("positions", positions), ("cache_seqlens", cache_seqlens)):
        if m > 1 and t.stride(0) != 1:
            fail(op, f"{name} must be contiguous (the kernel reads row m at m), got strides {t.stride()}")
    if cache_seqlens.dtype != torch.int32 or block_table.dtype != torch.int32:
        fail(op, f"cache_seqlens and block_table must be int32, got {cache_seqlens.dtype} and {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != m or block_table.shape[1] == 0 or block_table.stride(1) != 1:
        fail(op, f"block_table must be [{m}, max_blocks] (max_blocks > 0) with unit stride over blocks, got "
                 f"{tuple(block_table.shape)}")


LINEAR_WEIGHTS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
"""The linear weights of a layer, in the order of their optional ``*_scale_inv`` arguments (FP8)."""


def check_fp8_stacks(op: str, x: Tensor, weights: dict, scales: dict) -> None:
    """All or none of the weights' FP8 scales (``scales``: weight name -> its ``<name>_scale_inv``
    or None): with them, each weight [NL, N, K] is float8_e4m3fn, its scales [NL, cdiv(N, 128),
    cdiv(K, 128)] fp32 or bf16, contiguous, on x's device, and x's GPU takes FP8."""
    given = [name for name, t in scales.items() if t is not None]
    if given and len(given) != len(scales):
        fail(op, f"give the FP8 scales of all of {', '.join(scales)} (the *_scale_inv arguments), or none; "
                 f"got {', '.join(n + '_scale_inv' for n in given)}")
    if not given:
        return
    check_fp8_device(op, x)
    for name, t in scales.items():
        w = weights[name]
        if w.dtype != torch.float8_e4m3fn or w.dim() != 3 or w.device != x.device:
            fail(op, f"{name} must be float8_e4m3fn [NL, N, K] on {x.device} where {name}_scale_inv is given, "
                     f"got {w.dtype} {tuple(w.shape)} on {w.device}")
        shape = (w.shape[0], cdiv(w.shape[1], FP8_BLOCK), cdiv(w.shape[2], FP8_BLOCK))
        if t.dtype not in SCALE_DTYPES or tuple(t.shape) != shape or not t.is_contiguous() or t.device != x.device:
            fail(op, f"{name}_scale_inv must be float32 or bfloat16, contiguous, with shape {shape} on {x.device} "
                     f"(a block scale of {name} per {FP8_BLOCK} x {FP8_BLOCK}), got {t.dtype} {tuple(t.shape)} "
                     f"on {t.device}")


def _check(x, positions, cache_seqlens, block_table, input_norm, qkv_weight, qkv_bias, q_norm, k_norm, o_weight,
           post_norm, gate_up_weight, down_weight, k_cache, v_cache, eps, offset, theta, rotary_dim, num_heads,
           num_splits=1, qkv_weight_scale_inv=None, o_weight_scale_inv=None, gate_up_weight_scale_inv=None,
           down_weight_scale_inv=None):
    op = "decode_layers"
    m, hidden = check_rows(op, x)
    weights = dict(zip(LINEAR_WEIGHTS, (qkv_weight, o_weight, gate_up_weight, down_weight)))
    check_fp8_stacks(op, x, weights, dict(zip(LINEAR_WEIGHTS, (qkv_weight_scale_inv, o_weight_scale_inv,
                                                                gate_up_weight_scale_inv, down_weight_scale_inv))))
    fp8 = qkv_weight_scale_inv is not None
    check_same(op, "x", x, input_norm=input_norm, qkv_bias=qkv_bias, q_norm=q_norm, k_norm=k_norm,
               post_norm=post_norm, k_cache=k_cache, v_cache=v_cache, positions=positions,
               cache_seqlens=cache_seqlens, block_table=block_table,
               **({name: w for name, w in weights.items() if not fp8}))
    hk, d = check_kv_caches(op, k_cache, v_cache, "NL", None, num_heads)
    nl = k_cache.shape[0]
    if nl == 0:
        fail(op, "the model has no layers (k_cache's dim 0 is 0)")
    nqkv = (num_heads + 2 * hk) * d
    inter = down_weight.shape[-1] if down_weight.dim() == 3 else 0
    check_stacked(op, {"input_norm": (input_norm, (nl, hidden)), "qkv_weight": (qkv_weight, (nl, nqkv, hidden)),
                       "qkv_bias": (qkv_bias, (nl, nqkv)), "q_norm": (q_norm, (nl, d)), "k_norm": (k_norm, (nl, d)),
                       "o_weight": (o_weight, (nl, hidden, num_heads * d)), "post_norm": (post_norm, (nl, hidden)),
                       "gate_up_weight": (gate_up_weight, (nl, 2 * inter, hidden)),
                       "down_weight": (down_weight, (nl, hidden, inter))}, LINEAR_WEIGHTS if fp8 else ())
    if inter == 0:
        fail(op, "down_weight's intermediate size is 0")
    if (q_norm is None) != (k_norm is None):
        fail(op, "give both q_norm and k_norm, or neither")
    check_step(op, m, positions, cache_seqlens, block_table, theta, rotary_dim, d, num_splits)


def check_cache_values(op: str, cache_seqlens, block_table, k_cache) -> None:
    """CPU tensors only (on CUDA the kernel clamps lengths and skips writes outside the table): the
    lengths within the block table's reach, the blocks a sequence reads within the cache k_cache
    [NL, NB, BS, ...]."""
    reach = block_table.shape[1] * k_cache.shape[2]
    if not cache_seqlens.numel():
        return
    if int(cache_seqlens.min()) < 0 or int(cache_seqlens.max()) > reach:
        fail(op, f"cache_seqlens must lie in [0, {reach}] (the block table's reach)")
    read = torch.arange(block_table.shape[1])[None, :] * k_cache.shape[2] < cache_seqlens[:, None].long()
    used = block_table[read]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= k_cache.shape[1]):
        fail(op, f"block_table entries a sequence reads must lie in [0, {k_cache.shape[1]})")


def _check_values(x, positions, cache_seqlens, block_table, *rest):
    check_cache_values("decode_layers", cache_seqlens, block_table, rest[9])


decode_layers = define(decode_layers_reference, kernels.decode_layers, check=_check,
                       fake=lambda x, *rest: torch.empty_like(x), mutates_args=("k_cache", "v_cache"),
                       check_values=_check_values, traceable=False)


def reserve_decode_buffers(device) -> None:
    """Create the decode kernels' per-device buffers (the split-K arrival counters of the fused
    decode ops, the persistent kernel's watchdog flag): before capturing a CUDA graph of a step
    that runs them, never inside one."""
    reserve_semaphores(device)
    kernels.error_flag(torch.device(device))
