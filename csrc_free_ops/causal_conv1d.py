"""Depthwise causal conv1d + SiLU over channels-last activations (Qwen3.5 Gated DeltaNet).

    y[b, t, c] = silu(sum_j weight[c, j] * xs[b, c, t + j]),  j < K
    xs[b, c] = [state[b, c, 0:K-1], x[b, 0:T, c]]   (the K-1 inputs before t = 0, then x)

x [B, T, C] (last dim contiguous, other strides free), weight [C, K], state [B, C, K-1]
(zeros when absent). The new state is the last K-1 columns of xs, in x's dtype.
fp32 math, y in x's dtype.

One kernel serves fixed-length and packed sequences (`causal_conv1d` without and with
`cu_seqlens`). Program (b, t-range, c-block) of the fixed-length form computes the outputs of its
T range for BLOCK_C channels: for each of the K taps it loads the [BLOCK_T, BLOCK_C] input tile
shifted by the tap (rows before t = 0 come from the state), so each input is read K times, from
L1/L2. The program of the first t-range also writes the new state.

Packed sequences (x [N, C], cu_seqlens, a state pool, per-sequence slots and
"continues" flags; prefill chunks and decode tokens of one engine step in one launch): the same
kernel over tiles of 64 rows (128 in steps of 1024 rows or more, as for a fixed-length prefill of
that many rows: `_blocks`) that never cross a sequence boundary (gated_delta_rule_packing);
the first tile of a sequence is the only one that reads its old state (positions < K - 1) and
writes its new one, in place, after a barrier. A program walks its tile in blocks of at most 16
rows, and of 1 row where the step has one row a sequence or fewer on average (a decode step,
where 15 of 16 rows would be masked: docs/performance.md).
"""
import torch
import triton
import triton.language as tl

from .common import INTERPRET, cdiv, kernel, next_power_of_2
from .gated_delta_rule_packing import num_slots, packed_tile, seq_block


@triton.jit
def _conv_block(x_cols, s_cols, w_ptr, y_rows, t0, t_hi, rows, cols, cmask, keep, stride_xt, stride_yt, stride_sik,
                stride_wc, stride_wk, K: tl.constexpr, WITH_STATE: tl.constexpr):
    """The outputs of rows [t0, t0 + BLOCK_T) (those < t_hi) for the program's channels; inputs at
    positions < 0 come from the old state (WITH_STATE, where ``keep``), else are zeros."""
    t = t0 + rows
    m = (t < t_hi)[:, None] & cmask[None, :]
    acc = tl.zeros((rows.shape[0], cols.shape[0]), dtype=tl.float32)
    for j in tl.static_range(K):
        src = t + (j - (K - 1))  # input position read by tap j
        w = tl.load(w_ptr + cols.to(tl.int64) * stride_wc + j * stride_wk, mask=cmask, other=0.0).to(tl.float32)
        xv = tl.load(x_cols + tl.maximum(src, 0).to(tl.int64)[:, None] * stride_xt,
                     mask=m & (src >= 0)[:, None], other=0.0).to(tl.float32)
        if WITH_STATE:
            if j < K - 1:
                xv += tl.load(s_cols + (K - 1 + tl.minimum(src, 0))[:, None] * stride_sik,
                              mask=tl.where(keep, m & (src < 0)[:, None], False), other=0.0).to(tl.float32)
        acc += xv * w[None, :]
    y = acc * tl.sigmoid(acc)
    tl.store(y_rows + t.to(tl.int64)[:, None] * stride_yt + cols[None, :], y.to(y_rows.dtype.element_ty), mask=m)


@kernel
def _conv_kernel(
    x_ptr, w_ptr, s_in_ptr, y_ptr, s_out_ptr, cu_ptr, slot_ptr, cont_ptr,
    T, C, T_PER_PROG, S,
    stride_xb, stride_xt, stride_xc, stride_yb, stride_yt,
    stride_sib, stride_sic, stride_sik, stride_sob, stride_soc, stride_sok, stride_wc, stride_wk,
    K: tl.constexpr, HAS_STATE: tl.constexpr, VARLEN: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_SEQ: tl.constexpr,
):
    """Fixed length: program (b, t-range, c-block), the state rows b. VARLEN: program (tile slot,
    0, c-block) of packed sequences (gated_delta_rule_packing), the state rows slot[seq], read
    only where cont[seq]; T_PER_PROG is the tile, so the first tile is the only reader of the old
    state (its positions < K - 1) and the only writer of the new one."""
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    if VARLEN:
        seq, bos, eos, t0 = packed_tile(tl.program_id(0), cu_ptr, S, T_PER_PROG, BLOCK_SEQ)
        srow = tl.load(slot_ptr + seq).to(tl.int64)
        keep = tl.load(cont_ptr + seq) != 0
        L = eos - bos
        t_lo = t0 - bos
        first = (t_lo == 0) & (L > 0)
        x_rows = x_ptr + bos.to(tl.int64) * stride_xt
        y_rows = y_ptr + bos.to(tl.int64) * stride_yt
    else:
        b = tl.program_id(0).to(tl.int64)
        srow = b
        keep = True
        L = T
        t_lo = tl.program_id(1) * T_PER_PROG
        first = tl.program_id(1) == 0
        x_rows = x_ptr + b * stride_xb
        y_rows = y_ptr + b * stride_yb
    t_hi = min(t_lo + T_PER_PROG, L)
    x_cols = x_rows + cols.to(tl.int64)[None, :] * stride_xc
    s_cols = s_in_ptr + srow * stride_sib + cols.to(tl.int64)[None, :] * stride_sic

    rows = tl.arange(0, BLOCK_T)
    # Blocks holding positions < K - 1 read the old state; the loop over the others has no state
    # reads, so its taps' loads are free to overlap (a branch per tap in one loop serialised them).
    t_plain = t_lo
    if HAS_STATE:
        t_plain = t_lo + (tl.maximum(K - 1 - t_lo, 0) + BLOCK_T - 1) // BLOCK_T * BLOCK_T
        for t0 in range(t_lo, min(t_plain, t_hi), BLOCK_T):
            _conv_block(x_cols, s_cols, w_ptr, y_rows, t0, t_hi, rows, cols, cmask, keep, stride_xt, stride_yt,
                        stride_sik, stride_wc, stride_wk, K, True)
    for t0 in range(t_plain, t_hi, BLOCK_T):
        _conv_block(x_cols, s_cols, w_ptr, y_rows, t0, t_hi, rows, cols, cmask, keep, stride_xt, stride_yt,
                    stride_sik, stride_wc, stride_wk, K, False)

    # The new state [K-1, BLOCK_C]: column i is input position L - (K-1) + i (< 0: from the old
    # state). Read after the outputs (fewer live registers in the loop) and before it is stored: in
    # place, s_in and s_out are the same memory, and only this program writes it.
    si = tl.arange(0, BLOCK_S)
    sp = L - (K - 1) + si
    smask = tl.where(first, (si < K - 1)[:, None] & cmask[None, :], False)  # (scalar flags via where: the
    # interpreter refuses a mask that combines a block and a scalar with &)
    new_state = tl.load(x_cols + tl.maximum(sp, 0).to(tl.int64)[:, None] * stride_xt,
                        mask=smask & (sp >= 0)[:, None], other=0.0)
    if HAS_STATE:
        old = tl.load(s_cols + (K - 1 + tl.minimum(sp, 0))[:, None] * stride_sik,
                      mask=tl.where(keep, smask & (sp < 0)[:, None], False), other=0.0)
        new_state = tl.where((sp >= 0)[:, None], new_state, old.to(new_state.dtype))

    # In place, other warps of this program may still be reading the old state: wait for them.
    tl.debug_barrier()
    so = s_out_ptr + srow * stride_sob + cols.to(tl.int64)[None, :] * stride_soc + si[:, None] * stride_sok
    tl.store(so, new_state.to(s_out_ptr.dtype.element_ty), mask=smask)


def _blocks(c: int, rows: int):
    """(BLOCK_T, BLOCK_C, rows of a program's tile) for ``rows`` input rows of ``c`` channels: tiles of
    128 channels x 64 rows are the faster at a few hundred rows, 64 x 128 from 1024 rows on
    (Qwen3.5-0.8B's 6144 channels, K = 4: bench/results/2026-12-03-h200-conv-tiles.md). No register
    spills at 4 warps (sm_90, K = 4)."""
    if INTERPRET:
        return 64, min(256, next_power_of_2(c)), 64
    if rows >= 1024:
        return 16, min(64, next_power_of_2(c)), 128
    return 16, min(128, next_power_of_2(c)), 64


def _launch(x, weight, s_in, y, s_out):
    bsz, t, c = x.shape
    k = weight.shape[1]
    if bsz == 0 or c == 0:
        return
    block_t, block_c, per = _blocks(c, bsz * t)
    n_t = max(1, cdiv(t, per))
    has_state = s_in is not None
    s_in_ = s_in if has_state else x
    grid = (bsz, n_t, cdiv(c, block_c))
    _conv_kernel[grid](
        x, weight, s_in_, y, s_out, x, x, x,
        t, c, per, 0,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
        s_in_.stride(0), s_in_.stride(1), s_in_.stride(2), s_out.stride(0), s_out.stride(1), s_out.stride(2),
        weight.stride(0), weight.stride(1),
        K=k, HAS_STATE=has_state, VARLEN=False, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_S=next_power_of_2(k - 1), BLOCK_SEQ=1, num_warps=4,
    )


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None, state_slots: torch.Tensor | None = None,
                  continues: torch.Tensor | None = None) -> torch.Tensor:
    """y in x.dtype. Without cu_seqlens: x [B, T, C], weight [C, K], conv_states [B, C, K-1] or None
    (row b: sequence b's initial state, replaced by its final one). With cu_seqlens [S + 1]: x [N, C]
    (rows cu_seqlens[i]:cu_seqlens[i + 1]), conv_states [P, C, K-1] (sequence i reads row
    state_slots[i] where continues[i], else zeros, and writes its new state there; length-0
    sequences touch nothing)."""
    if cu_seqlens is None:
        return _fixed_length(x, weight, conv_states)
    return _packed(x, weight, conv_states, cu_seqlens, state_slots, continues)


def _fixed_length(x, weight, conv_states):
    bsz, t, c = x.shape
    k = weight.shape[1]
    y = torch.empty((bsz, t, c), dtype=x.dtype, device=x.device)
    final = torch.empty((bsz, c, k - 1), dtype=x.dtype, device=x.device)
    _launch(x, weight, conv_states, y, final)
    if conv_states is not None:
        conv_states.copy_(final)
    return y


def _packed(x, weight, conv_states, cu_seqlens, state_slots, continues):
    n, c = x.shape
    k = weight.shape[1]
    s = state_slots.shape[0]
    y = torch.empty((n, c), dtype=x.dtype, device=x.device)
    if s == 0 or c == 0:
        return y
    block_t, block_c, per = _blocks(c, n)  # the tile, per >= K - 1: first tiles hold the state reads
    block_t = min(block_t, next_power_of_2(cdiv(n, s)))  # a decode step's one row a sequence: blocks of 1 row
    _conv_kernel[(num_slots(n, s, per), 1, cdiv(c, block_c))](
        x, weight, conv_states, y, conv_states, cu_seqlens, state_slots, continues,
        n, c, per, s,
        0, x.stride(0), x.stride(1), 0, y.stride(0),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        conv_states.stride(0), conv_states.stride(1), conv_states.stride(2),
        weight.stride(0), weight.stride(1),
        K=k, HAS_STATE=True, VARLEN=True, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_S=next_power_of_2(k - 1), BLOCK_SEQ=seq_block(s), num_warps=4,
    )
    return y
