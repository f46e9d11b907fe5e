"""qwen::decode_hybrid_layers: every layer of Qwen3.5's hybrid decoder (Gated DeltaNet and gated
attention layers, dense MLPs) for one decode step, in one persistent kernel
(csrc_free_ops/decode_hybrid_layers.py).

    decode_hybrid_layers(x, positions, cache_seqlens, block_table, state_slots, layer_kinds,
                         input_norm, post_norm, gate_up_weight, down_weight,
                         qkv_weight, q_norm, k_norm, o_weight, k_cache, v_cache,
                         in_proj_weight, conv_weight, A_log, dt_bias, norm_weight, out_weight,
                         conv_states, ssm_states, eps, offset, theta, rotary_dim, num_heads, num_splits)
        -> x after the last layer

x [M, H] (M <= 8; M = 0: nothing to do): the new token of each sequence; positions [M] int32/int64,
cache_seqlens [M] int32 (the cached positions including the new one; 0: a padding row),
block_table [M, max_blocks] int32, state_slots [M] int64 (each sequence's recurrent-state slot).
layer_kinds [NL]: ATTENTION (0) or GATED_DELTANET (1) per layer; NA and NG layers of each kind.

Every layer: input_norm, post_norm [NL, H], gate_up_weight [NL, 2I, H], down_weight [NL, H, I].
Gated attention (the attention layers in order): qkv_weight [NA, (2Hq + 2Hk) D, H] (q_proj's rows
per head [query D | gate D], then k, v), q_norm, k_norm [NA, D], o_weight [NA, H, Hq D]; the paged
cache k_cache, v_cache [NA, NB, BS, Hk, D] (decode_layers' layout). Gated DeltaNet (its layers in
order; Hk' key heads of Dk, Hv value heads of Dv, Kd = Hk' Dk, Vd = Hv Dv, C = 2Kd + Vd channels, a
conv of K taps): in_proj_weight [NG, C + Vd + 2Hv, H] (rows qkv | z | b | a), conv_weight
[NG, C, K], A_log, dt_bias [NG, Hv] (any float dtype), norm_weight [NG, Dv], out_weight [NG, H, Vd];
the pool's slots conv_states [NG, P, C, K-1] (x's dtype) and ssm_states [NG, P, Hv, Dk, Dv] (fp32;
float64 for float64 x), both contiguous. num_splits (>= 1) splits each (sequence, kv head)'s
attention as decode_layers' does; the result does not depend on it beyond fp32 rounding.

By definition, per layer (the reference composes the ops' references; each row is a sequence of
one token that continues its slot where cache_seqlens > 1, else starts from zeros):

    attention:  qkv = linear(rms_norm(x, input_norm), qkv_weight); q, gate, k, v = its heads
                q, k = rope(q, k, positions, theta, rotary_dim, q_norm, k_norm, eps, offset)
                kv_cache_store_slots(k, v, ...); o = paged_attention(q, ...) (scale D^-0.5)
                x = linear_residual(sigmoid_mul(o, gate), o_weight, x)
    deltanet:   proj = linear(rms_norm(x, input_norm), in_proj_weight); qkv, z, b, a = its columns
                y = causal_conv1d(qkv, conv_weight, conv_states, ...) (update form, one token)
                o = recurrent_gated_delta_rule_varlen(q, k, v of y, a, b, A_log, dt_bias,
                                                      ssm_states, ..., scale Dk^-0.5, l2-normed q, k)
                x = linear_residual(gated_rms_norm(o, z, norm_weight, eps), out_weight, x)
    then        x = linear_residual(norm_gate_up_silu(x, post_norm, gate_up_weight, eps, offset), down_weight, x)

Mutates k_cache, v_cache (the new keys and values at their positions, where the position is below
cache_seqlens and within the block table's reach), conv_states and ssm_states (row state_slots[m]
of each layer, where cache_seqlens[m] > 0 and the slot lies in [0, P)): a padding row writes
nothing. The first call of each shape puts the kernel's layer plan on the device: make it outside
a CUDA graph capture (as the engine's warm-up steps do). No autograd: inference decode only.
"""
from typing import List

import torch
from torch import Tensor

from csrc_free_ops import decode_hybrid_layers as kernels
from csrc_free_ops.decode_hybrid_layers import ATTENTION, GATED_DELTANET

from .activation import sigmoid_mul_reference
from .causal_conv1d import causal_conv1d_reference
from .checks import check_float, check_head_dim, check_same, fail
from .decode_layers import check_cache_values, check_kv_caches, check_rows, check_stacked, check_step
from .fused_decode import linear_residual_reference, norm_gate_up_silu_reference
from .gated_delta_rule import gated_rms_norm_reference, recurrent_gated_delta_rule_varlen_reference
from .linear import linear_reference
from .norm import rms_norm_reference
from .paged_attention import kv_cache_store_slots_reference, paged_attention_reference
from .registry import define
from .rope import rope_reference


def _with_scratch_slot(pool: Tensor, run) -> None:
    """run(pool with one more, scratch, row), then the pool's rows copied back: the rows of the
    reference's padding sequences go to the scratch row."""
    extended = torch.cat([pool, pool.new_zeros((1, *pool.shape[1:]))])
    run(extended)
    pool.copy_(extended[:-1])


def decode_hybrid_layers_reference(
    x: Tensor, positions: Tensor, cache_seqlens: Tensor, block_table: Tensor, state_slots: Tensor,
    layer_kinds: List[int], input_norm: Tensor, post_norm: Tensor, gate_up_weight: Tensor, down_weight: Tensor,
    qkv_weight: Tensor, q_norm: Tensor, k_norm: Tensor, o_weight: Tensor, k_cache: Tensor, v_cache: Tensor,
    in_proj_weight: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor, norm_weight: Tensor,
    out_weight: Tensor, conv_states: Tensor, ssm_states: Tensor, eps: float, offset: float, theta: float,
    rotary_dim: int, num_heads: int, num_splits: int = 1,
) -> Tensor:
    """x [M, H] -> x after every layer [M, H], by the module doc's composition, layer by layer in
    layer_kinds' order (the a-th attention layer reads [a] of the attention stacks, the g-th Gated
    DeltaNet layer [g] of its own). A row that writes no state (cache_seqlens 0, or a slot outside
    the pool) runs from zero states in a scratch slot."""
    m = x.shape[0]
    bs, hk, d = k_cache.shape[2:]
    pos = positions.long()
    lens = cache_seqlens.long()
    reach = (pos >= 0) & (pos < lens) & (pos < block_table.shape[1] * bs)
    rows = torch.arange(m, device=x.device)
    blocks = block_table[rows, pos.clamp(0, block_table.shape[1] * bs - 1) // bs].long()
    kv_slots = torch.where(reach, blocks * bs + pos % bs, -1)
    cu = torch.arange(m + 1, dtype=torch.int32, device=x.device)
    pool = conv_states.shape[1]
    keeps = (lens > 0) & (state_slots >= 0) & (state_slots < pool)
    slots = torch.where(keeps, state_slots, pool)  # padding rows: the scratch slot
    continues = lens > 1
    hv, dk, dv = ssm_states.shape[2:]
    vd = hv * dv
    channels = conv_weight.shape[1]
    kd = (channels - vd) // 2
    attention = gated = 0
    for layer, kind in enumerate(layer_kinds):
        h = rms_norm_reference(x, input_norm[layer], eps, offset)
        if kind == GATED_DELTANET:
            g = gated
            gated += 1
            proj = linear_reference(h, in_proj_weight[g])
            y = torch.empty((m, channels), dtype=x.dtype, device=x.device)
            _with_scratch_slot(conv_states[g], lambda c: y.copy_(causal_conv1d_reference(
                proj[:, :channels], conv_weight[g], c, cu, slots, continues)))
            o = torch.empty((m, hv, dv), dtype=x.dtype, device=x.device)
            _with_scratch_slot(ssm_states[g], lambda s: o.copy_(recurrent_gated_delta_rule_varlen_reference(
                y[:, :kd].view(m, kd // dk, dk), y[:, kd:2 * kd].view(m, kd // dk, dk), y[:, 2 * kd:].view(m, hv, dv),
                proj[:, channels + vd + hv:], proj[:, channels + vd:channels + vd + hv], A_log[g], dt_bias[g], s,
                cu, slots, continues, dk ** -0.5, True)))
            o = gated_rms_norm_reference(o, proj[:, channels:channels + vd].view(m, hv, dv), norm_weight[g], eps)
            x = linear_residual_reference(o.reshape(m, vd), out_weight[g], x)
        else:
            a = attention
            attention += 1
            qkv = linear_reference(h, qkv_weight[a])
            q_rows = 2 * num_heads * d
            qg = qkv[:, :q_rows].reshape(m, 1, num_heads, 2 * d)
            k = qkv[:, q_rows:q_rows + hk * d].reshape(m, 1, hk, d)
            v = qkv[:, q_rows + hk * d:].reshape(m, hk, d)
            q, k = rope_reference(qg[..., :d], k, pos[:, None], theta, rotary_dim, q_norm[a], k_norm[a], eps, offset)
            kv_cache_store_slots_reference(k[:, 0], v, k_cache[a], v_cache[a], kv_slots)
            o = paged_attention_reference(q[:, 0], k_cache[a], v_cache[a], cu, cache_seqlens, block_table,
                                          d ** -0.5, 1)
            o = sigmoid_mul_reference(o, qg[:, 0, :, d:])
            x = linear_residual_reference(o.reshape(m, num_heads * d), o_weight[a], x)
        act = norm_gate_up_silu_reference(x, post_norm[layer], gate_up_weight[layer], eps, offset)
        x = linear_residual_reference(act, down_weight[layer], x)
    return x


def _check(x, positions, cache_seqlens, block_table, state_slots, layer_kinds, input_norm, post_norm, gate_up_weight,
           down_weight, qkv_weight, q_norm, k_norm, o_weight, k_cache, v_cache, in_proj_weight, conv_weight, A_log,
           dt_bias, norm_weight, out_weight, conv_states, ssm_states, eps, offset, theta, rotary_dim, num_heads,
           num_splits=1):
    op = "decode_hybrid_layers"
    m, hidden = check_rows(op, x)
    check_same(op, "x", x, input_norm=input_norm, post_norm=post_norm, gate_up_weight=gate_up_weight,
               down_weight=down_weight, qkv_weight=qkv_weight, q_norm=q_norm, k_norm=k_norm, o_weight=o_weight,
               k_cache=k_cache, v_cache=v_cache, in_proj_weight=in_proj_weight, conv_weight=conv_weight,
               norm_weight=norm_weight, out_weight=out_weight, conv_states=conv_states, positions=positions,
               cache_seqlens=cache_seqlens, block_table=block_table, state_slots=state_slots)
    if not layer_kinds or any(kind not in (ATTENTION, GATED_DELTANET) for kind in layer_kinds):
        fail(op, f"layer_kinds must list each layer's kind, {ATTENTION} (attention) or {GATED_DELTANET} "
                 f"(Gated DeltaNet), got {list(layer_kinds)}")
    nl, na = len(layer_kinds), sum(1 for kind in layer_kinds if kind == ATTENTION)
    ng = nl - na
    hk, d = check_kv_caches(op, k_cache, v_cache, f"NA = {na}", na, num_heads)
    check_float(op, "ssm_states", ssm_states, ndim=5)
    check_float(op, "conv_weight", conv_weight, ndim=3)
    if ssm_states.dtype != (torch.float64 if x.dtype == torch.float64 else torch.float32):
        fail(op, f"ssm_states must be float32 (float64 for float64 x), got {ssm_states.dtype}")
    if ssm_states.shape[0] != ng or not ssm_states.is_contiguous():
        fail(op, f"ssm_states must be contiguous [NG = {ng}, P, Hv, Dk, Dv], got {tuple(ssm_states.shape)}")
    _, pool, hv, dk, dv = ssm_states.shape
    for name, dim in (("ssm_states' Dk", dk), ("ssm_states' Dv", dv)):
        check_head_dim(op, dim, name)
    channels, taps = conv_weight.shape[1:]
    kd2 = channels - hv * dv
    if hv == 0 or kd2 <= 0 or kd2 % (2 * dk) or hv % (kd2 // (2 * dk)):
        fail(op, f"conv_weight's {channels} channels must be 2 Hk' Dk + Hv Dv with Hv ({hv}) a multiple of Hk' "
                 f"(Dk {dk}, Dv {dv} from ssm_states)")
    if not 2 <= taps <= 16:
        fail(op, f"the conv kernel size (conv_weight.shape[2]) must be in [2, 16], got {taps}")
    inter = down_weight.shape[-1] if down_weight.dim() == 3 else 0
    if inter == 0:
        fail(op, "down_weight's intermediate size is 0")
    vd = hv * dv
    check_stacked(op, {
        "input_norm": (input_norm, (nl, hidden)), "post_norm": (post_norm, (nl, hidden)),
        "gate_up_weight": (gate_up_weight, (nl, 2 * inter, hidden)), "down_weight": (down_weight, (nl, hidden, inter)),
        "qkv_weight": (qkv_weight, (na, (2 * num_heads + 2 * hk) * d, hidden)), "q_norm": (q_norm, (na, d)),
        "k_norm": (k_norm, (na, d)), "o_weight": (o_weight, (na, hidden, num_heads * d)),
        "in_proj_weight": (in_proj_weight, (ng, channels + vd + 2 * hv, hidden)),
        "conv_weight": (conv_weight, (ng, channels, taps)), "A_log": (A_log, (ng, hv)), "dt_bias": (dt_bias, (ng, hv)),
        "norm_weight": (norm_weight, (ng, dv)), "out_weight": (out_weight, (ng, hidden, vd)),
        "conv_states": (conv_states, (ng, pool, channels, taps - 1))})
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias), ("ssm_states", ssm_states)):  # fp32: not in check_same
        if t.device != x.device:
            fail(op, f"{name} is on {t.device} but x is on {x.device}")
    check_step(op, m, positions, cache_seqlens, block_table, theta, rotary_dim, d, num_splits)
    if state_slots.dtype != torch.int64 or tuple(state_slots.shape) != (m,):
        fail(op, f"state_slots must be int64 of shape ({m},), got {state_slots.dtype} {tuple(state_slots.shape)}")
    if m > 1 and state_slots.stride(0) != 1:
        fail(op, f"state_slots must be contiguous (the kernel reads row m at m), got strides {state_slots.stride()}")


def _check_values(x, positions, cache_seqlens, block_table, state_slots, layer_kinds, *rest):
    """CPU tensors only (the kernel clamps lengths and skips writes outside the table and the pool;
    two rows that write one state slot would race)."""
    check_cache_values("decode_hybrid_layers", cache_seqlens, block_table, rest[8])
    writing = state_slots[cache_seqlens > 0].tolist()
    if len(set(writing)) < len(writing):
        fail("decode_hybrid_layers", f"state_slots must differ between the rows with cache_seqlens > 0 (each writes its "
                                     f"slot), got {state_slots.tolist()} for cache_seqlens {cache_seqlens.tolist()}")


decode_hybrid_layers = define(decode_hybrid_layers_reference, kernels.decode_hybrid_layers, check=_check,
                              fake=lambda x, *rest: torch.empty_like(x),
                              mutates_args=("k_cache", "v_cache", "conv_states", "ssm_states"),
                              check_values=_check_values, traceable=False)
