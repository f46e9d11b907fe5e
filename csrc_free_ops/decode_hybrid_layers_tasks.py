"""The Gated DeltaNet tasks of the hybrid persistent decode kernel (csrc_free_ops/decode_hybrid_layers.py),
beside the attention and MLP tasks of decode_layers_tasks.py whose wait, release and tiles they use.
Each loads what does not depend on the phase before (weights, a sequence's old state) before it
waits; each runs for every row m < M, and a row writes its state only where `_keeps` (a real
sequence, cache_seqlens > 0, with a slot in [0, P)); it continues its slot's state where
cache_seqlens > 1, else starts from zeros (its first token). TIMELINE: the wait stamps the time it
was met at stamp_ptr[1] (decode_layers_tasks' `_wait`).

    _conv_task        channels [c0, c0 + ROWS): y[m, c] = silu(sum_j<K-1 w[c, j] state[m, c, j]
                      + w[c, K-1] x[m, c]) with x = proj[m, :C]; the conv state shifted by one in
                      place, x its last column
    _delta_rule_task  (sequence m, value head h, value block v0): the recurrent gated delta rule
                      step of recurrent_gated_delta_rule_varlen on the fp32 state slice
                      [Dk, v0:v0 + BV], in place
    _gated_out_task   out[m, rows] = res[m, rows] + round(gated_rms_norm(o[m], z[m]) @ w[rows]^T)
                      (out_proj with the gated RMSNorm over each value head folded into its input)
"""
import triton
import triton.language as tl

from .common import head_block, head_mask
from .decode_layers_tasks import _finish, _rounded, _wait
from .gated_delta_rule_step import _softplus


@triton.jit
def _keeps(seqlens_ptr, slot_ptr, rows, ok, P):
    """(slot, keeps, continues) of sequences `rows` (where ok): keeps where the row is a sequence
    (cache_seqlens > 0) with a slot in [0, P); continues where it keeps and has cached positions."""
    lens = tl.load(seqlens_ptr + rows, mask=ok, other=0)
    slot = tl.load(slot_ptr + rows, mask=ok, other=-1).to(tl.int64)
    keeps = ok & (lens > 0) & (slot >= 0) & (slot < P)
    return slot, keeps, keeps & (lens > 1)


@triton.jit
def _conv_task(proj_ptr, w_ptr, conv_ptr, slot_ptr, seqlens_ptr, y_ptr, cnt_ptr, err_ptr, c0, M, P, phase, target,
               done, NP: tl.constexpr, C: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
               SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """The conv update of channels [c0, c0 + ROWS) for every row (see the module doc); conv_ptr the
    layer's pool [P, C, K-1]. The weights and the old states are loaded (and their taps summed)
    before the wait for `phase` (the in_proj tiles); counts itself in on phase + 1."""
    KS: tl.constexpr = triton.next_power_of_2(K - 1)
    rm = tl.arange(0, BLOCK_M)
    rc = c0 + tl.arange(0, ROWS)
    rj = tl.arange(0, KS)
    m_ok = rm < M
    c_ok = rc < C
    j_ok = rj < K - 1
    slot, keeps, continues = _keeps(seqlens_ptr, slot_ptr, rm, m_ok, P)
    w_old = tl.load(w_ptr + rc[:, None] * K + rj[None, :], mask=c_ok[:, None] & j_ok[None, :], other=0.0)
    w_new = tl.load(w_ptr + rc * K + K - 1, mask=c_ok, other=0.0).to(tl.float32)
    rows = conv_ptr + slot[:, None] * (C * (K - 1)) + rc[None, :] * (K - 1)  # [BLOCK_M, ROWS]
    s_ok = c_ok[None, :, None] & j_ok[None, None, :]
    old = tl.load(rows[:, :, None] + rj[None, None, :], mask=continues[:, None, None] & s_ok, other=0.0)
    acc = tl.sum(old.to(tl.float32) * w_old.to(tl.float32)[None, :, :], axis=2)
    done = _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    ok = m_ok[:, None] & c_ok[None, :]
    x = tl.load(proj_ptr + rm[:, None] * NP + rc[None, :], mask=ok, other=0.0, cache_modifier=".cg")
    acc += x.to(tl.float32) * w_new[None, :]
    tl.store(y_ptr + rm[:, None] * C + rc[None, :], (acc * tl.sigmoid(acc)).to(y_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()  # every thread has read the old state before it shifts in place
    shifted = keeps[:, None, None] & s_ok & (rj >= 1)[None, None, :]
    tl.store(rows[:, :, None] + (rj - 1)[None, None, :], old, mask=shifted)
    tl.store(rows + (K - 2), x.to(conv_ptr.dtype.element_ty), mask=keeps[:, None] & c_ok[None, :])
    _finish(cnt_ptr, phase + 1)
    return done


@triton.jit
def _delta_rule_task(y_ptr, proj_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, seqlens_ptr, o_ptr, cnt_ptr, err_ptr,
                     m, h, v0, M, P, phase, target, done, scale, NP: tl.constexpr, HKL: tl.constexpr,
                     HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                     SPIN_LIMIT: tl.constexpr, stamp_ptr, TIMELINE: tl.constexpr):
    """One token of sequence m through value head h's state columns [v0, v0 + BV) (the math of
    gated_delta_rule_step._recurrent_kernel): q, k, v from the conv output y [M, C], a and b from
    proj [M, NP]; state_ptr the layer's pool [P, Hv, Dk, Dv] fp32. The state slice and the gate
    parameters are loaded before the wait for `phase` (the conv tiles); counts itself in on phase + 1."""
    KD: tl.constexpr = HKL * DK
    C: tl.constexpr = 2 * KD + HV * DV
    dk = tl.arange(0, head_block(DK))
    dk_ok = head_mask(dk, DK)
    cv = v0 + tl.arange(0, BV)
    cv_ok = cv < DV
    slot, keeps, continues = _keeps(seqlens_ptr, slot_ptr, m, m < M, P)
    s_ptrs = state_ptr + slot * (HV * DK * DV) + h * (DK * DV) + dk[:, None] * DV + cv[None, :]
    s_ok = dk_ok[:, None] & cv_ok[None, :]
    s = tl.load(s_ptrs, mask=tl.where(continues, s_ok, False), other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dt_bias = tl.load(dtb_ptr + h).to(tl.float32)
    done = _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    hk = h // (HV // HKL)
    row = y_ptr + m * C
    q = tl.load(row + hk * DK + dk, mask=dk_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    k = tl.load(row + KD + hk * DK + dk, mask=dk_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    v = tl.load(row + 2 * KD + h * DV + cv, mask=cv_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    gates = proj_ptr + m * NP + C + HV * DV  # b, then a
    g = neg_a * _softplus(tl.load(gates + HV + h, cache_modifier=".cg").to(tl.float32) + dt_bias)
    braw = tl.load(gates + h, cache_modifier=".cg")
    beta = tl.sigmoid(braw.to(tl.float32)).to(braw.dtype).to(tl.float32)  # sigmoid in b's dtype
    s = s * tl.exp(g)
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + m * (HV * DV) + h * DV + cv, o.to(o_ptr.dtype.element_ty), mask=cv_ok)
    tl.store(s_ptrs, s.to(state_ptr.dtype.element_ty), mask=tl.where(keeps, s_ok, False))
    _finish(cnt_ptr, phase + 1)
    return done


@triton.jit
def _gated_out_task(o_ptr, proj_ptr, nw_ptr, w_ptr, res_ptr, out_ptr, cnt_ptr, err_ptr, row0, M, phase, target, done,
                    eps, N: tl.constexpr, NP: tl.constexpr, Z0: tl.constexpr, HV: tl.constexpr, DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, ROWS: tl.constexpr, SPIN_LIMIT: tl.constexpr, stamp_ptr,
                    TIMELINE: tl.constexpr):
    """out[m, rows] = res[m, rows] + round(gated_rms_norm(o[m], z[m], nw) @ w[rows]^T), o [M, Hv Dv]
    the delta rule's output, z = proj[m, Z0:Z0 + Hv Dv]; each value head normed over its Dv with
    gated_rms_norm's roundings. The weight tile [ROWS, Hv, Dv] (whole K, by heads) is loaded
    before the wait for `phase` (the delta rule tasks); counts itself in on phase + 1."""
    VD: tl.constexpr = HV * DV
    rh = tl.arange(0, triton.next_power_of_2(HV))
    rd = tl.arange(0, head_block(DV))
    cols = rh[:, None] * DV + rd[None, :]
    ok = (rh < HV)[:, None] & head_mask(rd, DV)[None, :]
    rn = row0 + tl.arange(0, ROWS)
    w = tl.load(w_ptr + rn[:, None, None].to(tl.int64) * VD + cols[None, :, :],
                mask=(rn < N)[:, None, None] & ok[None, :, :], other=0.0)
    nw = tl.load(nw_ptr + rd, mask=head_mask(rd, DV), other=0.0).to(tl.float32)
    done = _wait(cnt_ptr, err_ptr, phase, target, done, SPIN_LIMIT, stamp_ptr, TIMELINE)
    dtype = out_ptr.dtype.element_ty
    for m in tl.static_range(BLOCK_M):
        if m < M:
            o = tl.load(o_ptr + m * VD + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            z = tl.load(proj_ptr + m * NP + Z0 + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            rstd = tl.rsqrt(tl.sum(o * o, axis=1) / DV + eps)
            a = _rounded(_rounded(o * rstd[:, None], dtype) * nw[None, :], dtype)  # nw has the model dtype
            a = _rounded(a * (z * tl.sigmoid(z)), dtype)
            y = _rounded(tl.sum(tl.sum(w.to(tl.float32) * a[None, :, :], axis=2), axis=1), dtype)
            y += tl.load(res_ptr + m * N + rn, mask=rn < N, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(out_ptr + m * N + rn, y.to(dtype), mask=rn < N)
    _finish(cnt_ptr, phase + 1)
    return done
