"""Gated DeltaNet (Qwen3.5 linear attention): the chunked prefill, the recurrent decode step
and the gated RMSNorm of its output.

Per value head h (key head h // (Hv / Hk)), with an fp32 state S [Dk, Dv] and, per token t,
unit-norm (optionally) keys k_t, queries q_t * scale, values v_t, log decay g_t <= 0, beta_t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Chunked form (chunk C = 64 tokens, positions i, j inside a chunk, G = cumsum of g in the chunk):
    A[i, j]  = beta_i (k_i . k_j) exp(G_i - G_j)  for j < i, 0 otherwise
    X        = (I + A)^{-1}                          (fp32: 16 x 16 diagonal blocks by forward
                                                      substitution, then a Neumann series in tiles)
    W        = X (beta k exp(G)),   U = X (beta v)    (the WY / UT representation)
    V'       = U - W S                                (v_new: what the state does not predict yet)
    O        = (q exp(G)) S + mask_{i>=j}(q_i . k_j exp(G_i - G_j)) V'
    S        <- exp(G_last) S + k^T (exp(G_last - G) V')

Three kernels, as in flash-linear-attention: `_wy_kernel` (parallel over chunks) writes G, W,
U and the l2-normalised keys; `_state_kernel` (one program per (batch, head, value block),
sequential over chunks) carries S in fp32 registers and writes V' and the state entering every
chunk; `_output_kernel` (parallel over chunks) computes O. Matrix products take the inputs'
dtype (bf16 tensor cores with fp32 accumulation; exact fp32 for fp32 inputs), so the
intermediates W, U, V', the normalised keys and the per-chunk states are stored in that dtype;
the running state stays fp32. Tile and warp choices have no register spills on sm_90 for
bf16 and Dk = Dv = 128 (checked with ptxas), except ~150 bytes in `_wy_kernel`; fp32 inputs
take exact-fp32 FMA products, correct but slow. Dk and Dv are any multiples of 16 up to 256: a
head is held in a `head_block` block masked past its dim (value blocks are powers of two; the last
one of a Dv that is not is partly masked).

`_recurrent_kernel`: one program per (batch, head, value block) walks the T decode tokens with
the state in registers, fusing the l2 norms, g = -exp(A_log) softplus(a + dt_bias) and
beta = sigmoid(b); it updates the state in place. No host sync, no value-dependent allocation.

`_gated_rms_norm_kernel`: y = rms_norm(x) * weight * silu(z) over the last dim, with the
roundings of transformers' Qwen3_5RMSNormGated (see qwen_ops/gated_delta_rule.py).
"""
import torch
import triton
import triton.language as tl

from .common import (INTERPRET, TARGET_PROGRAMS, cdiv, dot, empty_contiguous_like, flat_rows, fp32, head_block,
                    head_mask, kernel, next_power_of_2, row_warps)

CHUNK = 64


@triton.jit
def _l2norm_rows(x, NORM: tl.constexpr):
    """x [R, D] fp32 -> x * rsqrt(sum(x^2) + 1e-6) per row (transformers' / FLA's l2norm)."""
    if NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _dot_f32(a, b, TF32: tl.constexpr):
    """a @ b for fp32 tiles: tf32 tensor cores (TF32), else exact fp32."""
    acc = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32)
    if TF32:
        return tl.dot(a, b, acc, input_precision="tf32")
    return dot(a, b, acc)


@triton.jit
def _unit_lower_inverse(a, BT: tl.constexpr, BLK: tl.constexpr, TF32: tl.constexpr):
    """(I + a)^{-1} for a strictly lower triangular [BT, BT] fp32 tile, in fp32 (the tile
    products in tf32 with TF32: for bf16 / fp16 inputs, whose W and U use X rounded to 16 bits).

    With I + a = D + N (D: the unit lower BLK x BLK diagonal blocks, N: the blocks below them),
    (D + N)^{-1} = (I + P)^{-1} D^{-1} with P = D^{-1} N strictly block lower, so P^(BT/BLK) = 0
    and (I + P)^{-1} = I - P (I - P (I - P ...)). D^{-1} comes from forward substitution over the
    BLK rows of every diagonal block at once (row i of each block in one step; the blocks use
    disjoint columns, so one reduction serves all of them), then BT/BLK tile products (fp32).
    """
    rows = tl.arange(0, BT)
    same = (rows // BLK)[:, None] == (rows // BLK)[None, :]
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    m = -tl.where(same, a, 0.0)  # D^{-1} - I, built row by row
    for i in range(1, BLK):
        sel = (rows % BLK == i)[:, None]
        r = tl.sum(tl.where(sel, m, 0.0), axis=0)
        r += tl.sum(r[:, None] * m, axis=0)
        m = tl.where(sel & same, r[None, :], m)
    d_inv = m + eye
    p = _dot_f32(d_inv, tl.where(same, 0.0, a), TF32)
    y = eye - p
    for _ in tl.static_range(BT // BLK - 2):
        y = eye - _dot_f32(p, y, TF32)
    return _dot_f32(y, d_inv, TF32)


@kernel
def _wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, gc_ptr, kn_ptr,
    T, H, GROUP,
    skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sbb, sbt, sbh,
    NORM: tl.constexpr, BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
):
    """Chunk i_t of (b, h): G = cumsum(g) -> gc [B, H, T]; W, U -> [B, H, T, DK / DV]; with NORM,
    the normalised keys -> kn [B, Hk, T, DK] (by the first value head of each key head)."""
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // H).to(tl.int64)
    h = i_bh % H
    hk = h // GROUP
    DT = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    t = i_t * BT + rows
    tm = t < T
    t64 = t.to(tl.int64)
    dk = tl.arange(0, head_block(DK))
    dv = tl.arange(0, head_block(DV))
    k_ok = tm[:, None] & head_mask(dk, DK)[None, :]
    v_ok = tm[:, None] & head_mask(dv, DV)[None, :]

    k = tl.load(k_ptr + b * skb + hk * skh + t64[:, None] * skt + dk[None, :], mask=k_ok, other=0.0)
    k = _l2norm_rows(k.to(tl.float32), NORM)
    beta = tl.load(beta_ptr + b * sbb + h * sbh + t64 * sbt, mask=tm, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * sgb + h * sgh + t64 * sgt, mask=tm, other=0.0).to(tl.float32)
    gc = tl.cumsum(g, axis=0)
    bh_t = i_bh.to(tl.int64) * T + t64
    tl.store(gc_ptr + bh_t, gc, mask=tm)
    kd = k.to(DT)
    if NORM:
        if h % GROUP == 0:
            bk_t = (b * (H // GROUP) + hk) * T + t64
            tl.store(kn_ptr + bk_t[:, None] * DK + dk[None, :], kd, mask=k_ok)
    kb = (k * beta[:, None]).to(DT)
    kw = (k * (beta * tl.exp(gc))[:, None]).to(DT)

    # A = strictly lower (beta k k^T * exp(G_i - G_j)); X = (I + A)^{-1}.
    a = dot(kb, tl.trans(kd), tl.zeros((BT, BT), dtype=tl.float32))
    lower = rows[:, None] > rows[None, :]
    a = tl.where(lower, a * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
    x = _unit_lower_inverse(a, BT, 16, DT != tl.float32)
    x = x.to(DT)
    w = dot(x, kw, tl.zeros((BT, head_block(DK)), dtype=tl.float32))
    tl.store(w_ptr + bh_t[:, None] * DK + dk[None, :], w.to(DT), mask=k_ok)
    v = tl.load(v_ptr + b * svb + h * svh + t64[:, None] * svt + dv[None, :], mask=v_ok, other=0.0)
    u = dot(x, (v.to(tl.float32) * beta[:, None]).to(DT), tl.zeros((BT, head_block(DV)), dtype=tl.float32))
    tl.store(u_ptr + bh_t[:, None] * DV + dv[None, :], u.to(DT), mask=v_ok)


@kernel
def _state_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, h_ptr, vn_ptr, h0_ptr, ht_ptr,
    T, NT, H, GROUP,
    skb, skt, skh,
    HAS_H0: tl.constexpr,
    BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
    """Sequential over chunks for (b, h, value block): writes the state entering each chunk
    (h [B, H, NT, DK, DV]), V' ([B, H, T, DV]) and the final state (ht, fp32). k: the keys as
    the state sees them (normalised already). k^T (exp(G_last - G) V') scales V' rows, not keys."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // H).to(tl.int64)
    h = i_bh % H
    hk = h // GROUP
    DT = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    dk = tl.arange(0, head_block(DK))
    dk_ok = head_mask(dk, DK)
    cv = i_v * BV + tl.arange(0, BV)
    state_off = i_bh.to(tl.int64) * DK * DV + dk[:, None] * DV + cv[None, :]
    cv_ok = head_mask(cv, DV)
    s_ok = dk_ok[:, None] & cv_ok[None, :]
    if HAS_H0:
        s = tl.load(h0_ptr + state_off, mask=s_ok, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((head_block(DK), BV), dtype=tl.float32)
    for i_t in range(NT):
        tl.store(h_ptr + (i_bh.to(tl.int64) * NT + i_t) * DK * DV + dk[:, None] * DV + cv[None, :], s.to(DT),
                 mask=s_ok)
        t = i_t * BT + rows
        tm = t < T
        t64 = t.to(tl.int64)
        bh_t = i_bh.to(tl.int64) * T + t64
        k_ok = tm[:, None] & dk_ok[None, :]
        v_ok = tm[:, None] & cv_ok[None, :]
        w = tl.load(w_ptr + bh_t[:, None] * DK + dk[None, :], mask=k_ok, other=0.0)
        u = tl.load(u_ptr + bh_t[:, None] * DV + cv[None, :], mask=v_ok, other=0.0)
        vn = u.to(tl.float32) - dot(w, s.to(DT), tl.zeros((BT, BV), dtype=tl.float32))
        vn = vn.to(DT)
        tl.store(vn_ptr + bh_t[:, None] * DV + cv[None, :], vn, mask=v_ok)
        gc = tl.load(gc_ptr + bh_t, mask=tm, other=0.0)
        g_last = tl.load(gc_ptr + i_bh.to(tl.int64) * T + min(i_t * BT + BT, T) - 1)
        k = tl.load(k_ptr + b * skb + hk * skh + t64[:, None] * skt + dk[None, :], mask=k_ok, other=0.0)
        vd = (vn.to(tl.float32) * tl.exp(g_last - gc)[:, None]).to(DT)
        s = dot(tl.trans(k), vd, s * tl.exp(g_last))
    tl.store(ht_ptr + state_off, s, mask=s_ok)


@kernel
def _output_kernel(
    q_ptr, k_ptr, vn_ptr, gc_ptr, h_ptr, o_ptr, scale,
    T, NT, H, GROUP,
    sqb, sqt, sqh, skb, skt, skh, sob, sot, soh,
    NORM: tl.constexpr, BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
    """O of chunk i_t for (b, h, value block): (q exp(G)) S_chunk + causal(q k^T exp(G_i - G_j)) V'
    (q normalised here, k as stored by _wy_kernel)."""
    scale = fp32(scale)
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1)
    i_v = tl.program_id(2)
    b = (i_bh // H).to(tl.int64)
    h = i_bh % H
    hk = h // GROUP
    DT = q_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    t = i_t * BT + rows
    tm = t < T
    t64 = t.to(tl.int64)
    bh_t = i_bh.to(tl.int64) * T + t64
    dk = tl.arange(0, head_block(DK))
    dk_ok = head_mask(dk, DK)
    k_ok = tm[:, None] & dk_ok[None, :]
    cv = i_v * BV + tl.arange(0, BV)

    q = tl.load(q_ptr + b * sqb + hk * sqh + t64[:, None] * sqt + dk[None, :], mask=k_ok, other=0.0)
    q = _l2norm_rows(q.to(tl.float32), NORM) * scale
    k = tl.load(k_ptr + b * skb + hk * skh + t64[:, None] * skt + dk[None, :], mask=k_ok, other=0.0)
    gc = tl.load(gc_ptr + bh_t, mask=tm, other=0.0)
    cv_ok = head_mask(cv, DV)
    v_ok = tm[:, None] & cv_ok[None, :]
    s = tl.load(h_ptr + (i_bh.to(tl.int64) * NT + i_t) * DK * DV + dk[:, None] * DV + cv[None, :],
                mask=dk_ok[:, None] & cv_ok[None, :], other=0.0)
    o = dot((q * tl.exp(gc)[:, None]).to(DT), s, tl.zeros((BT, BV), dtype=tl.float32))
    a = dot(q.to(DT), tl.trans(k), tl.zeros((BT, BT), dtype=tl.float32))
    causal = rows[:, None] >= rows[None, :]
    a = tl.where(causal, a * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    vn = tl.load(vn_ptr + bh_t[:, None] * DV + cv[None, :], mask=v_ok, other=0.0)
    o = dot(a.to(DT), vn, o)
    tl.store(o_ptr + b * sob + h * soh + t64[:, None] * sot + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=v_ok)


def _value_block(dk: int, dv: int, programs_per_block: int) -> int:
    """Value columns per program of the sequential kernels (a power of two; cdiv(dv, block)
    programs, the last one's columns past dv masked): the fp32 state tile [head_block(DK), BV]
    stays in registers (<= 8K elements), and narrower blocks when (batch x heads) is too small to
    fill the GPU."""
    if INTERPRET:
        return next_power_of_2(dv)
    bv = min(next_power_of_2(dv), 64 if dk <= 64 else 32 if dk <= 128 else 16)
    while bv > 16 and programs_per_block * cdiv(dv, bv) < TARGET_PROGRAMS // 2:
        bv //= 2
    return bv


def _output_value_block(dv: int) -> int:
    """Value columns per program of `_output_kernel` (parallel over chunks: no state in registers)."""
    return next_power_of_2(dv) if INTERPRET else min(next_power_of_2(dv), 64)


def chunk_gated_delta_rule(q, k, v, g, beta, scale: float, initial_state=None, use_qk_l2norm: bool = False):
    """q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv], initial_state [B, Hv, Dk, Dv]
    fp32 or None -> (o [B, T, Hv, Dv] in q.dtype, final_state [B, Hv, Dk, Dv] fp32)."""
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    dev, dt = q.device, q.dtype
    o = torch.empty((bsz, t, hv, dv), dtype=dt, device=dev)
    final = torch.empty((bsz, hv, dk, dv), dtype=torch.float32, device=dev)
    if bsz * hv == 0:
        return o, final
    nt = cdiv(t, CHUNK)
    group = hv // hk
    block_k, block_v = next_power_of_2(dk), next_power_of_2(dv)  # the kernels' head blocks (common.head_block)
    gc = torch.empty((bsz, hv, t), dtype=torch.float32, device=dev)
    w = torch.empty((bsz, hv, t, dk), dtype=dt, device=dev)
    u = torch.empty((bsz, hv, t, dv), dtype=dt, device=dev)
    vn = torch.empty((bsz, hv, t, dv), dtype=dt, device=dev)
    hs = torch.empty((bsz, hv, nt, dk, dv), dtype=dt, device=dev)
    norm = bool(use_qk_l2norm)
    # The keys as the state and output kernels read them: normalised once by _wy_kernel.
    kn = torch.empty((bsz, hk, t, dk), dtype=dt, device=dev) if norm else k
    kn_strides = (hk * t * dk, dk, t * dk) if norm else (k.stride(0), k.stride(1), k.stride(2))
    if nt:
        _wy_kernel[(nt, bsz * hv)](
            k, v, g, beta, w, u, gc, kn, t, hv, group,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
            NORM=norm, BT=CHUNK, DK=dk, DV=dv, num_warps=4 if block_k + block_v <= 128 else 8,
        )
    bv = _value_block(dk, dv, bsz * hv)
    has_h0 = initial_state is not None
    _state_kernel[(cdiv(dv, bv), bsz * hv)](
        kn, w, u, gc, hs, vn, initial_state.contiguous() if has_h0 else gc, final, t, nt, hv, group,
        *kn_strides,
        HAS_H0=has_h0, BT=CHUNK, DK=dk, DV=dv, BV=bv,
        num_warps=8 if block_k * bv >= 4096 else 4, num_stages=2,  # no register spills on sm_90
    )
    if nt:
        bv_o = _output_value_block(dv)
        _output_kernel[(nt, bsz * hv, cdiv(dv, bv_o))](
            q, kn, vn, gc, hs, o, scale, t, nt, hv, group,
            q.stride(0), q.stride(1), q.stride(2), *kn_strides,
            o.stride(0), o.stride(1), o.stride(2),
            NORM=norm, BT=CHUNK, DK=dk, DV=dv, BV=bv_o, num_warps=8 if block_k >= 128 else 4,
        )
    return o, final


@triton.jit
def _softplus(x):
    """torch.nn.functional.softplus (beta 1, threshold 20): log1p(exp(x)), x above 20."""
    y = tl.exp(-tl.abs(x))
    one_y = 1.0 + y
    log1p = tl.where(one_y == 1.0, y, tl.log(one_y) * (y / (one_y - 1.0)))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@kernel
def _recurrent_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, s_ptr, o_ptr, scale,
    T, H, GROUP,
    sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sab, sat, sah, sbb, sbt, sbh,
    ssb, ssh, ssk, sob, sot, soh,
    NORM: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
    scale = fp32(scale)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = (i_bh // H).to(tl.int64)
    h = i_bh % H
    hk = h // GROUP
    dk = tl.arange(0, head_block(DK))
    dk_ok = head_mask(dk, DK)
    cv = i_v * BV + tl.arange(0, BV)
    s_ptrs = s_ptr + b * ssb + h * ssh + dk[:, None] * ssk + cv[None, :]
    cv_ok = head_mask(cv, DV)
    s_ok = dk_ok[:, None] & cv_ok[None, :]
    s = tl.load(s_ptrs, mask=s_ok, other=0.0)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(T):
        q = tl.load(q_ptr + b * sqb + t * sqt + hk * sqh + dk, mask=dk_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b * skb + t * skt + hk * skh + dk, mask=dk_ok, other=0.0).to(tl.float32)
        if NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + b * svb + t * svt + h * svh + cv, mask=cv_ok, other=0.0).to(tl.float32)
        g = neg_a * _softplus(tl.load(a_ptr + b * sab + t * sat + h * sah).to(tl.float32) + dt_bias)
        braw = tl.load(b_ptr + b * sbb + t * sbt + h * sbh)
        beta = tl.sigmoid(braw.to(tl.float32)).to(braw.dtype).to(tl.float32)  # sigmoid in b's dtype
        s = s * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptr + b * sob + t * sot + h * soh + cv, o.to(o_ptr.dtype.element_ty), mask=cv_ok)
    tl.store(s_ptrs, s, mask=s_ok)


def recurrent_gated_delta_rule(q, k, v, a, b, A_log, dt_bias, state, scale: float, use_qk_l2norm: bool = True):
    """q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], a, b [B, T, Hv], A_log, dt_bias [Hv],
    state [B, Hv, Dk, Dv] fp32 (updated in place) -> o [B, T, Hv, Dv] in q.dtype."""
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    o = torch.empty((bsz, t, hv, dv), dtype=q.dtype, device=q.device)
    if bsz * hv == 0:
        return o
    bv = _value_block(dk, dv, bsz * hv)
    _recurrent_kernel[(cdiv(dv, bv), bsz * hv)](
        q, k, v, a, b, A_log, dt_bias, state, o, scale, t, hv, hv // hk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2), state.stride(0), state.stride(1), state.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        NORM=bool(use_qk_l2norm), DK=dk, DV=dv, BV=bv, num_warps=4,
    )
    return o


@kernel
def _gated_rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, y_ptr, ROWS, N, eps, stride_x, stride_z, stride_y,
    ROUND_WEIGHT_PRODUCT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    eps = fp32(eps)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = rows.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK_N)[None, :]
    mask = (rows < ROWS)[:, None] & (cols < N)
    xr = tl.load(x_ptr + r64 * stride_x + cols, mask=mask, other=0.0)
    x = xr.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    # transformers rounds the normalised x to x's dtype before the weight (and the product too
    # when the weight has x's dtype); the gate product is fp32.
    y = (x * rstd[:, None]).to(xr.dtype).to(tl.float32)
    y = y * tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    if ROUND_WEIGHT_PRODUCT:
        y = y.to(xr.dtype).to(tl.float32)
    z = tl.load(z_ptr + r64 * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
    y = y * (z * tl.sigmoid(z))
    tl.store(y_ptr + r64 * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rms_norm(x, z, weight, eps: float):
    """x, z [..., N], weight [N] -> rms_norm(x) * weight * silu(z) [..., N] in x.dtype (contiguous)."""
    n = x.shape[-1]
    y = empty_contiguous_like(x)
    x2, z2, y2 = flat_rows(x), flat_rows(z), flat_rows(y)
    rows = x2.shape[0]
    if rows == 0 or n == 0:
        return y
    block_n = next_power_of_2(n)
    block_r = max(1, min((16384 if INTERPRET else 2048) // block_n, next_power_of_2(rows)))
    _gated_rms_norm_kernel[(cdiv(rows, block_r),)](
        x2, z2, weight, y2, rows, n, eps, x2.stride(0), z2.stride(0), y2.stride(0),
        ROUND_WEIGHT_PRODUCT=weight.dtype == x.dtype, BLOCK_R=block_r, BLOCK_N=block_n,
        num_warps=row_warps(block_r * block_n),
    )
    return y


# ----------------------------------------------------------------------------- gates
#   gated_delta_gates(a, b [..., H], A_log, dt_bias [H]) -> (g, beta): the prefill's decays and
#   write strengths, g = -exp(A_log) * softplus(a + dt_bias) (fp32), beta = sigmoid(b) (b's dtype);
#   the recurrent kernel computes the same inline.


@kernel
def _gated_delta_gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, stride_a, stride_b, ROWS, H,
                              BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    r = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    h = tl.arange(0, BLOCK_H)[None, :]
    mask = (r < ROWS) & (h < H)
    neg_a = -tl.exp(tl.load(alog_ptr + h, mask=h < H, other=0.0).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h, mask=h < H, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + r * stride_a + h, mask=mask, other=0.0).to(tl.float32)
    tl.store(g_ptr + r * H + h, neg_a * _softplus(a + dt_bias), mask=mask)
    braw = tl.load(b_ptr + r * stride_b + h, mask=mask, other=0.0)
    tl.store(beta_ptr + r * H + h, tl.sigmoid(braw.to(tl.float32)).to(beta_ptr.dtype.element_ty), mask=mask)


def gated_delta_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """a, b [..., H] (last dim contiguous), A_log, dt_bias [H] -> (g [..., H] fp32, beta [..., H] in
    b's dtype), both contiguous."""
    h = a.shape[-1]
    g = torch.empty(a.shape, dtype=torch.float32, device=a.device)
    beta = empty_contiguous_like(b)
    if g.numel() == 0:
        return g, beta
    rows = g.numel() // h
    a2, b2 = a.reshape(rows, h), b.reshape(rows, h)
    block_h = next_power_of_2(h)
    block_r = min(next_power_of_2(rows), max(1, (16384 if INTERPRET else 2048) // block_h))
    _gated_delta_gates_kernel[(cdiv(rows, block_r),)](
        a2, b2, A_log, dt_bias, g, beta, a2.stride(0), b2.stride(0), rows, h,
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4)
    return g, beta
