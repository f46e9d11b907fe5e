"""The hybrid persistent decode kernel: one launch runs every layer of Qwen3.5's decoder (Gated
DeltaNet and gated attention layers in any order, dense MLPs) for one new token of each of M
sequences (M <= 8). The scheduling, waits, tiles and the attention and MLP tasks are those of
csrc_free_ops/decode_layers.py (read its docstring); this file adds the Gated DeltaNet layer
(tasks in decode_hybrid_layers_tasks.py) and layers of two kinds.

The step is an ordered list of tasks, per layer (see qwen_ops/decode_hybrid_layers.py for the
arguments):

    Gated DeltaNet (layer l, its g-th of the kind)
    in_proj    NP / RP tiles: proj[m, rows] = rms_norm(x[m]) @ in_proj_weight[g, rows]^T, rounded
    conv       C / RC tiles of channels: y = silu(conv of the slot's last K-1 inputs and proj[m, :C]),
               the conv state shifted in place
    delta      M x Hv x (Dv / BV) tasks: the recurrent gated delta rule step of (m, value head,
               value block) on its fp32 state slice, in place
    out        H / RW tiles: h[m, rows] = x[m, rows] + gated_rms_norm(o[m], z[m]) @ out_weight[g, rows]^T
    gated attention (layer l, its a-th of the kind)
    qkv, attn, o    decode_layers' tasks, the attention task GATED (q_proj's rows per head
                    [query | gate], the output times sigmoid(gate) before o_proj)
    every layer
    gate_up, down   decode_layers' MLP tasks

Phases are numbered over the whole step, layer after layer (six for a Gated DeltaNet layer, five
for an attention layer), so a layer's first task waits on the phase just before its own: the
layer before's down. The launcher's plan [NL + 1, 4] int32 gives each layer (its first task,
its first phase, its kind, its index among the layers of its kind); row NL holds the step's task
and phase counts. A program walks its tasks in order and advances its layer as it goes.

With csrc_free_ops.decode_layers.timeline set, task t (of the whole step's list, `step_tasks`)
stamps %globaltimer at timeline[3t], [3t + 1] and [3t + 2] as decode_layers' tasks do.
"""
import math
import os

import torch
import triton.language as tl

from .common import INTERPRET, LOG2E, cdiv, fp32, kernel, next_power_of_2, softmax_headroom
from .decode_hybrid_layers_tasks import _conv_task, _delta_rule_task, _gated_out_task
from .decode_layers import (BLOCK_T, MAX_ROWS, NUM_WARPS, SPIN_LIMIT, error_flag, launch, tile_rows,  # noqa: F401
                            timeline_stamps)
from .decode_layers_tasks import _attention_task, _gate_up_task, _qkv_task, _residual_task, _stamp

ATTENTION = 0
GATED_DELTANET = 1
"""The layer kinds (layer_kinds' values)."""

PHASES = {ATTENTION: 5, GATED_DELTANET: 6}
"""Phases of a layer of each kind."""

CONV_CHANNELS = 32 if INTERPRET else int(os.environ.get("QWEN_DECODE_HYBRID_CONV_CHANNELS", "128"))
"""Channels of a conv task (a power of two)."""

KV_BLOCK_ELEMS = BLOCK_T * 128
"""Elements (positions x padded head dim) of an attention task's step over the cache: decode_layers'
BLOCK_T positions at head dims up to 128, 16 at Qwen3.5's 256 (the split's first block of keys and
values stays in registers across the wait; 32 positions of 256 spill: `kv_block`)."""

VALUE_BLOCK = 16 if INTERPRET else int(os.environ.get("QWEN_DECODE_HYBRID_VALUE_BLOCK", "32"))
"""State columns (of Dv) of a delta rule task at most (a power of two): a [Dk, VALUE_BLOCK] fp32 slice."""

@kernel
def _decode_hybrid_layers_kernel(
    x_ptr, out_ptr, pos_ptr, seqlens_ptr, bt_ptr, slot_ptr, plan_ptr,
    in_norm_ptr, post_norm_ptr, gu_w_ptr, down_w_ptr,
    qkv_w_ptr, qn_ptr, kn_ptr, o_w_ptr, kc_ptr, vc_ptr,
    in_w_ptr, conv_w_ptr, alog_ptr, dtb_ptr, gn_ptr, out_w_ptr, conv_ptr, state_ptr,
    qkv_ptr, attn_ptr, proj_ptr, y_ptr, dr_ptr, h_ptr, act_ptr, po_ptr, plse_ptr, cnt_ptr, err_ptr, tl_ptr,
    M, NL, P, stride_bt, stride_kl, stride_kb, stride_kt, stride_kh, CACHE_LEN, BS,
    eps, offset, log2_theta, qk_scale, dk_scale,
    H: tl.constexpr, I: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    HKL: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, RQ: tl.constexpr, RO: tl.constexpr, RP: tl.constexpr, RC: tl.constexpr,
    BV: tl.constexpr, RW: tl.constexpr, RG: tl.constexpr, RD: tl.constexpr, S: tl.constexpr,
    BLOCK_T: tl.constexpr, HEADROOM: tl.constexpr, P_SCALE: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    TIMELINE: tl.constexpr,
):
    eps, offset, log2_theta, qk_scale, dk_scale = fp32(eps), fp32(offset), fp32(log2_theta), fp32(qk_scale), \
        fp32(dk_scale)
    NQKV: tl.constexpr = (2 * HQ + 2 * HK) * D
    HO: tl.constexpr = HQ * D
    VD: tl.constexpr = HV * DV
    C: tl.constexpr = 2 * HKL * DK + VD
    NP: tl.constexpr = C + VD + 2 * HV
    NV: tl.constexpr = (DV + BV - 1) // BV
    N_QKV: tl.constexpr = (NQKV + RQ - 1) // RQ
    N_O: tl.constexpr = (H + RO - 1) // RO
    N_P: tl.constexpr = (NP + RP - 1) // RP
    N_C: tl.constexpr = (C + RC - 1) // RC
    N_W: tl.constexpr = (H + RW - 1) // RW
    N_GU: tl.constexpr = (I + RG - 1) // RG
    N_DN: tl.constexpr = (H + RD - 1) // RD
    n_attn = M * HK * S
    n_delta = M * HV * NV
    total = tl.load(plan_ptr + NL * 4)
    arr_base = cnt_ptr + tl.load(plan_ptr + NL * 4 + 1)  # the split arrivals, after the phase counters
    layer = 0
    nxt = tl.load(plan_ptr + 4)  # the first task of layer + 1
    done = -1  # the highest phase this program has seen complete
    for t in range(tl.program_id(0), total, tl.num_programs(0)):
        stamp = tl_ptr + t * 3
        _stamp(stamp, TIMELINE)
        while t >= nxt:
            layer += 1
            nxt = tl.load(plan_ptr + (layer + 1) * 4)
        row = plan_ptr + layer * 4
        j = t - tl.load(row)
        ph = tl.load(row + 1)
        deltanet = tl.load(row + 2) == 1  # GATED_DELTANET
        idx = tl.load(row + 3).to(tl.int64)
        if layer == 0:  # the layer's input: the embeddings, then the output of the layer before
            x_in = x_ptr
        else:
            x_in = out_ptr
        if deltanet:
            n_mix = N_P + N_C + n_delta + N_W
            mph = ph + 3
        else:
            n_mix = N_QKV + n_attn + N_O
            mph = ph + 2
        if j < n_mix:
            if deltanet:
                if j < N_P:
                    done = _qkv_task(x_in, in_norm_ptr + layer * H, in_w_ptr + idx * (NP * H), in_w_ptr, in_w_ptr,
                                     proj_ptr, cnt_ptr, err_ptr, j * RP, M, ph, N_DN, done, eps, offset, NP, H, False,
                                     BLOCK_M, RP, False, SPIN_LIMIT, stamp, TIMELINE)
                elif j < N_P + N_C:
                    done = _conv_task(proj_ptr, conv_w_ptr + idx * (C * K), conv_ptr + idx * P * (C * (K - 1)),
                                      slot_ptr, seqlens_ptr, y_ptr, cnt_ptr, err_ptr, (j - N_P) * RC, M, P, ph, N_P,
                                      done, NP, C, K, BLOCK_M, RC, SPIN_LIMIT, stamp, TIMELINE)
                elif j < N_P + N_C + n_delta:
                    d_id = j - N_P - N_C  # (m, value head, value block), the block fastest
                    done = _delta_rule_task(y_ptr, proj_ptr, alog_ptr + idx * HV, dtb_ptr + idx * HV,
                                            state_ptr + idx * P * (HV * DK * DV), slot_ptr, seqlens_ptr, dr_ptr,
                                            cnt_ptr, err_ptr, d_id // (HV * NV), (d_id // NV) % HV, (d_id % NV) * BV,
                                            M, P, ph + 1, N_C, done, dk_scale, NP, HKL, HV, DK, DV, BV, SPIN_LIMIT,
                                            stamp, TIMELINE)
                else:
                    done = _gated_out_task(dr_ptr, proj_ptr, gn_ptr + idx * DV, out_w_ptr + idx * (H * VD), x_in,
                                           h_ptr, cnt_ptr, err_ptr, (j - N_P - N_C - n_delta) * RW, M, ph + 2,
                                           n_delta, done, eps, H, NP, C, HV, DV, BLOCK_M, RW, SPIN_LIMIT, stamp,
                                           TIMELINE)
            else:
                if j < N_QKV:
                    done = _qkv_task(x_in, in_norm_ptr + layer * H, qkv_w_ptr + idx * (NQKV * H), qkv_w_ptr,
                                     qkv_w_ptr, qkv_ptr, cnt_ptr, err_ptr, j * RQ, M, ph, N_DN, done, eps, offset,
                                     NQKV, H, False, BLOCK_M, RQ, False, SPIN_LIMIT, stamp, TIMELINE)
                elif j < N_QKV + n_attn:
                    a_id = j - N_QKV  # (m, g, s), s fastest
                    done = _attention_task(qkv_ptr, qn_ptr + idx * D, kn_ptr + idx * D, pos_ptr, seqlens_ptr,
                                           bt_ptr, kc_ptr + idx * stride_kl, vc_ptr + idx * stride_kl, attn_ptr,
                                           po_ptr, plse_ptr, arr_base + idx * (M * HK), cnt_ptr, err_ptr,
                                           a_id // (HK * S), (a_id // S) % HK, a_id % S, ph + 1, N_QKV, done,
                                           stride_bt, stride_kb, stride_kt, stride_kh, CACHE_LEN, BS,
                                           eps, offset, log2_theta, qk_scale, HQ, HK, D, ROT, True, True, S,
                                           BLOCK_T, HEADROOM, P_SCALE, SPIN_LIMIT, stamp, TIMELINE)
                else:
                    done = _residual_task(attn_ptr, o_w_ptr + idx * (H * HO), o_w_ptr, x_in, h_ptr, cnt_ptr,
                                          err_ptr, (j - N_QKV - n_attn) * RO, M, ph + 1, M * HK, done, H, HO, BLOCK_M,
                                          RO, False, SPIN_LIMIT, stamp, TIMELINE)
        elif j < n_mix + N_GU:
            done = _gate_up_task(h_ptr, post_norm_ptr + layer * H, gu_w_ptr + layer.to(tl.int64) * (2 * I * H),
                                 gu_w_ptr, act_ptr, cnt_ptr, err_ptr, (j - n_mix) * RG, M, mph,
                                 tl.where(deltanet, N_W, N_O), done, eps, offset, I, H, BLOCK_M, RG, False, SPIN_LIMIT,
                                 stamp, TIMELINE)
        else:
            done = _residual_task(act_ptr, down_w_ptr + layer.to(tl.int64) * (H * I), down_w_ptr, h_ptr, out_ptr,
                                  cnt_ptr, err_ptr, (j - n_mix - N_GU) * RD, M, mph + 1, N_GU, done, H, I, BLOCK_M, RD,
                                  False, SPIN_LIMIT, stamp, TIMELINE)
        _stamp(stamp + 2, TIMELINE)


def kv_block(d: int) -> int:
    """Cached positions per step of an attention task over heads of d (KV_BLOCK_ELEMS, at least 16)."""
    return max(16, min(BLOCK_T, KV_BLOCK_ELEMS // next_power_of_2(d)))


def tile_plan(h: int, inter: int, nqkv: int, attn_width: int, nproj: int, channels: int, hv: int, dv: int,
              itemsize: int) -> dict:
    """The rows (channels, state columns) of each task kind's tile: RQ qkv, RO o_proj, RP in_proj,
    RC conv, BV delta rule, RW out_proj (its K laid out [Hv, Dv] by heads; half a tile's elements,
    as each row's normed and gated input is built in registers beside it: a whole tile spills at
    eight rows), RG gate_up (of each half), RD down."""
    return dict(RQ=tile_rows(nqkv, h, itemsize), RO=tile_rows(h, attn_width, itemsize),
                RP=tile_rows(nproj, h, itemsize), RC=min(CONV_CHANNELS, next_power_of_2(channels)),
                BV=min(VALUE_BLOCK, next_power_of_2(dv)),
                RW=tile_rows(h, 2 * next_power_of_2(hv) * next_power_of_2(dv), itemsize),
                RG=tile_rows(2 * inter, h, itemsize) // 2 or 1, RD=tile_rows(h, inter, itemsize))


def phase_tasks(tiles: dict, m: int, h: int, inter: int, nqkv: int, hk: int, splits: int, nproj: int, channels: int,
                hv: int, dv: int) -> dict:
    """Tasks a layer of each kind has in each of its phases, in the task list's order."""
    mlp = [cdiv(inter, tiles["RG"]), cdiv(h, tiles["RD"])]
    return {ATTENTION: [cdiv(nqkv, tiles["RQ"]), m * hk * splits, cdiv(h, tiles["RO"])] + mlp,
            GATED_DELTANET: [cdiv(nproj, tiles["RP"]), cdiv(channels, tiles["RC"]), m * hv * cdiv(dv, tiles["BV"]),
                             cdiv(h, tiles["RW"])] + mlp}


def step_tasks(m: int, layer_kinds, down_weight, k_cache, in_proj_weight, conv_weight, ssm_states, num_heads: int,
               num_splits: int) -> tuple:
    """(tiles, tasks) of a step of m rows over the op's weights and caches: `tile_plan`'s dict, and
    the tasks of each phase of each layer ([NL] lists of PHASES[kind] counts, in the task list's
    order: layer l's tasks start at the sum of the layers' before, as the plan's rows say)."""
    h, inter = down_weight.shape[1:]
    hk, d = k_cache.shape[3:]
    _, _, hv, _, dv = ssm_states.shape
    channels, nproj = conv_weight.shape[1], in_proj_weight.shape[1]
    nqkv = (2 * num_heads + 2 * hk) * d
    tiles = tile_plan(h, inter, nqkv, num_heads * d, nproj, channels, hv, dv, down_weight.element_size())
    kinds = phase_tasks(tiles, m, h, inter, nqkv, hk, num_splits, nproj, channels, hv, dv)
    return tiles, [kinds[kind] for kind in layer_kinds]


def plan(layer_kinds, tasks: list) -> list:
    """The kernel's plan rows (see the module doc) from `step_tasks`' tasks: per layer (first task,
    first phase, kind, index among its kind), then (tasks, phases, 0, 0)."""
    rows, task, phase, seen = [], 0, 0, {ATTENTION: 0, GATED_DELTANET: 0}
    for kind, counts in zip(layer_kinds, tasks):
        rows.append([task, phase, kind, seen[kind]])
        seen[kind] += 1
        task += sum(counts)
        phase += PHASES[kind]
    return rows + [[task, phase, 0, 0]]


_plans: dict = {}  # (device, plan rows) -> the plan on the device


def _device_plan(rows: list, device: torch.device) -> torch.Tensor:
    """The plan as an int32 tensor on the device, made once per plan (a captured step reads the
    one its first eager call made)."""
    key = (device, tuple(map(tuple, rows)))
    t = _plans.get(key)
    if t is None:
        t = _plans[key] = torch.tensor(rows, dtype=torch.int32, device=device)
    return t


def decode_hybrid_layers(x, positions, cache_seqlens, block_table, state_slots, layer_kinds, input_norm, post_norm,
                         gate_up_weight, down_weight, qkv_weight, q_norm, k_norm, o_weight, k_cache, v_cache,
                         in_proj_weight, conv_weight, A_log, dt_bias, norm_weight, out_weight, conv_states,
                         ssm_states, eps: float, offset: float, theta: float, rotary_dim: int, num_heads: int,
                         num_splits: int):
    m, h = x.shape
    nl = len(layer_kinds)
    inter = down_weight.shape[2]
    _, _, bs, hk, d = k_cache.shape
    _, pool, hv, dk, dv = ssm_states.shape
    channels, taps = conv_weight.shape[1:]
    nproj = in_proj_weight.shape[1]
    hkl = (channels - hv * dv) // (2 * dk)
    nqkv = qkv_weight.shape[1]
    out = torch.empty_like(x)
    if m == 0:
        return out
    dev = x.device
    tiles, tasks = step_tasks(m, layer_kinds, down_weight, k_cache, in_proj_weight, conv_weight, ssm_states,
                              num_heads, num_splits)
    rows = plan(layer_kinds, tasks)
    stamps = timeline_stamps(rows[-1][0], dev)
    group = num_heads // hk
    na = sum(1 for kind in layer_kinds if kind == ATTENTION)
    counters = torch.zeros(rows[-1][1] + na * m * hk, dtype=torch.int32, device=dev)
    scratch = dict(dtype=x.dtype, device=dev)
    parts = torch.empty((m * hk * num_splits * group, d) if num_splits > 1 else (0, d), dtype=torch.float32,
                        device=dev)
    headroom = softmax_headroom(k_cache.dtype)
    args = (x, out, positions, cache_seqlens, block_table, state_slots, _device_plan(rows, dev),
            input_norm, post_norm, gate_up_weight, down_weight, qkv_weight, q_norm, k_norm, o_weight, k_cache, v_cache,
            in_proj_weight, conv_weight, A_log, dt_bias, norm_weight, out_weight, conv_states, ssm_states,
            torch.empty((m, nqkv), **scratch), torch.empty((m, num_heads * d), **scratch),
            torch.empty((m, nproj), **scratch), torch.empty((m, channels), **scratch),
            torch.empty((m, hv * dv), **scratch), torch.empty((m, h), **scratch), torch.empty((m, inter), **scratch),
            parts, torch.empty(parts.shape[:1], dtype=torch.float32, device=dev),
            counters, error_flag(dev), stamps if stamps is not None else counters,
            m, nl, pool, block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.stride(3), block_table.shape[1] * bs, bs, eps, offset, math.log2(theta), d ** -0.5 * LOG2E,
            dk ** -0.5)
    meta = dict(H=h, I=inter, HQ=num_heads, HK=hk, D=d, ROT=rotary_dim, HKL=hkl, HV=hv, DK=dk, DV=dv, K=taps,
                BLOCK_M=next_power_of_2(m), **tiles, S=num_splits, BLOCK_T=kv_block(d), HEADROOM=headroom,
                P_SCALE=2.0 ** -headroom, SPIN_LIMIT=SPIN_LIMIT, TIMELINE=stamps is not None, num_warps=NUM_WARPS,
                num_stages=1)
    launch(_decode_hybrid_layers_kernel, args, meta, dev)
    return out
