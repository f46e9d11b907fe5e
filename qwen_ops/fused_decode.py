"""The fused decode ops: one weight read per op, with the small ops around it folded in.

Each is, by definition, the composition of existing ops (its reference composes their
references, with the same rounding to the model dtype between them):

    norm_linear(x, norm_weight, weight, bias, eps, offset)
        = linear(rms_norm(x, norm_weight, eps, offset), weight, bias)          x [..., K] -> [..., N]
    linear_residual(x, weight, residual)
        = residual + linear(x, weight)   (add_rms_norm's sum, rounded)        x [..., K] -> [..., N]
    norm_gate_up_silu(x, norm_weight, gate_up_weight, eps, offset)
        = silu_mul(linear(rms_norm(x, norm_weight, eps, offset), gate_up_weight))   -> [..., I]
    norm_qkv_rope_store(x, norm_weight, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight,
                        k_cache, v_cache, positions, slot_mapping, eps, offset, theta, rotary_dim,
                        num_heads, gated)
        = qkv = linear(rms_norm(x), qkv_weight, qkv_bias); q, k, v = the heads of qkv;
          q, k = rope(q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight, eps, offset);
          kv_cache_store_slots(k, v, k_cache, v_cache, slot_mapping); returns q [N, Hq, D]
          x [N, K], positions and slot_mapping [N], the paged caches [num_blocks, block_size, Hk, D]
          (with `gated`, qkv's query rows hold per head [query | gate] and the result is
          [N, Hq, 2D]: the rotated query, then the gate as the projection gave it).

FP8 weights: each op takes its weight's scales as its last, optional argument (`weight_scale_inv`,
`gate_up_weight_scale_inv`, `qkv_weight_scale_inv`). Given, the weight is float8_e4m3fn [N, K] in
`fp8_block_linear`'s block format (scales [cdiv(N, 128), cdiv(K, 128)], fp32 or bf16) and the op
is the same composition over the dequantised weight: the references dequantise it in fp32
(`dequantize_weight_fp8_block`) and go on as above. x is never quantised: `fp8_block_linear`'s
weight-only math at any number of rows (that op quantises x above 16 rows).

The kernels count arrivals in a per-device buffer (`reserve_semaphores(device)` creates it; do
that before capturing a CUDA graph of these ops: the engine's step runner does). They are built for decode (a few rows of x; the kernels in csrc_free_ops/fused_decode.py are
split-K GEMVs) but correct for any number of rows. No autograd: the model uses them only for
inference decode steps.
"""
from typing import Optional

import torch
from torch import Tensor

from csrc_free_ops import fused_decode as kernels
from csrc_free_ops.common import reserve as reserve_semaphores  # noqa: F401  (exported by qwen_ops)

from .activation import silu_mul_reference
from .checks import check_float, check_head_dim, check_index, check_same, fail
from .fp8 import check_fp8_weight, dequantize_weight_fp8_block
from .linear import linear_reference
from .norm import rms_norm_reference
from .paged_attention import kv_cache_store_slots_reference
from .registry import acc_dtype, define, to_dtype
from .rope import check_positions, rope_reference


def _dequantized(weight: Tensor, weight_scale_inv: Optional[Tensor], x: Tensor) -> Tensor:
    """weight, or the FP8 weight times its block scales in x's compute dtype (fp32; float64 for float64 x)."""
    if weight_scale_inv is None:
        return weight
    return dequantize_weight_fp8_block(weight, weight_scale_inv, acc_dtype(x))


def norm_linear_reference(x: Tensor, norm_weight: Tensor, weight: Tensor, bias: Optional[Tensor] = None,
                          eps: float = 1e-6, offset: float = 0.0, weight_scale_inv: Optional[Tensor] = None) -> Tensor:
    return linear_reference(rms_norm_reference(x, norm_weight, eps, offset), _dequantized(weight, weight_scale_inv, x),
                            bias)


def linear_residual_reference(x: Tensor, weight: Tensor, residual: Tensor,
                              weight_scale_inv: Optional[Tensor] = None) -> Tensor:
    dt = acc_dtype(x)
    y = linear_reference(x, _dequantized(weight, weight_scale_inv, x))
    return to_dtype(to_dtype(y, dt) + to_dtype(residual, dt), residual.dtype)


def norm_gate_up_silu_reference(x: Tensor, norm_weight: Tensor, gate_up_weight: Tensor, eps: float = 1e-6,
                                offset: float = 0.0, gate_up_weight_scale_inv: Optional[Tensor] = None) -> Tensor:
    gate_up = _dequantized(gate_up_weight, gate_up_weight_scale_inv, x)
    return silu_mul_reference(linear_reference(rms_norm_reference(x, norm_weight, eps, offset), gate_up))


def norm_qkv_rope_store_reference(
    x: Tensor, norm_weight: Tensor, qkv_weight: Tensor, qkv_bias: Optional[Tensor], q_norm_weight: Optional[Tensor],
    k_norm_weight: Optional[Tensor], k_cache: Tensor, v_cache: Tensor, positions: Tensor, slot_mapping: Tensor,
    eps: float, offset: float, theta: float, rotary_dim: int, num_heads: int, gated: bool = False,
    qkv_weight_scale_inv: Optional[Tensor] = None,
) -> Tensor:
    n = x.shape[0]
    hk, d = k_cache.shape[2:]
    q_rows = num_heads * d * (2 if gated else 1)
    qkv = linear_reference(rms_norm_reference(x, norm_weight, eps, offset),
                           _dequantized(qkv_weight, qkv_weight_scale_inv, x), qkv_bias)
    qg = qkv[..., :q_rows].reshape(n, num_heads, q_rows // num_heads)
    k = qkv[..., q_rows : q_rows + hk * d].reshape(n, hk, d)
    v = qkv[..., q_rows + hk * d :].reshape(n, hk, d)
    q, k = rope_reference(qg[..., :d], k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight, eps, offset)
    kv_cache_store_slots_reference(k, v, k_cache, v_cache, slot_mapping)
    return torch.cat([q, qg[..., d:]], dim=-1) if gated else q


def _check_norm_weight(op: str, x: Tensor, norm_weight: Tensor):
    check_float(op, "norm_weight", norm_weight, ndim=1)
    if norm_weight.shape[0] != x.shape[-1]:
        fail(op, f"norm_weight has {norm_weight.shape[0]} elements but x's last dim is {x.shape[-1]}")


def _check_weight(op: str, x: Tensor, name: str, weight: Tensor, scale_inv: Optional[Tensor], **others):
    """x and the weight `name` [N, K] (FP8 with its `scale_inv`, else of x's dtype), the `others` on
    x's device and of its dtype."""
    check_float(op, "x", x)
    if scale_inv is not None:
        check_fp8_weight(op, x, name, weight, scale_inv)
    elif weight.dtype == torch.float8_e4m3fn:
        fail(op, f"{name} is float8_e4m3fn: pass its {name}_scale_inv")
    else:
        check_float(op, name, weight, ndim=2)
        check_same(op, "x", x, **{name: weight})
    check_same(op, "x", x, **others)
    if x.shape[-1] == 0 or weight.shape[1] != x.shape[-1]:
        fail(op, f"{name} is {tuple(weight.shape)} ([N, K]) but x's last dim is {x.shape[-1]} (K must be positive)")


def _check_norm_linear(x, norm_weight, weight, bias, eps, offset, weight_scale_inv):
    op = "norm_linear"
    _check_weight(op, x, "weight", weight, weight_scale_inv, norm_weight=norm_weight, bias=bias)
    _check_norm_weight(op, x, norm_weight)
    if bias is not None:
        check_float(op, "bias", bias, ndim=1)
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        fail(op, f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")


def _check_linear_residual(x, weight, residual, weight_scale_inv):
    op = "linear_residual"
    _check_weight(op, x, "weight", weight, weight_scale_inv, residual=residual)
    check_float(op, "residual", residual)
    if tuple(residual.shape) != (*x.shape[:-1], weight.shape[0]):
        fail(op, f"residual must have shape {(*x.shape[:-1], weight.shape[0])}, got {tuple(residual.shape)}")


def _check_gate_up(x, norm_weight, gate_up_weight, eps, offset, gate_up_weight_scale_inv):
    op = "norm_gate_up_silu"
    _check_weight(op, x, "gate_up_weight", gate_up_weight, gate_up_weight_scale_inv, norm_weight=norm_weight)
    _check_norm_weight(op, x, norm_weight)
    if gate_up_weight.shape[0] % 2:
        fail(op, f"gate_up_weight needs an even number of rows (gate, then up), got {gate_up_weight.shape[0]}")


def _check_qkv(x, norm_weight, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, k_cache, v_cache, positions,
               slot_mapping, eps, offset, theta, rotary_dim, num_heads, gated, qkv_weight_scale_inv):
    op = "norm_qkv_rope_store"
    check_float(op, "x", x, ndim=2)
    _check_weight(op, x, "qkv_weight", qkv_weight, qkv_weight_scale_inv, norm_weight=norm_weight,
                  qkv_bias=qkv_bias, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, k_cache=k_cache,
                  v_cache=v_cache)
    _check_norm_weight(op, x, norm_weight)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(op, name, c, ndim=4)
    if k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        fail(op, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must both be contiguous "
                 "[num_blocks, block_size, Hk, D]")
    hk, d = k_cache.shape[2:]
    check_head_dim(op, d)
    if num_heads <= 0 or hk == 0 or num_heads % hk:
        fail(op, f"num_heads ({num_heads}) must be a positive multiple of the cache's kv heads ({hk})")
    rows = (num_heads * (2 if gated else 1) + 2 * hk) * d
    if qkv_weight.shape[0] != rows:
        fail(op, f"qkv_weight has {qkv_weight.shape[0]} rows; {num_heads} q heads{' with gates' if gated else ''} "
                 f"and {hk} kv heads of {d} need {rows}")
    for name, t in (("qkv_bias", qkv_bias), ("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if t is not None:
            check_float(op, name, t, ndim=1)  # read with unit stride
    if qkv_bias is not None and tuple(qkv_bias.shape) != (rows,):
        fail(op, f"qkv_bias must have shape ({rows},), got {tuple(qkv_bias.shape)}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        fail(op, "give both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is not None and tuple(w.shape) != (d,):
            fail(op, f"{name} must have shape ({d},), got {tuple(w.shape)}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > d:
        fail(op, f"rotary_dim must be even and in (0, head_dim={d}], got {rotary_dim}")
    if not 0.0 < theta < float("inf"):
        fail(op, f"theta (the RoPE base) must be positive and finite, got {theta}")
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        check_index(op, name, t, x.shape[:1])
        if t.device != x.device:
            fail(op, f"{name} is on {t.device} but x is on {x.device}")


def _fake_qkv(x, norm_weight, qkv_weight, qkv_bias, q_norm_weight, k_norm_weight, k_cache, v_cache, positions,
              slot_mapping, eps, offset, theta, rotary_dim, num_heads, gated, qkv_weight_scale_inv):
    return x.new_empty((x.shape[0], num_heads, (2 if gated else 1) * k_cache.shape[3]))


# The launchers count arrivals in a per-device buffer outside the op's arguments
# (`common.semaphores`): torch.compile keeps these ops opaque (traceable=False).
norm_linear = define(norm_linear_reference, kernels.norm_linear, check=_check_norm_linear,
                     fake=lambda x, norm_weight, weight, *rest: x.new_empty((*x.shape[:-1], weight.shape[0])),
                     traceable=False)

linear_residual = define(linear_residual_reference, kernels.linear_residual, check=_check_linear_residual,
                         fake=lambda x, weight, residual, weight_scale_inv: torch.empty_like(
                             residual, memory_format=torch.contiguous_format),
                         traceable=False)

norm_gate_up_silu = define(norm_gate_up_silu_reference, kernels.norm_gate_up_silu, check=_check_gate_up,
                           fake=lambda x, nw, w, *rest: x.new_empty((*x.shape[:-1], w.shape[0] // 2)),
                           traceable=False)

norm_qkv_rope_store = define(norm_qkv_rope_store_reference, kernels.norm_qkv_rope_store, check=_check_qkv,
                             fake=_fake_qkv, mutates_args=("k_cache", "v_cache"), traceable=False,
                             check_values=lambda *args: check_positions(args[8], "norm_qkv_rope_store"))
