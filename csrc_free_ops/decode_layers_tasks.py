"""The persistent decode kernel's building blocks (csrc_free_ops/decode_layers.py): the counter
wait and release that order its tasks, the whole-K weight tiles and the GEMV over them, and the
five task kinds of a layer, each loading its weights (an attention task: its split's first block
of cached keys and values) before it waits on the phase before.

    _qkv_task       qkv[m, rows] = rms_norm(x[m]) @ w[rows]^T (+ bias), rounded
    _attention_task split s of (sequence m, kv head g): per-head RMSNorm and RoPE of the group's
                    q heads and of k, the new k and v written at the token's position, the split's
                    share of the cached positions attended; the last split to arrive combines;
                    GATED (Qwen3.5's gated attention): q's rows per head [query | gate] and the
                    output o * sigmoid(gate), rounded as sigmoid_mul rounds it
    _residual_task  out[m, rows] = res[m, rows] + round(a[m] @ w[rows]^T)  (o_proj and down)
    _gate_up_task   act[m, rows] = silu(g) * u of rms_norm(h[m]) @ w^T's gate and up rows

A GEMV task multiplies its rows one at a time (`_gemv`: fp32 products and row sums) at one
sequence or with FP8 weights, and all at once on the tensor cores (`_products`) at two to eight.
With FP8 the GEMV tasks read float8_e4m3fn weight tiles and their block scales (`_tile_scales`),
K in groups of one scale block (`_k_offsets`).

A task counts itself in on its phase's completion counter (`_finish`: a barrier, then a release
add); a wait (`_wait`) polls the counter of the phase it depends on with acquire loads, and gives
up after SPIN_LIMIT polls by setting the device's error flag. Activations are read with `.cg`
(through L2, where the other programs' stores are). With TIMELINE a task stamps %globaltimer
(`_stamp`) at its start, when its wait is met and at its end.
"""
import triton
import triton.language as tl

from .common import _FP8_BLOCK, arrive, dot, head_block, head_mask
from .rope import rotary_cos_sin


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
    _stamp(stamp_ptr + 1, TIMELINE)
    return tl.maximum(done, phase)


@triton.jit
def _now():
    """The SM's %globaltimer, ns (the timeline's clock; CUDA only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp(ptr, TIMELINE: tl.constexpr):
    """TIMELINE: store `_now()` at ptr (a task's start, wait met or end); else nothing."""
    if TIMELINE:
        tl.store(ptr, _now())


@triton.jit
def _finish(cnt_ptr, phase):
    """Count a task of `phase` in once every thread's stores are done (barrier, then a release add)."""
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + phase, 1, sem="release", scope="gpu")


@triton.jit
def _k_offsets(BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """The offsets of a row's K: [BLOCK_K]; FP8: [G, GS], one scale block of K a group (GS = 128,
    or BLOCK_K where K fits one block)."""
    if FP8:
        GS: tl.constexpr = min(_FP8_BLOCK, BLOCK_K)
        rk = tl.arange(0, BLOCK_K // GS)[:, None] * GS + tl.arange(0, GS)[None, :]
    else:
        rk = tl.arange(0, BLOCK_K)
    return rk


@triton.jit
def _weight_tile(w_ptr, row0, N, K, stride_n, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """weight[row0:row0 + ROWS, :K], zero outside [N, K]: [ROWS, BLOCK_K]; FP8: [ROWS, G, GS] (K in
    the groups of `_k_offsets`), float8_e4m3fn as stored."""
    rn = row0 + tl.arange(0, ROWS)
    rk = _k_offsets(BLOCK_K, FP8)
    if FP8:
        ptrs = w_ptr + rn[:, None, None].to(tl.int64) * stride_n + rk[None, :, :]
        mask = (rn[:, None, None] < N) & (rk[None, :, :] < K)
    else:
        ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_n + rk[None, :]
        mask = (rn[:, None] < N) & (rk[None, :] < K)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _tile_scales(sw_ptr, rows, N, K: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """FP8: the fp32 block scales [ROWS, G] of weight rows `rows` (sw [cdiv(N, 128), cdiv(K, 128)],
    contiguous), zero past N and past K's blocks; else sw_ptr itself (nothing loaded)."""
    scales = sw_ptr
    if FP8:  # one return after the branch: the compiler would type-check a return in each
        SK: tl.constexpr = (K + _FP8_BLOCK - 1) // _FP8_BLOCK
        g = tl.arange(0, BLOCK_K // min(_FP8_BLOCK, BLOCK_K))
        scales = tl.load(sw_ptr + (rows // _FP8_BLOCK)[:, None] * SK + g[None, :],
                         mask=(rows < N)[:, None] & (g < SK)[None, :], other=0.0).to(tl.float32)
    return scales


@triton.jit
def _row(ptr, K, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """An activation row in fp32 (zero past K), read through L2: [BLOCK_K]; FP8: [G, GS]."""
    rk = _k_offsets(BLOCK_K, FP8)
    return tl.load(ptr + rk, mask=rk < K, other=0.0, cache_modifier=".cg").to(tl.float32)


@triton.jit
def _normed_row(ptr, nw_ptr, K, eps, offset, dtype: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr):
    """(a, rstd) of rms_norm(x) = rstd * a: a = x * (norm weight + offset), rounded to x's dtype
    where it is bf16 as fused_decode's main loop rounds it (fp16 and fp32 keep it fp32); shaped as
    `_row`."""
    x = _row(ptr, K, BLOCK_K, FP8)
    squares = tl.sum(x * x, axis=0)
    if FP8:
        squares = tl.sum(squares, axis=0)
    rstd = tl.rsqrt(squares / K + eps)
    rk = _k_offsets(BLOCK_K, FP8)
    a = x * (tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32) + offset)
    if dtype == tl.bfloat16:
        a = a.to(tl.bfloat16).to(tl.float32)
    return a, rstd


@triton.jit
def _gemv(w, a, scales, FP8: tl.constexpr):
    """w (a `_weight_tile`, registers) times a (a `_row`) -> [ROWS] fp32; FP8: each group's sum
    times its block's scale (`_tile_scales`), the weight-only product of fp8_block_linear."""
    if FP8:
        y = tl.sum(tl.sum(w.to(tl.float32) * a[None, :, :], axis=2) * scales, axis=1)
    else:
        y = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    return y


@triton.jit
def _rows(ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Activation rows 0..M-1 as stored (zero past M and K), read through L2: [BLOCK_M, BLOCK_K]."""
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    return tl.load(ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0,
                   cache_modifier=".cg")


@triton.jit
def _normed_rows(ptr, nw_ptr, M, K, eps, offset, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """(a, rstd) of `_normed_row` for rows 0..M-1 at once: a [BLOCK_M, BLOCK_K] (bf16 where x is,
    as `_normed_row` rounds it; else fp32), rstd [BLOCK_M]."""
    x = _rows(ptr, M, K, BLOCK_M, BLOCK_K)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / K + eps)
    rk = tl.arange(0, BLOCK_K)
    a = xf * (tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32) + offset)[None, :]
    if x.dtype == tl.bfloat16:
        a = a.to(tl.bfloat16)
    return a, rstd


@triton.jit
def _products(a, w, NORMED: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] @ w [ROWS, BLOCK_K]^T -> [BLOCK_M, ROWS] fp32 on the tensor cores, rounded
    as the fused decode ops round (their `_dot_widened`): normed rows (`_normed_rows`) to bf16 for bf16
    weights, TF32 for fp16, exact fp32 for fp32; stored activations (`_rows`) as they are. K is cut
    into C >= 4 chunks, the batch of one batched product, so that each warp holds its chunks of
    both operands instead of the whole K (which spilled); the chunks' products are summed in fp32."""
    R: tl.constexpr = w.shape[0]
    BK: tl.constexpr = w.shape[1]
    BM: tl.constexpr = a.shape[0]
    C: tl.constexpr = max(4, BK // 1024)
    w3 = tl.permute(tl.reshape(w, (R, C, BK // C)), (1, 0, 2))
    a3 = tl.permute(tl.reshape(a, (BM, C, BK // C)), (1, 2, 0))
    acc = tl.zeros((C, R, BM), dtype=tl.float32)
    if NORMED and w.dtype == tl.float16:
        acc = tl.dot(w3.to(tl.float32), a3.to(tl.float32), acc, input_precision="tf32")
    else:
        acc = dot(w3, a3.to(w.dtype), acc)
    return tl.trans(tl.sum(acc, axis=0))


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
def _qkv_task(x_ptr, nw_ptr, w_ptr, sw_ptr, b_ptr, qkv_ptr, cnt_ptr, err_ptr, row0, M, phase, target, done, eps,
              offset, N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
              ROWS: tl.constexpr, FP8: tl.constexpr, SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """qkv[m, row0:row0 + ROWS] = rms_norm(x[m]) @ w[rows]^T (+ bias), rounded, for every row m;
    the weight tile (FP8: and its scales, sw) is loaded before the wait for phase - 1 (the layer before)."""
    BK: tl.constexpr = triton.next_power_of_2(K)
    rn = row0 + tl.arange(0, ROWS)
    w = _weight_tile(w_ptr, row0, N, K, K, ROWS, BK, FP8)
    scales = _tile_scales(sw_ptr, rn, N, K, BK, FP8)
    done = _wait(cnt_ptr, err_ptr, phase - 1, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    if BLOCK_M > 1 and not FP8 and BK >= 64:  # every row at once (`_products`)
        rm = tl.arange(0, BLOCK_M)
        a, rstd = _normed_rows(x_ptr, nw_ptr, M, K, eps, offset, BLOCK_M, BK)
        y = _products(a, w, True) * rstd[:, None]
        if HAS_BIAS:
            y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(qkv_ptr + rm[:, None] * N + rn[None, :], y.to(qkv_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
    else:
        for m in tl.static_range(BLOCK_M):
            if m < M:
                a, rstd = _normed_row(x_ptr + m * K, nw_ptr, K, eps, offset, x_ptr.dtype.element_ty, BK, FP8)
                y = _gemv(w, a, scales, FP8) * rstd
                if HAS_BIAS:
                    y += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
                tl.store(qkv_ptr + m * N + rn, y.to(qkv_ptr.dtype.element_ty), mask=rn < N)
    _finish(cnt_ptr, phase)
    return done


@triton.jit
def _residual_task(a_ptr, w_ptr, sw_ptr, res_ptr, out_ptr, cnt_ptr, err_ptr, row0, M, phase, target, done,
                   N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
                   SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """out[m, rows] = res[m, rows] + round(a[m] @ w[rows]^T) (o_proj and down): the weight tile (FP8:
    and its scales) is loaded before the wait for `phase`; counts itself in on phase + 1."""
    BK: tl.constexpr = triton.next_power_of_2(K)
    rn = row0 + tl.arange(0, ROWS)
    w = _weight_tile(w_ptr, row0, N, K, K, ROWS, BK, FP8)
    scales = _tile_scales(sw_ptr, rn, N, K, BK, FP8)
    done = _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    dtype = out_ptr.dtype.element_ty
    if BLOCK_M > 1 and not FP8 and BK >= 64:  # every row at once (`_products`)
        rm = tl.arange(0, BLOCK_M)
        ok = (rm[:, None] < M) & (rn[None, :] < N)
        y = _rounded(_products(_rows(a_ptr, M, K, BLOCK_M, BK), w, False), dtype)
        offs = rm[:, None] * N + rn[None, :]
        y += tl.load(res_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + offs, y.to(dtype), mask=ok)
    else:
        for m in tl.static_range(BLOCK_M):
            if m < M:
                y = _rounded(_gemv(w, _row(a_ptr + m * K, K, BK, FP8), scales, FP8), dtype)
                y += tl.load(res_ptr + m * N + rn, mask=rn < N, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(out_ptr + m * N + rn, y.to(dtype), mask=rn < N)
    _finish(cnt_ptr, phase + 1)
    return done


@triton.jit
def _gate_up_task(h_ptr, nw_ptr, w_ptr, sw_ptr, act_ptr, cnt_ptr, err_ptr, row0, M, phase, target, done, eps, offset,
                  I: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, FP8: tl.constexpr,
                  SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """act[m, rows] = silu(g) * u with g, u = rows and I + rows of rms_norm(h[m]) @ w^T, rounded
    as norm_gate_up_silu rounds them; the two weight tiles (FP8: and their scales, rows of the
    whole [2I, K] weight's) are loaded before the wait for `phase`."""
    BK: tl.constexpr = triton.next_power_of_2(K)
    rn = row0 + tl.arange(0, ROWS)
    wg = _weight_tile(w_ptr, row0, I, K, K, ROWS, BK, FP8)
    wu = _weight_tile(w_ptr + I * K, row0, I, K, K, ROWS, BK, FP8)
    sg = _tile_scales(sw_ptr, rn, I, K, BK, FP8)
    su = _tile_scales(sw_ptr, I + rn, 2 * I, K, BK, FP8)
    done = _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    dtype = act_ptr.dtype.element_ty
    if BLOCK_M > 1 and not FP8 and BK >= 64:  # every row at once (`_products`)
        rm = tl.arange(0, BLOCK_M)
        a, rstd = _normed_rows(h_ptr, nw_ptr, M, K, eps, offset, BLOCK_M, BK)
        gate = _rounded(_products(a, wg, True) * rstd[:, None], dtype)
        up = _rounded(_products(a, wu, True) * rstd[:, None], dtype)
        tl.store(act_ptr + rm[:, None] * I + rn[None, :], (gate * tl.sigmoid(gate) * up).to(dtype),
                 mask=(rm[:, None] < M) & (rn[None, :] < I))
    else:
        for m in tl.static_range(BLOCK_M):
            if m < M:
                a, rstd = _normed_row(h_ptr + m * K, nw_ptr, K, eps, offset, h_ptr.dtype.element_ty, BK, FP8)
                gate = _rounded(_gemv(wg, a, sg, FP8) * rstd, dtype)
                up = _rounded(_gemv(wu, a, su, FP8) * rstd, dtype)
                tl.store(act_ptr + m * I + rn, (gate * tl.sigmoid(gate) * up).to(dtype), mask=rn < I)
    _finish(cnt_ptr, phase + 1)
    return done


@triton.jit
def _output_gate(o, gate_ptrs, mask, dtype: tl.constexpr):
    """sigmoid_mul(o, gate): o rounded to dtype, times sigmoid(gate) in fp32 (the output gate of
    Qwen3.5's attention; the gate as the qkv projection stored it)."""
    gate = tl.load(gate_ptrs, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    return _rounded(o, dtype) * tl.sigmoid(gate)


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
                    HAS_QK_NORM: tl.constexpr, GATED: tl.constexpr, S: tl.constexpr, BLOCK_T: tl.constexpr,
                    HEADROOM: tl.constexpr, P_SCALE: tl.constexpr, SPIN_LIMIT: tl.constexpr, stamp_ptr,
                    TIMELINE: tl.constexpr):
    """Split s of sequence m's kv head g (see the module doc); counts (m, g) in on `phase` once its
    output is stored. The split's first block of cached keys and values is loaded before the wait
    for the qkv phase (`phase` - 1), as the GEMV tasks load their weights: only the new token's
    column depends on that phase, and it comes from registers. GATED: qkv's query part is [Hq, 2D]
    (head h's query, then its gate), and the output is gated."""
    G: tl.constexpr = HQ // HK
    QS: tl.constexpr = 2 if GATED else 1  # query rows a head
    BLOCK_G: tl.constexpr = max(16, triton.next_power_of_2(G))
    BLOCK_D: tl.constexpr = head_block(D)
    NQKV: tl.constexpr = (QS * HQ + 2 * HK) * D
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
    q = _head(row, qn_ptr, (g * G + r) * QS, d, r_ok[:, None] & d_ok[None, :], fpos, eps, offset, log2_theta,
              HAS_QK_NORM, D, ROT).to(dtype)
    k_new = tl.sum(_head(row + QS * HQ * D, kn_ptr, g + one, d, d_ok[None, :], fpos, eps, offset, log2_theta,
                         HAS_QK_NORM, D, ROT), axis=0).to(kc_ptr.dtype.element_ty)
    v_new = tl.load(row + (QS * HQ + HK) * D + g * D + d, mask=d_ok, other=0.0, cache_modifier=".cg")
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
        if GATED:
            gates = row + ((g * G + r) * 2 + 1)[:, None] * D + d[None, :]
            out = _output_gate(out, gates, r_ok[:, None] & d_ok[None, :], dtype)
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
                if GATED:
                    o = _output_gate(o, row + ((g * G + j) * 2 + 1) * D + d, d_ok, dtype)
                tl.store(attn_ptr + m * (HQ * D) + (g * G + j) * D + d, o.to(dtype), mask=d_ok)
            _finish(cnt_ptr, phase)
    return done
