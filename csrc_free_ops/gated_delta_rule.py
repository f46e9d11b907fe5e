"""Gated DeltaNet (Qwen3.5 linear attention): the chunked prefill, over a batch of equal lengths or
over packed sequences.

Per value head h (key head h // (Hv / Hk)), with an fp32 state S [Dk, Dv] and, per token t,
unit-norm (optionally) keys k_t, queries q_t * scale, values v_t, log decay g_t <= 0, beta_t:

    S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T q_t

Chunked form (chunk C = 64 tokens, positions i, j inside a chunk, G = cumsum of g in the chunk):
    A[i, j]  = beta_i (k_i . k_j) exp(G_i - G_j)  for j < i, 0 otherwise
    X        = (I + A)^{-1}                          (fp32: the 16 x 16 diagonal blocks by forward
                                                      substitution, merged 16 -> 32 -> 64 by products)
    W        = X (beta k exp(G)),   U = X (beta v)    (the WY / UT representation)
    V'       = U - W S                                (v_new: what the state does not predict yet)
    O        = (q exp(G)) S + mask_{i>=j}(q_i . k_j exp(G_i - G_j)) V'
    S        <- exp(G_last) S + k^T (exp(G_last - G) V')

Three kernels, as in flash-linear-attention: `_wy_kernel` (parallel over chunks) writes G, W,
U and the l2-normalised keys; `_state_kernel` (one program per (sequence, head, value block),
sequential over chunks) carries S in fp32 registers and writes V' and the state entering every
chunk; `_output_kernel` (parallel over chunks) computes O. Matrix products take the inputs'
dtype (bf16 tensor cores with fp32 accumulation; exact fp32 for fp32 inputs), so the
intermediates W, U, V', the normalised keys and the per-chunk states are stored in that dtype;
the running state stays fp32. Tile and warp choices have no register spills on sm_90 for
bf16 and Dk = Dv = 128 (checked with ptxas); fp32 inputs take exact-fp32 FMA products, correct
but slow. The inversion in `_wy_kernel` (`_unit_lower_inverse`) keeps its serial part inside
warps: 14 forward-substitution steps over the four 16 x 16 diagonal blocks at once, each block
in one warp, then four 64 x 64 tile products (sm_90, Dk = Dv = 128: no barrier in the loop, 32
bar.sync in the whole kernel). Dk and Dv are any multiples of 16 up to 256: a head is held in a
`head_block` block masked past its dim (value blocks are powers of two; the last one of a Dv that
is not is partly masked).

Packed sequences (`chunk_gated_delta_rule` with cu_seqlens: the rows of S sequences back to back, each
starting from its slot of a state pool or from zeros and leaving its final state there; one call
for the prefill chunks and decode tokens of an engine step): the same three kernels, as one batch
row of N packed rows. The parallel kernels' grids run over tile slots (gated_delta_rule_packing:
num_slots(N, S, 64) = N // 64 + S, from shapes only), each finding its sequence and chunk from
cu_seqlens on the device, so chunks never cross a sequence boundary (a sequence's last one may
be partial) and the programs past a sequence's chunks do nothing; the state kernel runs one
program per (sequence, head, value block). A batch of equal lengths is the fixed-length case:
chunk i of batch row b, states indexed by b.

The recurrent decode step, the gates and the gated RMSNorm: gated_delta_rule_step.py.
"""
import torch
import triton
import triton.language as tl

from .common import INTERPRET, cdiv, dot, fp32, head_block, head_mask, kernel, next_power_of_2, target_programs
from .gated_delta_rule_packing import num_slots, packed_tile, seq_block

CHUNK = 64


@triton.jit
def _l2norm_scale(x, NORM: tl.constexpr):
    """rsqrt(sum(x^2) + 1e-6) per row [R] of x [R, D], in fp32 (transformers' / FLA's l2norm);
    1 without NORM."""
    if NORM:
        xf = x.to(tl.float32)
        return tl.rsqrt(tl.sum(xf * xf, axis=1) + 1e-6)
    return tl.full((x.shape[0],), 1.0, dtype=tl.float32)


@triton.jit
def _l2norm_rows(x, NORM: tl.constexpr):
    """x [R, D] fp32 -> each row times its `_l2norm_scale` (x itself without NORM)."""
    if NORM:
        x = x * _l2norm_scale(x, NORM)[:, None]
    return x


@triton.jit
def _dot_f32(a, b, TF32: tl.constexpr):
    """a @ b for fp32 tiles: tf32 tensor cores (TF32), else exact fp32."""
    acc = tl.zeros((a.shape[0], b.shape[1]), dtype=tl.float32)
    if TF32:
        return tl.dot(a, b, acc, input_precision="tf32")
    return dot(a, b, acc)


@triton.jit
def _decayed_kkt(kl, kr, gc, UPPER: tl.constexpr):
    """The strictly lower (UPPER: strictly upper) part of (kl kr^T) * exp(G_row - G_col) (UPPER:
    exp(G_col - G_row)) [BT, BT] fp32, for kl, kr [BT, D] and gc = G [BT]: A for (beta k, k),
    A^T for (k, beta k). A^T from its own product, not tl.trans(A), for the layout of a product
    (rows across warps, 16 to a warp): a relabelled transpose has its columns across warps."""
    rows = tl.arange(0, kl.shape[0])
    if UPPER:
        keep = rows[:, None] < rows[None, :]
        dg = gc[None, :] - gc[:, None]
    else:
        keep = rows[:, None] > rows[None, :]
        dg = gc[:, None] - gc[None, :]
    kk = dot(kl, tl.trans(kr), tl.zeros((kl.shape[0], kr.shape[0]), dtype=tl.float32))
    return tl.where(keep, kk * tl.exp(tl.where(keep, dg, 0.0)), 0.0)


@triton.jit
def _diagonal_blocks(a, BLK: tl.constexpr):
    """a [BT, BT] -> its BT/BLK diagonal BLK x BLK blocks [BT/BLK, BLK, BLK]. In a product's
    layout (a warp holds 16 rows, each thread columns of every block) the sum over the block
    columns stays inside a thread (with 8 warps, inside the two warp groups, which hold half of
    the columns each, and one exchange between them) and each block lands in one warp."""
    NB: tl.constexpr = a.shape[0] // BLK
    nb = tl.arange(0, NB)
    same = (nb[:, None] == nb[None, :])[:, None, :, None]
    return tl.sum(tl.where(same, tl.reshape(a, (NB, BLK, NB, BLK)), 0.0), axis=2)


@triton.jit
def _diagonal_inverses(a, at, BLK: tl.constexpr):
    """(I + a_b)^{-1} for strictly lower blocks a [NB, BLK, BLK] (at: each one transposed), in fp32
    by forward substitution, every block at once -> [NB, BLK, BLK].

    Row i of Z = (I + a_b)^{-1} - I is Z_i = -a_i - sum_{k<i} a[i, k] Z_k: Z starts as -a (rows 0
    and 1 are final, row i is -a_i until step i), and step i (2 .. BLK-1) replaces row i. Its
    product reduces over Z's rows; a_i, indexed along those rows, is column i of at (a reduction
    that does not wait for the previous steps). With each block inside one warp (_diagonal_blocks)
    the steps take warp shuffles only: no shared memory, no barrier."""
    idx = tl.arange(0, BLK)
    z = -a
    for i in range(2, BLK):
        a_i = tl.sum(tl.where((idx == i)[None, None, :], at, 0.0), axis=2)  # [NB, BLK]: a[b, i, :]
        r = tl.sum(a_i[:, :, None] * z, axis=1)  # [NB, BLK]: sum_k a[b, i, k] Z[b, k, :]
        z = tl.where((idx == i)[None, :, None], z - r[:, None, :], z)
    eye = (idx[:, None] == idx[None, :]).to(tl.float32)
    return z + eye[None, :, :]


@triton.jit
def _block_diagonal(d, BT: tl.constexpr):
    """d [BT/BLK, BLK, BLK] -> the block-diagonal [BT, BT] tile with blocks d[0], d[1], ..."""
    NB: tl.constexpr = d.shape[0]
    nb = tl.arange(0, NB)
    same = (nb[:, None] == nb[None, :])[:, None, :, None]
    return tl.reshape(tl.where(same, d[:, :, None, :], 0.0), (BT, BT))


@triton.jit
def _merge_blocks(x, a, LO: tl.constexpr, TF32: tl.constexpr):
    """x [BT, BT] block diagonal: the inverses of the LO x LO diagonal blocks of I + a (a strictly
    lower) -> those of its 2LO x 2LO diagonal blocks. Each is [[P, 0], [C, Q]], whose inverse is
    [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]]: x - x c x, with c the C blocks of a (zero elsewhere). The
    product is exactly zero on x's blocks, which keep their fp32 values."""
    rows = tl.arange(0, x.shape[0])
    pair = (rows // (2 * LO))[:, None] == (rows // (2 * LO))[None, :]
    c = tl.where(pair & ((rows // LO)[:, None] != (rows // LO)[None, :]), a, 0.0)
    return x - _dot_f32(_dot_f32(x, c, TF32), x, TF32)


@triton.jit
def _unit_lower_inverse(kb, kd, gc, BT: tl.constexpr, BLK: tl.constexpr, TF32: tl.constexpr):
    """X = (I + A)^{-1} [BT, BT] fp32 for A = strictly lower(beta k k^T exp(G_i - G_j)), from
    kb = beta k, kd = k [BT, D] (the dots' dtype) and gc = G [BT], as flash-linear-attention's
    solve_tril: the BLK x BLK diagonal blocks inverted in fp32 arithmetic, then merged two by two
    (BLK -> 2 BLK -> ... -> BT) with two tile products a level (tf32 with TF32: for bf16 / fp16
    inputs, whose W and U take X rounded to 16 bits; exact fp32 otherwise)."""
    a = _decayed_kkt(kb, kd, gc, False)
    at = _decayed_kkt(kd, kb, gc, True)
    x = _block_diagonal(_diagonal_inverses(_diagonal_blocks(a, BLK), _diagonal_blocks(at, BLK), BLK), BT)
    for level in tl.static_range(BT.bit_length() - BLK.bit_length()):  # log2(BT / BLK) levels
        x = _merge_blocks(x, a, BLK << level, TF32)
    return x


@triton.jit
def _chunk_rows(pid_c, pid_bh, H, T, cu_ptr, S, VARLEN: tl.constexpr, BT: tl.constexpr, BLOCK_S: tl.constexpr):
    """The chunk of a program parallel over chunks -> (b, h, t0, t_end): batch row b (int64), value
    head h and the chunk's rows [t0, t_end) (none when t_end <= t0). Fixed length: chunk pid_c of
    batch row pid_bh // H. VARLEN (one batch row of T = N packed rows): the chunk in tile slot
    pid_c (gated_delta_rule_packing), never crossing its sequence's end; pid_c is also its slot
    in the per-chunk states."""
    if VARLEN:
        seq, bos, eos, t0 = packed_tile(pid_c, cu_ptr, S, BT, BLOCK_S)
        t_end = min(t0 + BT, eos)
    else:
        t0 = pid_c * BT
        t_end = min(t0 + BT, T)
    return (pid_bh // H).to(tl.int64), pid_bh % H, t0, t_end


@kernel
def _wy_kernel(
    k_ptr, v_ptr, g_ptr, beta_ptr, w_ptr, u_ptr, gc_ptr, kn_ptr, cu_ptr,
    T, H, GROUP, S,
    skb, skt, skh, svb, svt, svh, sgb, sgt, sgh, sbb, sbt, sbh,
    NORM: tl.constexpr, VARLEN: tl.constexpr, BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One chunk of (b, h): G = cumsum(g) -> gc [B, H, T]; W, U -> [B, H, T, DK / DV]; with NORM,
    the normalised keys -> kn [B, Hk, T, DK] (by the first value head of each key head)."""
    b, h, t0, t_end = _chunk_rows(tl.program_id(0), tl.program_id(1), H, T, cu_ptr, S, VARLEN, BT, BLOCK_S)
    i_bh = b * H + h
    hk = h // GROUP
    DT = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    t = t0 + rows
    tm = t < t_end
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
    bh_t = i_bh * T + t64
    tl.store(gc_ptr + bh_t, gc, mask=tm)
    kd = k.to(DT)
    if NORM:
        if h % GROUP == 0:
            bk_t = (b * (H // GROUP) + hk) * T + t64
            tl.store(kn_ptr + bk_t[:, None] * DK + dk[None, :], kd, mask=k_ok)
    kb = (k * beta[:, None]).to(DT)
    kw = (k * (beta * tl.exp(gc))[:, None]).to(DT)

    x = _unit_lower_inverse(kb, kd, gc, BT, 16, DT != tl.float32).to(DT)  # (I + A)^{-1}
    w = dot(x, kw, tl.zeros((BT, head_block(DK)), dtype=tl.float32))
    tl.store(w_ptr + bh_t[:, None] * DK + dk[None, :], w.to(DT), mask=k_ok)
    v = tl.load(v_ptr + b * svb + h * svh + t64[:, None] * svt + dv[None, :], mask=v_ok, other=0.0)
    u = dot(x, (v.to(tl.float32) * beta[:, None]).to(DT), tl.zeros((BT, head_block(DV)), dtype=tl.float32))
    tl.store(u_ptr + bh_t[:, None] * DV + dv[None, :], u.to(DT), mask=v_ok)


@kernel
def _state_kernel(
    k_ptr, w_ptr, u_ptr, gc_ptr, h_ptr, vn_ptr, h0_ptr, ht_ptr, cu_ptr, slot_ptr, cont_ptr,
    T, NT, H, GROUP,
    skb, skt, skh,
    HAS_H0: tl.constexpr, VARLEN: tl.constexpr,
    BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
    """Sequential over the chunks of one sequence for (head, value block): writes the state entering
    each chunk (h [B, H, NT, DK, DV], at the chunk's slot), V' ([B, H, T, DV]) and the final state
    (ht, fp32). Fixed length: sequence = batch row pid // H, states h0 / ht [B, H, DK, DV].
    VARLEN: sequence pid // H of the packed rows, its state row slot[seq] of the pool h0 = ht
    [P, H, DK, DV] (read where cont[seq], else zeros; written back in place unless the sequence is
    empty). k: the keys as the state sees them (normalised already). k^T (exp(G_last - G) V')
    scales V' rows, not keys."""
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    h = i_bh % H
    hk = h // GROUP
    DT = k_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    dk = tl.arange(0, head_block(DK))
    dk_ok = head_mask(dk, DK)
    cv = i_v * BV + tl.arange(0, BV)
    cv_ok = head_mask(cv, DV)
    s_ok = dk_ok[:, None] & cv_ok[None, :]
    if VARLEN:
        seq = i_bh // H
        b = (seq * 0).to(tl.int64)
        bos = tl.load(cu_ptr + seq)
        eos = tl.load(cu_ptr + seq + 1)
        slot0 = bos // BT + seq
        srow = tl.load(slot_ptr + seq).to(tl.int64)
        h0_ok = tl.where(tl.load(cont_ptr + seq) != 0, s_ok, False)
        ht_ok = tl.where(eos > bos, s_ok, False)
    else:
        b = (i_bh // H).to(tl.int64)
        bos = 0
        eos = T
        slot0 = 0
        srow = b
        h0_ok = s_ok
        ht_ok = s_ok
    bh = b * H + h
    state_off = (srow * H + h) * DK * DV + dk[:, None] * DV + cv[None, :]
    if HAS_H0:
        s = tl.load(h0_ptr + state_off, mask=h0_ok, other=0.0).to(tl.float32)
    else:
        s = tl.zeros((head_block(DK), BV), dtype=tl.float32)
    for i_t in range(tl.cdiv(eos - bos, BT)):
        tl.store(h_ptr + (bh * NT + slot0 + i_t) * DK * DV + dk[:, None] * DV + cv[None, :], s.to(DT), mask=s_ok)
        t0 = bos + i_t * BT
        t = t0 + rows
        tm = t < eos
        t64 = t.to(tl.int64)
        bh_t = bh * T + t64
        k_ok = tm[:, None] & dk_ok[None, :]
        v_ok = tm[:, None] & cv_ok[None, :]
        w = tl.load(w_ptr + bh_t[:, None] * DK + dk[None, :], mask=k_ok, other=0.0)
        u = tl.load(u_ptr + bh_t[:, None] * DV + cv[None, :], mask=v_ok, other=0.0)
        vn = u.to(tl.float32) - dot(w, s.to(DT), tl.zeros((BT, BV), dtype=tl.float32))
        vn = vn.to(DT)
        tl.store(vn_ptr + bh_t[:, None] * DV + cv[None, :], vn, mask=v_ok)
        gc = tl.load(gc_ptr + bh_t, mask=tm, other=0.0)
        g_last = tl.load(gc_ptr + bh * T + min(t0 + BT, eos) - 1)
        k = tl.load(k_ptr + b * skb + hk * skh + t64[:, None] * skt + dk[None, :], mask=k_ok, other=0.0)
        vd = (vn.to(tl.float32) * tl.exp(g_last - gc)[:, None]).to(DT)
        s = dot(tl.trans(k), vd, s * tl.exp(g_last))
    tl.store(ht_ptr + state_off, s, mask=ht_ok)


@kernel
def _output_kernel(
    q_ptr, k_ptr, vn_ptr, gc_ptr, h_ptr, o_ptr, cu_ptr, scale,
    T, NT, H, GROUP, S,
    sqb, sqt, sqh, skb, skt, skh, sob, sot, soh,
    NORM: tl.constexpr, VARLEN: tl.constexpr, BT: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    BV: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """O of one chunk for (b, h, value block): (q exp(G)) S_chunk + causal(q k^T exp(G_i - G_j)) V'
    (q normalised here, k as stored by _wy_kernel)."""
    scale = fp32(scale)
    i_t = tl.program_id(0)
    b, h, t0, t_end = _chunk_rows(i_t, tl.program_id(1), H, T, cu_ptr, S, VARLEN, BT, BLOCK_S)
    i_bh = b * H + h
    i_v = tl.program_id(2)
    hk = h // GROUP
    DT = q_ptr.dtype.element_ty
    rows = tl.arange(0, BT)
    t = t0 + rows
    tm = t < t_end
    t64 = t.to(tl.int64)
    bh_t = i_bh * T + t64
    dk = tl.arange(0, head_block(DK))
    dk_ok = head_mask(dk, DK)
    k_ok = tm[:, None] & dk_ok[None, :]
    cv = i_v * BV + tl.arange(0, BV)

    q = tl.load(q_ptr + b * sqb + hk * sqh + t64[:, None] * sqt + dk[None, :], mask=k_ok, other=0.0)
    r = _l2norm_scale(q, NORM) * scale
    k = tl.load(k_ptr + b * skb + hk * skh + t64[:, None] * skt + dk[None, :], mask=k_ok, other=0.0)
    gc = tl.load(gc_ptr + bh_t, mask=tm, other=0.0)
    cv_ok = head_mask(cv, DV)
    v_ok = tm[:, None] & cv_ok[None, :]
    s = tl.load(h_ptr + (i_bh * NT + i_t) * DK * DV + dk[:, None] * DV + cv[None, :],
                mask=tl.where(t0 < t_end, dk_ok[:, None] & cv_ok[None, :], False), other=0.0)
    o = dot(q, s, tl.zeros((BT, BV), dtype=tl.float32)) * (r * tl.exp(gc))[:, None]
    a = dot(q, tl.trans(k), tl.zeros((BT, BT), dtype=tl.float32))
    causal = rows[:, None] >= rows[None, :]
    a = tl.where(causal, a * r[:, None] * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0)
    vn = tl.load(vn_ptr + bh_t[:, None] * DV + cv[None, :], mask=v_ok, other=0.0)
    o = dot(a.to(DT), vn, o)
    tl.store(o_ptr + b * sob + h * soh + t64[:, None] * sot + cv[None, :], o.to(o_ptr.dtype.element_ty),
             mask=v_ok)


def _value_block(dk: int, dv: int, programs_per_block: int, target: int) -> int:
    """Value columns per program of the sequential kernels (a power of two; cdiv(dv, block)
    programs, the last one's columns past dv masked): the fp32 state tile [head_block(DK), BV]
    stays in registers (<= 8K elements), and narrower blocks when (batch x heads) is too small to
    make half of `target` programs (`target_programs`)."""
    if INTERPRET:
        return next_power_of_2(dv)
    bv = min(next_power_of_2(dv), 64 if dk <= 64 else 32 if dk <= 128 else 16)
    while bv > 16 and programs_per_block * cdiv(dv, bv) < target // 2:
        bv //= 2
    return bv


def _output_value_block(dv: int) -> int:
    """Value columns per program of `_output_kernel` (parallel over chunks: no state in registers)."""
    return next_power_of_2(dv) if INTERPRET else min(next_power_of_2(dv), 64)


def _chunk(q, k, v, g, beta, scale, norm, o, h0, ht, packed=None):
    """The three launches over q, k [B, T, Hk, Dk], v, o [B, T, Hv, Dv], g, beta [B, T, Hv] (strides
    free but the last dim's). Fixed length: h0 (or None) and ht [B, Hv, Dk, Dv]. packed = (cu_seqlens,
    state_slots, continues) with B = 1: T packed rows, h0 = ht the state pool."""
    bsz, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    dev, dt = q.device, q.dtype
    varlen = packed is not None
    seqs = packed[1].shape[0] if varlen else bsz
    nt = num_slots(t, seqs, CHUNK) if varlen else cdiv(t, CHUNK)  # chunks (varlen: tile slots) a batch row
    if seqs * hv == 0:
        return
    cu, slots, cont = packed if varlen else (q, q, q)  # (unread pointers when not varlen)
    block_s = seq_block(seqs) if varlen else 1
    group = hv // hk
    block_k, block_v = next_power_of_2(dk), next_power_of_2(dv)  # the kernels' head blocks (common.head_block)
    gc = torch.empty((bsz, hv, t), dtype=torch.float32, device=dev)
    w = torch.empty((bsz, hv, t, dk), dtype=dt, device=dev)
    u = torch.empty((bsz, hv, t, dv), dtype=dt, device=dev)
    vn = torch.empty((bsz, hv, t, dv), dtype=dt, device=dev)
    hs = torch.empty((bsz, hv, nt, dk, dv), dtype=dt, device=dev)
    # The keys as the state and output kernels read them: normalised once by _wy_kernel.
    kn = torch.empty((bsz, hk, t, dk), dtype=dt, device=dev) if norm else k
    kn_strides = (hk * t * dk, dk, t * dk) if norm else (k.stride(0), k.stride(1), k.stride(2))
    if nt:
        _wy_kernel[(nt, bsz * hv)](
            k, v, g, beta, w, u, gc, kn, cu, t, hv, group, seqs,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            g.stride(0), g.stride(1), g.stride(2), beta.stride(0), beta.stride(1), beta.stride(2),
            NORM=norm, VARLEN=varlen, BT=CHUNK, DK=dk, DV=dv, BLOCK_S=block_s,
            # Dk = Dv = 128: 237 registers at 4 warps, no spills (sm_90). With Dv <= 32 Triton 3.6 computes
            # a wrong U at 4 warps for sm_90 (an H100: relative error near 1), a right one at 8.
            num_warps=4 if block_k + block_v <= 256 and block_v > 32 else 8,
        )
    bv = _value_block(dk, dv, seqs * hv, target_programs(dev))
    has_h0 = h0 is not None
    _state_kernel[(cdiv(dv, bv), seqs * hv)](
        kn, w, u, gc, hs, vn, h0 if has_h0 else gc, ht, cu, slots, cont, t, nt, hv, group,
        *kn_strides,
        HAS_H0=has_h0, VARLEN=varlen, BT=CHUNK, DK=dk, DV=dv, BV=bv,
        num_warps=8 if block_k * bv >= 4096 else 4, num_stages=2,  # no register spills on sm_90
    )
    if nt:
        bv_o = _output_value_block(dv)
        _output_kernel[(nt, bsz * hv, cdiv(dv, bv_o))](
            q, kn, vn, gc, hs, o, cu, scale, t, nt, hv, group, seqs,
            q.stride(0), q.stride(1), q.stride(2), *kn_strides,
            o.stride(0), o.stride(1), o.stride(2),
            NORM=norm, VARLEN=varlen, BT=CHUNK, DK=dk, DV=dv, BV=bv_o, BLOCK_S=block_s,
            # Dk = Dv = 128: 150 registers at 4 warps, 3 programs an SM (sm_90). Value blocks of 32 columns
            # or fewer with Dk >= 64 take 8: at 4 Triton 3.6 computes wrong outputs for sm_90 (an H100).
            num_warps=4 if block_k <= 128 and (bv_o > 32 or block_k <= 32) else 8,
        )


def chunk_gated_delta_rule(q, k, v, g, beta, scale: float, state=None, cu_seqlens=None, state_slots=None,
                           continues=None, use_qk_l2norm: bool = False):
    """o in q.dtype. Without cu_seqlens: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv],
    state [B, Hv, Dk, Dv] fp32 contiguous or None (row b: sequence b's initial state, replaced by
    its final one) -> o [B, T, Hv, Dv]. With cu_seqlens [S + 1]: q, k [N, Hk, Dk], v [N, Hv, Dv],
    g, beta [N, Hv] (sequence i the rows cu_seqlens[i]:cu_seqlens[i + 1]), state [P, Hv, Dk, Dv]
    fp32 contiguous (sequence i starts from row state_slots[i] where continues[i], else zeros, and
    leaves its final state there) -> o [N, Hv, Dv]."""
    norm = bool(use_qk_l2norm)
    o = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    if cu_seqlens is not None:
        _chunk(q[None], k[None], v[None], g[None], beta[None], scale, norm, o[None], state, state,
               (cu_seqlens, state_slots, continues))
        return o
    if state is None:
        bsz, _, _, dk = k.shape
        final = torch.empty((bsz, v.shape[2], dk, v.shape[3]), dtype=torch.float32, device=q.device)
        _chunk(q, k, v, g, beta, scale, norm, o, None, final)
    else:  # each (sequence, head, value block) program reads its state before it writes it
        work = state if state.is_contiguous() else state.contiguous()
        _chunk(q, k, v, g, beta, scale, norm, o, work, work)
        if work is not state:
            state.copy_(work)
    return o
