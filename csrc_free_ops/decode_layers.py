"""The persistent decode kernel: one launch runs every layer of an attention-only Qwen decoder
(Qwen3, Qwen2/2.5) for one new token of each of M sequences (M <= 8), instead of six kernels per layer.

x [M, H] (the embeddings of the new tokens) -> x after the last layer [M, H]; the layers' keys
and values of the new tokens go into the paged cache k_cache/v_cache [NL, NB, BS, Hk, D] (a
sequence's position p lives in block block_table[m, p // BS] at offset p % BS; the Generator's
contiguous cache [NL, B, L, Hk, D] is the case NB = B, BS = L, block_table[m] = [m]).

The step is an ordered list of tasks, per layer (NL layers, weights stacked [NL, ...]):

    qkv      NQKV / RQ tiles: qkv[m, rows] = rms_norm(x[m]) @ qkv_weight[rows]^T (+ bias), rounded
    attn     M x Hk x S tasks: (m, kv head g, split s): the group's q heads and head g's k get the
             per-head RMSNorm and RoPE, k and v are written at the token's position, and the split's
             share of the cached positions [0, seq_len) is attended (online softmax, base 2); with
             S > 1 the last split of (m, g) to arrive combines the S partial results
    o        H / RO tiles: h[m, rows] = x[m, rows] + o[m] @ o_weight[rows]^T
    gate_up  I / RG tiles: act[m, rows] = silu(g) * u, g and u the tile's rows of
             rms_norm(h[m]) @ gate_up_weight^T (gate rows, then up rows I + rows)
    down     H / RD tiles: x[m, rows] = h[m, rows] + act[m] @ down_weight[rows]^T

with the rounding of the fused decode ops (csrc_free_ops/fused_decode.py) at the same points, so
the result equals their composition up to the order of fp32 sums.

Scheduling. Task t (layer-major, then the order above) belongs to program t % P; a program runs
its tasks in order. P is the number of programs that fit on the device at once (`programs`:
occupancy from the compiled kernel's registers and shared memory), and the launch is cooperative
(`launch_cooperative_grid`), so a grid that cannot be co-resident fails instead of hanging. A
task depends only on the phase before it, whose tasks come earlier in the list, so the tasks
always complete. Each phase (layer, kind) has a completion counter: a task's program issues the
loads of its whole weight tile (an attention task: its split's first block of cached keys and
values), then waits until the counter of the phase before reaches that
phase's task count (an acquire load in a loop; skipped when the program already saw it), then
reads its inputs, computes, stores, and counts itself in (a barrier, then a release add). So a
program streams the weights of its next task while the phase before finishes. Activations are
read with `.cg` (through L2, where the other programs' stores are). A wait that spins past
SPIN_LIMIT polls sets the device's error flag (`error_flag`, never cleared by the kernel) and goes
on, so a broken schedule shows up as a flagged, wrong result instead of a hung device.

Tiles hold their whole K in registers (rows x next_power_of_2(K) elements, `TILE_ELEMS`): one
tile's loads go out together, before the wait. Every GEMV is elementwise products and a row sum in
fp32 (M = 1..8 rows: no tensor-core tile would be full); attention uses tl.dot over a 16-row block
of the group's heads.

Under the interpreter programs run one after another, so a spin-wait on a later program would
never end: P = 1 there, and that program meets every dependency in task order.
"""
import math
import os

import torch
import triton
import triton.language as tl

from .common import (INTERPRET, LOG2E, arrive, cdiv, cuda_properties, device_buffer, dot, fp32, head_block, head_mask,
                     kernel, next_power_of_2, softmax_headroom)
from .rope import rotary_cos_sin

PHASES = tl.constexpr(5)
"""Phases per layer: qkv, attention, o, gate_up, down."""

SPIN_LIMIT = 1 << 22
"""Polls of a completion counter before a wait gives up (seconds of spinning: far past any real wait)."""

TILE_ELEMS = 1024 if INTERPRET else int(os.environ.get("QWEN_DECODE_LAYERS_TILE_ELEMS", "16384"))
"""Weight elements per GEMV tile (32 KB of bf16: 64 registers a thread at four warps; small under
the interpreter, so the tests' small layers still have several tiles per phase)."""

BLOCK_T = 32
"""Cached positions per step of an attention task's loop (one tensor-core block of keys)."""

MAX_ROWS = 8
"""Sequences per launch at most (each tile loops over its rows with the weights in registers)."""

timeline = None
"""None, or an int64 CUDA tensor of 3 x (the call's tasks: `phase_tasks`) elements: then each task t
stamps %globaltimer (ns) at timeline[3t] when it starts, [3t + 1] when its wait is met and
[3t + 2] when it ends (`python -m bench.decode_layers --timeline`; a kernel compiled with the
stamps, not the op's default)."""


@triton.jit
def _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """Wait until counter[phase] >= target unless phase <= done (this program saw it complete
    already, or phase < 0: nothing to wait for); returns the phases this program knows complete.
    TIMELINE: stamps the time the wait was met at stamp_ptr[1]."""
    if phase > done:
        seen = tl.atomic_add(cnt_ptr + phase, 0, sem="acquire", scope="gpu")
        spins = 0
        while (seen < target) & (spins < SPIN_LIMIT):
            seen = tl.atomic_add(cnt_ptr + phase, 0, sem="acquire", scope="gpu")
            spins += 1
        if seen < target:
            tl.atomic_xchg(err_ptr, 1, sem="relaxed", scope="gpu")
    if TIMELINE:
        tl.store(stamp_ptr + 1, _now())
    return tl.maximum(done, phase)


@triton.jit
def _now():
    """The SM's %globaltimer, ns (the timeline's clock; CUDA only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _finish(cnt_ptr, phase):
    """Count a task of `phase` in once every thread's stores are done (barrier, then a release add)."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + phase, 1, sem="release", scope="gpu")


@triton.jit
def _weight_tile(w_ptr, row0, N, K, stride_n, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """weight[row0:row0 + ROWS, :K] as [ROWS, BLOCK_K], zero outside [N, K]."""
    rn = row0 + tl.arange(0, ROWS)
    rk = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_n + rk[None, :],
                   mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)


@triton.jit
def _row(ptr, K, BLOCK_K: tl.constexpr):
    """An activation row [BLOCK_K] in fp32 (zero past K), read through L2."""
    rk = tl.arange(0, BLOCK_K)
    return tl.load(ptr + rk, mask=rk < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _normed_row(ptr, nw_ptr, K, eps, offset, w_dtype: tl.constexpr, BLOCK_K: tl.constexpr):
    """(a, rstd) of rms_norm(x) = rstd * a: a = x * (norm weight + offset), rounded to the weight
    dtype for bf16 weights as fused_decode's main loop rounds it (fp16 and fp32 keep it fp32)."""
    x = _row(ptr, K, BLOCK_K)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
    rk = tl.arange(0, BLOCK_K)
    a = x * (tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32) + offset)
    if w_dtype == tl.bfloat16:
        a = a.to(tl.bfloat16).to(tl.float32)
    return a, rstd


@triton.jit
def _gemv(w, a):
    """w [ROWS, BLOCK_K] (registers) times a [BLOCK_K] fp32 -> [ROWS] fp32."""
    return tl.sum(w.to(tl.float32) * a[None, :], axis=1)


@triton.jit
def _rounded(y, dtype: tl.constexpr):
    return y.to(dtype).to(tl.float32)


@triton.jit
def _head(ptr, nw_ptr, rows, cols, ok, pos, eps, offset, log2_theta, HAS_NORM: tl.constexpr, D: tl.constexpr,
          ROT: tl.constexpr):
    """Heads [R, head_block(D)] at ptr + rows * D + cols after the per-head RMSNorm (HAS_NORM) and RoPE
    at position `pos` on the first ROT dims, fp32 (the math of fused_decode_blocks._rotated_head:
    the partner dim of RoPE is read a second time)."""
    HALF: tl.constexpr = ROT // 2
    pc = tl.where(cols < HALF, cols + HALF, tl.where(cols < ROT, cols - HALF, cols))
    y = tl.load(ptr + rows[:, None] * D + cols[None, :], mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    yp = tl.load(ptr + rows[:, None] * D + pc[None, :], mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    if HAS_NORM:
        d_ok = head_mask(cols, D)
        rstd = tl.rsqrt(tl.sum(y * y, axis=1) / D + eps)[:, None]
        y = y * rstd * (tl.load(nw_ptr + cols, mask=d_ok, other=0.0).to(tl.float32) + offset)[None, :]
        yp = yp * rstd * (tl.load(nw_ptr + pc, mask=d_ok, other=0.0).to(tl.float32) + offset)[None, :]
    i = tl.where(cols < HALF, cols, cols - HALF)
    inv_freq = tl.exp2(i.to(tl.float32) * (-2.0 / ROT) * log2_theta)
    cos, sin = rotary_cos_sin(pos * inv_freq)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    return tl.where((cols < ROT)[None, :], y * cos[None, :] + sign[None, :] * yp * sin[None, :], y)


@triton.jit
def _qkv_task(x_ptr, nw_ptr, w_ptr, b_ptr, qkv_ptr, cnt_ptr, err_ptr, row0, M, phase, target, done, eps, offset,
              N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
              SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """qkv[m, row0:row0 + ROWS] = rms_norm(x[m]) @ w[rows]^T (+ bias), rounded, for every row m;
    the weight tile is loaded before the wait for phase - 1 (the layer before)."""
    BK: tl.constexpr = triton.next_power_of_2(K)
    w = _weight_tile(w_ptr, row0, N, K, K, ROWS, BK)
    done = _wait(cnt_ptr, err_ptr, phase - 1, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    rn = row0 + tl.arange(0, ROWS)
    for m in tl.static_range(BLOCK_M):
        if m < M:
            a, rstd = _normed_row(x_ptr + m * K, nw_ptr, K, eps, offset, w_ptr.dtype.element_ty, BK)
            y = _gemv(w, a) * rstd
            if HAS_BIAS:
                y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
            tl.store(qkv_ptr + m * N + rn, y.to(qkv_ptr.dtype.element_ty), mask=rn < N)
    _finish(cnt_ptr, phase)
    return done


@triton.jit
def _residual_task(a_ptr, w_ptr, res_ptr, out_ptr, cnt_ptr, err_ptr, row0, M, phase, target, done, N: tl.constexpr,
                   K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, SPIN_LIMIT: tl.constexpr,
                   stamp_ptr, TIMELINE: tl.constexpr):
    """out[m, rows] = res[m, rows] + round(a[m] @ w[rows]^T) (o_proj and down): the weight tile is
    loaded before the wait for `phase`; counts itself in on phase + 1."""
    BK: tl.constexpr = triton.next_power_of_2(K)
    w = _weight_tile(w_ptr, row0, N, K, K, ROWS, BK)
    done = _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    rn = row0 + tl.arange(0, ROWS)
    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(BLOCK_M):
        if m < M:
            y = _rounded(_gemv(w, _row(a_ptr + m * K, K, BK)), dtype)
            y += tl.load(res_ptr + m * N + rn, mask=rn < N, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + m * N + rn, y.to(dtype), mask=rn < N)
    _finish(cnt_ptr, phase + 1)
    return done


@triton.jit
def _gate_up_task(h_ptr, nw_ptr, w_ptr, act_ptr, cnt_ptr, err_ptr, row0, M, phase, target, done, eps, offset,
                  I: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
                  SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """act[m, rows] = silu(g) * u with g, u = rows and I + rows of rms_norm(h[m]) @ w^T, rounded
    as norm_gate_up_silu rounds them; the two weight tiles are loaded before the wait for `phase`."""
    BK: tl.constexpr = triton.next_power_of_2(K)
    wg = _weight_tile(w_ptr, row0, I, K, K, ROWS, BK)
    wu = _weight_tile(w_ptr + I * K, row0, I, K, K, ROWS, BK)
    done = _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    rn = row0 + tl.arange(0, ROWS)
    dtype = act_ptr.dtype.element_ty
    for m in tl.static_range(BLOCK_M):
        if m < M:
            a, rstd = _normed_row(h_ptr + m * K, nw_ptr, K, eps, offset, w_ptr.dtype.element_ty, BK)
            gate = _rounded(_gemv(wg, a) * rstd, dtype)
            up = _rounded(_gemv(wu, a) * rstd, dtype)
            tl.store(act_ptr + m * I + rn, (gate * tl.sigmoid(gate) * up).to(dtype), mask=rn < I)
    _finish(cnt_ptr, phase + 1)
    return done


@triton.jit
def _kv_block(k_base, v_base, bt_row, cols, hi, pos, d, d_ok, stride_kb, stride_kt, BS):
    """The cached keys [BLOCK_D, BLOCK_T] (transposed) and values [BLOCK_T, BLOCK_D] of positions
    `cols` below `hi`, through the block table; zero at the new token's position `pos` (its k and v
    come from registers: its cache write may still be in flight) and past `hi`."""
    c_ok = (cols < hi) & (cols != pos)
    slots = tl.load(bt_row + cols // BS, mask=c_ok, other=0).to(tl.int64) * stride_kb + (cols % BS) * stride_kt
    kt = tl.load(k_base + slots[None, :] + d[:, None], mask=c_ok[None, :] & d_ok[:, None], other=0.0)
    vt = tl.load(v_base + slots[:, None] + d[None, :], mask=c_ok[:, None] & d_ok[None, :], other=0.0)
    return kt, vt


@triton.jit
def _attention_task(qkv_ptr, qn_ptr, kn_ptr, pos_ptr, seqlens_ptr, bt_ptr, kc_ptr, vc_ptr, attn_ptr, po_ptr, plse_ptr,
                    arr_ptr, cnt_ptr, err_ptr, m, g, s, phase, target, done, stride_bt, stride_kb, stride_kt,
                    stride_kh, CACHE_LEN, BS, eps, offset, log2_theta, qk_scale,
                    HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
                    HAS_QK_NORM: tl.constexpr, S: tl.constexpr, BLOCK_T: tl.constexpr, HEADROOM: tl.constexpr,
                    P_SCALE: tl.constexpr, SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """Split s of sequence m's kv head g (see the module doc); counts (m, g) in on `phase` once its
    output is stored. The split's first block of cached keys and values is loaded before the wait
    for the qkv phase (`phase` - 1), as the GEMV tasks load their weights: only the new token's
    column depends on that phase, and it comes from registers."""
    G: tl.constexpr = HQ // HK
    BLOCK_G: tl.constexpr = max(16, triton.next_power_of_2(G))
    BLOCK_D: tl.constexpr = head_block(D)
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    dtype = attn_ptr.dtype.element_ty
    seqlen = tl.minimum(tl.maximum(tl.load(seqlens_ptr + m), 0), CACHE_LEN)
    pos = tl.load(pos_ptr + m).to(tl.int64)
    r = tl.arange(0, BLOCK_G)
    r_ok = r < G
    d = tl.arange(0, BLOCK_D)
    d_ok = head_mask(d, D)
    chunk = tl.cdiv(tl.cdiv(seqlen, S), BLOCK_T) * BLOCK_T
    lo = s * chunk
    hi = tl.minimum(lo + chunk, seqlen)
    k_base = kc_ptr + g * stride_kh
    v_base = vc_ptr + g * stride_kh
    bt_row = bt_ptr + m * stride_bt
    offs = tl.arange(0, BLOCK_T)
    kt_first, vt_first = _kv_block(k_base, v_base, bt_row, lo + offs, hi, pos, d, d_ok, stride_kb, stride_kt, BS)
    done = _wait(cnt_ptr, err_ptr, phase - 1, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    one = tl.zeros((1,), dtype=tl.int32)
    row = qkv_ptr + m * NQKV
    fpos = pos.to(tl.float32)
    q = _head(row, qn_ptr, g * G + r, d, r_ok[:, None] & d_ok[None, :], fpos, eps, offset, log2_theta,
              HAS_QK_NORM, D, ROT).to(dtype)
    k_new = tl.sum(_head(row + HQ * D, kn_ptr, g + one, d, d_ok[None, :], fpos, eps, offset, log2_theta,
                         HAS_QK_NORM, D, ROT), axis=0).to(kc_ptr.dtype.element_ty)
    v_new = tl.load(row + (HQ + HK) * D + g * D + d, mask=d_ok, other=0.0, cache_modifier=".cg")
    if (s == 0) & (pos >= 0) & (pos < seqlen):  # the new token's k and v, written once (not by a padding row)
        slot = tl.load(bt_row + pos // BS).to(tl.int64) * stride_kb + (pos % BS) * stride_kt
        tl.store(k_base + slot + d, k_new, mask=d_ok)
        tl.store(v_base + slot + d, v_new.to(vc_ptr.dtype.element_ty), mask=d_ok)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_T):
        cols = n0 + offs
        c_ok = cols < hi
        is_new = cols == pos  # the new token's k/v from registers: its cache write may still be in flight
        if n0 == lo:
            kt, vt = kt_first, vt_first
        else:
            kt, vt = _kv_block(k_base, v_base, bt_row, cols, hi, pos, d, d_ok, stride_kb, stride_kt, BS)
        kt = tl.where(is_new[None, :], k_new[:, None], kt)
        sc = dot(q, kt, tl.zeros((BLOCK_G, BLOCK_T), dtype=tl.float32)) * qk_scale
        sc = tl.where(c_ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(sc - m_safe[:, None]) * P_SCALE
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.where(is_new[:, None], v_new[None, :].to(vt.dtype), vt)
        acc = dot(p.to(vt.dtype), vt, acc * alpha[:, None])
        m_i = m_new
    has_keys = l_i > 0.0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    o_ptrs = attn_ptr + m * (HQ * D) + (g * G + r)[:, None] * D + d[None, :]
    if S == 1:
        tl.store(o_ptrs, out.to(dtype), mask=r_ok[:, None] & d_ok[None, :])
        _finish(cnt_ptr, phase)
    else:
        lse = tl.where(has_keys, m_i + HEADROOM + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        part = ((m * HK + g) * S + s) * G + r  # rows of po [M, HK, S, G, D] and plse [M, HK, S, G]
        tl.store(po_ptr + part[:, None] * D + d[None, :], out, mask=r_ok[:, None] & d_ok[None, :])
        tl.store(plse_ptr + part, lse, mask=r_ok)
        if arrive(arr_ptr, m * HK + g) == S - 1:  # the last split of (m, g): combine the S parts
            sp = tl.arange(0, triton.next_power_of_2(S))
            for j in tl.static_range(G):
                rows = ((m * HK + g) * S + sp) * G + j
                lse_s = tl.load(plse_ptr + rows, mask=sp < S, other=float("-inf"), cache_modifier=".cg")
                mx = tl.max(lse_s, axis=0)
                w = tl.exp2(lse_s - tl.where(mx == float("-inf"), 0.0, mx))
                w = w / tl.maximum(tl.sum(w, axis=0), 1e-30)
                parts = tl.load(po_ptr + rows[:, None] * D + d[None, :], mask=(sp < S)[:, None] & d_ok[None, :],
                                other=0.0, cache_modifier=".cg")
                o = tl.sum(parts * w[:, None], axis=0)
                tl.store(attn_ptr + m * (HQ * D) + (g * G + j) * D + d, o.to(dtype), mask=d_ok)
            _finish(cnt_ptr, phase)
    return done


@kernel
def _decode_layers_kernel(
    x_ptr, out_ptr, pos_ptr, seqlens_ptr, bt_ptr,
    in_norm_ptr, qkv_w_ptr, qkv_b_ptr, qn_ptr, kn_ptr, o_w_ptr, post_norm_ptr, gu_w_ptr, down_w_ptr,
    kc_ptr, vc_ptr, qkv_ptr, attn_ptr, h_ptr, act_ptr, po_ptr, plse_ptr, cnt_ptr, err_ptr, tl_ptr,
    M, NL, stride_bt, stride_kl, stride_kb, stride_kt, stride_kh, CACHE_LEN, BS,
    eps, offset, log2_theta, qk_scale,
    H: tl.constexpr, I: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr, BLOCK_M: tl.constexpr,
    RQ: tl.constexpr, RO: tl.constexpr, RG: tl.constexpr, RD: tl.constexpr, S: tl.constexpr,
    BLOCK_T: tl.constexpr, HEADROOM: tl.constexpr, P_SCALE: tl.constexpr, SPIN_LIMIT: tl.constexpr,
    TIMELINE: tl.constexpr,
):
    eps, offset, log2_theta, qk_scale = fp32(eps), fp32(offset), fp32(log2_theta), fp32(qk_scale)
    NQKV: tl.constexpr = (HQ + 2 * HK) * D
    HO: tl.constexpr = HQ * D
    N_QKV: tl.constexpr = (NQKV + RQ - 1) // RQ
    N_O: tl.constexpr = (H + RO - 1) // RO
    N_GU: tl.constexpr = (I + RG - 1) // RG
    N_DN: tl.constexpr = (H + RD - 1) // RD
    n_attn = M * HK * S
    per_layer = N_QKV + n_attn + N_O + N_GU + N_DN
    arr_base = cnt_ptr + NL * PHASES
    done = -1  # the highest phase this program has seen complete
    for t in range(tl.program_id(0), NL * per_layer, tl.num_programs(0)):
        layer = t // per_layer
        j = t % per_layer
        ph = layer * PHASES
        stamp = tl_ptr + t * 3
        if TIMELINE:
            tl.store(stamp, _now())
        if layer == 0:  # the layer's input: the embeddings, then the output of the layer before
            x_in = x_ptr
        else:
            x_in = out_ptr
        if j < N_QKV:
            done = _qkv_task(x_in, in_norm_ptr + layer * H, qkv_w_ptr + layer.to(tl.int64) * (NQKV * H),
                             qkv_b_ptr + layer * NQKV, qkv_ptr, cnt_ptr, err_ptr, j * RQ, M, ph, N_DN, done, eps,
                             offset, NQKV, H, HAS_BIAS, BLOCK_M, RQ, SPIN_LIMIT, stamp, TIMELINE)
        elif j < N_QKV + n_attn:
            a_id = j - N_QKV  # (m, g, s), s fastest
            done = _attention_task(qkv_ptr, qn_ptr + layer * D, kn_ptr + layer * D, pos_ptr, seqlens_ptr, bt_ptr,
                                   kc_ptr + layer.to(tl.int64) * stride_kl, vc_ptr + layer.to(tl.int64) * stride_kl,
                                   attn_ptr, po_ptr, plse_ptr, arr_base + layer * (M * HK), cnt_ptr, err_ptr,
                                   a_id // (HK * S), (a_id // S) % HK, a_id % S, ph + 1, N_QKV, done,
                                   stride_bt, stride_kb, stride_kt, stride_kh, CACHE_LEN, BS,
                                   eps, offset, log2_theta, qk_scale, HQ, HK, D, ROT, HAS_QK_NORM, S, BLOCK_T,
                                   HEADROOM, P_SCALE, SPIN_LIMIT, stamp, TIMELINE)
        elif j < N_QKV + n_attn + N_O:
            done = _residual_task(attn_ptr, o_w_ptr + layer.to(tl.int64) * (H * HO), x_in, h_ptr, cnt_ptr, err_ptr,
                                  (j - N_QKV - n_attn) * RO, M, ph + 1, M * HK, done, H, HO, BLOCK_M, RO,
                                  SPIN_LIMIT, stamp, TIMELINE)
        elif j < N_QKV + n_attn + N_O + N_GU:
            done = _gate_up_task(h_ptr, post_norm_ptr + layer * H, gu_w_ptr + layer.to(tl.int64) * (2 * I * H), act_ptr,
                                 cnt_ptr, err_ptr, (j - N_QKV - n_attn - N_O) * RG, M, ph + 2, N_O, done, eps,
                                 offset, I, H, BLOCK_M, RG, SPIN_LIMIT, stamp, TIMELINE)
        else:
            done = _residual_task(act_ptr, down_w_ptr + layer.to(tl.int64) * (H * I), h_ptr, out_ptr, cnt_ptr,
                                  err_ptr, (j - N_QKV - n_attn - N_O - N_GU) * RD, M, ph + 3, N_GU, done, H, I,
                                  BLOCK_M, RD, SPIN_LIMIT, stamp, TIMELINE)
        if TIMELINE:
            tl.store(stamp + 2, _now())


def tile_rows(n: int, k: int, itemsize: int) -> int:
    """Weight rows per GEMV tile: TILE_ELEMS (halved for fp32 weights) over the padded K, a power
    of two, at most the matrix's rows."""
    budget = TILE_ELEMS // max(1, itemsize // 2)
    rows = max(1, budget // next_power_of_2(k))
    return min(1 << (rows.bit_length() - 1), next_power_of_2(n))


def tile_plan(nqkv: int, h: int, attn_width: int, inter: int, itemsize: int) -> tuple:
    """(RQ, RO, RG, RD): the weight rows of a qkv, o_proj, gate_up (of each half) and down task."""
    return (tile_rows(nqkv, h, itemsize), tile_rows(h, attn_width, itemsize),
            tile_rows(2 * inter, h, itemsize) // 2 or 1, tile_rows(h, inter, itemsize))


def phase_tasks(m: int, nqkv: int, h: int, attn_width: int, inter: int, hk: int, splits: int, itemsize: int) -> list:
    """Tasks a layer of each phase (qkv, attention, o, gate_up, down), in the task list's order."""
    rq, ro, rg, rd = tile_plan(nqkv, h, attn_width, inter, itemsize)
    return [cdiv(nqkv, rq), m * hk * splits, cdiv(h, ro), cdiv(inter, rg), cdiv(h, rd)]


NUM_WARPS = 4
PROGRAMS_PER_SM = int(os.environ.get("QWEN_DECODE_LAYERS_PROGRAMS_PER_SM", "2"))
"""Co-resident programs per SM the launcher aims for (fewer where occupancy allows fewer). On the
H200 at Qwen3-0.6B's shape, batch 1, context 256: 0.793 ms per token with 2 (the kernel's 248
registers a thread allow no more), 0.904 with 1 (bench/results/2026-12-02-h200-decode-persistent.md)."""

def programs(compiled, device: torch.device) -> int:
    """How many programs of `compiled` fit on the device at once, at most PROGRAMS_PER_SM per SM:
    from its registers per thread and shared memory per program (the limits of an SM: 64K
    registers, 2048 threads, 32 blocks, the opt-in shared memory)."""
    props = cuda_properties(device)
    compiled._init_handles()
    threads = compiled.metadata.num_warps * 32
    regs = max(1, compiled.n_regs) * threads
    per_sm = min(PROGRAMS_PER_SM, 65536 // regs, 2048 // threads, 32)
    shared = compiled.metadata.shared
    if shared:
        per_sm = min(per_sm, props.shared_memory_per_multiprocessor // shared)
    if per_sm < 1:
        raise RuntimeError(f"decode_layers: one program needs {compiled.n_regs} registers a thread and {shared} "
                           f"bytes of shared memory, more than an SM has")
    return per_sm * props.multi_processor_count


def decode_layers(x, positions, cache_seqlens, block_table, input_norm, qkv_weight, qkv_bias, q_norm, k_norm,
                  o_weight, post_norm, gate_up_weight, down_weight, k_cache, v_cache, eps: float, offset: float,
                  theta: float, rotary_dim: int, num_heads: int, num_splits: int):
    m, h = x.shape
    nl, nqkv, _ = qkv_weight.shape
    _, nb, bs, hk, d = k_cache.shape
    inter = down_weight.shape[2]
    out = torch.empty_like(x)
    if m == 0:
        return out
    dev = x.device
    size = qkv_weight.element_size()
    group = num_heads // hk
    qkv = torch.empty((m, nqkv), dtype=x.dtype, device=dev)
    attn = torch.empty((m, num_heads * d), dtype=x.dtype, device=dev)
    hmid = torch.empty((m, h), dtype=x.dtype, device=dev)
    act = torch.empty((m, inter), dtype=x.dtype, device=dev)
    parts = torch.empty((m * hk * num_splits * group, d) if num_splits > 1 else (0, d), dtype=torch.float32,
                        device=dev)
    lse = torch.empty(parts.shape[:1], dtype=torch.float32, device=dev)
    counters = torch.zeros(nl * PHASES.value + nl * m * hk, dtype=torch.int32, device=dev)
    headroom = softmax_headroom(k_cache.dtype)
    rq, ro, rg, rd = tile_plan(nqkv, h, num_heads * d, inter, size)
    if timeline is not None:
        need = 3 * nl * sum(phase_tasks(m, nqkv, h, num_heads * d, inter, hk, num_splits, size))
        if timeline.dtype != torch.int64 or timeline.device != dev or timeline.numel() < need:
            raise ValueError(f"decode_layers.timeline must be an int64 tensor of at least {need} elements on {dev}, "
                             f"got {timeline.dtype} [{timeline.numel()}] on {timeline.device}")
    args = (x, out, positions, cache_seqlens, block_table, input_norm, qkv_weight,
            qkv_bias if qkv_bias is not None else qkv_weight, q_norm if q_norm is not None else input_norm,
            k_norm if k_norm is not None else input_norm, o_weight, post_norm, gate_up_weight, down_weight,
            k_cache, v_cache, qkv, attn, hmid, act, parts, lse, counters, error_flag(dev),
            timeline if timeline is not None else counters,
            m, nl, block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            block_table.shape[1] * bs, bs, eps, offset, math.log2(theta), d ** -0.5 * LOG2E)
    meta = dict(H=h, I=inter, HQ=num_heads, HK=hk, D=d, ROT=rotary_dim, HAS_BIAS=qkv_bias is not None,
                HAS_QK_NORM=q_norm is not None, BLOCK_M=next_power_of_2(m),
                RQ=rq, RO=ro, RG=rg, RD=rd, S=num_splits,
                BLOCK_T=BLOCK_T, HEADROOM=headroom, P_SCALE=2.0 ** -headroom, SPIN_LIMIT=SPIN_LIMIT,
                TIMELINE=timeline is not None,
                num_warps=NUM_WARPS, num_stages=1)
    if INTERPRET:
        _decode_layers_kernel[(1,)](*args, **meta)
        return out
    key = (dev.index, x.dtype, qkv_weight.dtype, k_cache.dtype, tuple(meta.items()))
    grid = _grids.get(key)
    if grid is None:  # compiled once, not launched, to size the grid from its registers
        compiled = _decode_layers_kernel.fn.warmup(*args, grid=(1,), launch_cooperative_grid=True, **meta)
        grid = _grids[key] = (programs(compiled, dev),)
    _decode_layers_kernel[grid](*args, launch_cooperative_grid=True, **meta)
    return out


_grids: dict = {}  # (device, dtypes, constexprs) -> the launch grid


def error_flag(device: torch.device) -> torch.Tensor:
    """The device's watchdog flag, int32 [1]: 1 once a wait of the persistent kernel gave up
    (SPIN_LIMIT polls), which only a broken schedule causes; the kernel never clears it. Created on
    first use; create it before capturing a CUDA graph (the model's `new_cache` does)."""
    return device_buffer("decode_layers", 1, device,
                         "create its error flag (csrc_free_ops.decode_layers.error_flag)")


def default_splits(cache_len: int, rows: int = 1) -> int:
    """Splits of each (sequence, kv head)'s attention: one per 32 cached positions, at most 32 // rows
    (so a layer has at most 32 x Hk attention tasks, about one per program: 256 at Hk = 8), 1 to 32.
    The count is fixed per cache (a graph replays it at every length); each split takes a share of
    the sequence's current length. On the H200 at Qwen3-0.6B's shape (`python -m bench.decode_layers`,
    bench/results/2026-12-03-h200-decode-layers-splits.md): context 2048, one sequence, 32 splits
    804.5 us a call against 880.5 with 16; context 256, eight sequences, 4 splits 3220 us against
    3737 with 11."""
    return max(1, min(cdiv(cache_len, 32), 32 // max(1, rows)))
