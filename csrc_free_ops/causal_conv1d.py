"""Depthwise causal conv1d + SiLU over channels-last activations (Qwen3.5 Gated DeltaNet).

    y[b, t, c] = silu(sum_j weight[c, j] * xs[b, c, t + j]),  j < K
    xs[b, c] = [state[b, c, 0:K-1], x[b, 0:T, c]]   (the K-1 inputs before t = 0, then x)

x [B, T, C] (last dim contiguous, other strides free), weight [C, K], state [B, C, K-1]
(zeros when absent). The new state is the last K-1 columns of xs, in x's dtype.
fp32 math, y in x's dtype.

One kernel serves prefill and decode. Program (b, t-range, c-block) computes the outputs of
its T range for BLOCK_C channels: for each of the K taps it loads the [BLOCK_T, BLOCK_C]
input tile shifted by the tap (rows before t = 0 come from the state), so each input is
read K times, from L1/L2. The program of the first t-range also writes the new state.
Prefill (`causal_conv1d`) splits T over programs; decode (`causal_conv1d_update`) gives
each channel block one program that walks all T steps, reading the old state before it
writes the new one in place (no other program touches those channels).
"""
import torch
import triton.language as tl

from .common import INTERPRET, cdiv, kernel, next_power_of_2


@kernel
def _conv_kernel(
    x_ptr, w_ptr, s_in_ptr, y_ptr, s_out_ptr,
    T, C, T_PER_PROG,
    stride_xb, stride_xt, stride_xc, stride_yb, stride_yt,
    stride_sib, stride_sic, stride_sik, stride_sob, stride_soc, stride_sok, stride_wc, stride_wk,
    K: tl.constexpr, HAS_STATE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < C
    x_cols = x_ptr + b * stride_xb + cols.to(tl.int64)[None, :] * stride_xc
    s_cols = s_in_ptr + b * stride_sib + cols.to(tl.int64)[None, :] * stride_sic
    t_lo = pid_t * T_PER_PROG
    t_hi = min(t_lo + T_PER_PROG, T)

    # The new state [K-1, BLOCK_C]: column i is input position T - (K-1) + i (< 0: from the old
    # state). Read before anything is stored: in place, s_in and s_out are the same memory.
    si = tl.arange(0, BLOCK_S)
    sp = T - (K - 1) + si
    smask = (si < K - 1)[:, None] & cmask[None, :]
    new_state = tl.load(x_cols + tl.maximum(sp, 0).to(tl.int64)[:, None] * stride_xt,
                        mask=smask & (sp >= 0)[:, None], other=0.0)
    if HAS_STATE:
        old = tl.load(s_cols + (K - 1 + tl.minimum(sp, 0))[:, None] * stride_sik,
                      mask=smask & (sp < 0)[:, None], other=0.0)
        new_state = tl.where((sp >= 0)[:, None], new_state, old.to(new_state.dtype))

    rows = tl.arange(0, BLOCK_T)
    for t0 in range(t_lo, t_hi, BLOCK_T):
        t = t0 + rows
        m = (t < t_hi)[:, None] & cmask[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
        for j in tl.static_range(K):
            src = t + (j - (K - 1))  # input position read by tap j
            w = tl.load(w_ptr + cols.to(tl.int64) * stride_wc + j * stride_wk, mask=cmask, other=0.0).to(tl.float32)
            xv = tl.load(x_cols + tl.maximum(src, 0).to(tl.int64)[:, None] * stride_xt,
                         mask=m & (src >= 0)[:, None], other=0.0).to(tl.float32)
            if HAS_STATE:
                if j < K - 1:
                    xv += tl.load(s_cols + (K - 1 + tl.minimum(src, 0))[:, None] * stride_sik,
                                  mask=m & (src < 0)[:, None], other=0.0).to(tl.float32)
            acc += xv * w[None, :]
        y = acc * tl.sigmoid(acc)
        tl.store(y_ptr + b * stride_yb + t.to(tl.int64)[:, None] * stride_yt + cols[None, :],
                 y.to(y_ptr.dtype.element_ty), mask=m)

    # In place, other warps of this program may still be reading the old state: wait for them.
    tl.debug_barrier()
    if pid_t == 0:
        so = s_out_ptr + b * stride_sob + cols.to(tl.int64)[None, :] * stride_soc + si[:, None] * stride_sok
        tl.store(so, new_state.to(s_out_ptr.dtype.element_ty), mask=smask)


def _blocks(c: int):
    if INTERPRET:
        return 64, min(256, next_power_of_2(c))
    return 16, min(128, next_power_of_2(c))  # no register spills at 4 warps (sm_90, K = 4)


def _launch(x, weight, s_in, y, s_out, split_t: bool):
    bsz, t, c = x.shape
    k = weight.shape[1]
    if bsz == 0 or c == 0:
        return
    block_t, block_c = _blocks(c)
    if split_t:
        per = block_t * (4 if not INTERPRET else 1)
        n_t = max(1, cdiv(t, per))
    else:
        block_t = min(block_t, next_power_of_2(t))
        per, n_t = max(t, 1), 1
    has_state = s_in is not None
    s_in_ = s_in if has_state else x
    grid = (bsz, n_t, cdiv(c, block_c))
    _conv_kernel[grid](
        x, weight, s_in_, y, s_out,
        t, c, per,
        x.stride(0), x.stride(1), x.stride(2), y.stride(0), y.stride(1),
        s_in_.stride(0), s_in_.stride(1), s_in_.stride(2), s_out.stride(0), s_out.stride(1), s_out.stride(2),
        weight.stride(0), weight.stride(1),
        K=k, HAS_STATE=has_state, BLOCK_T=block_t, BLOCK_C=block_c,
        BLOCK_S=next_power_of_2(k - 1), num_warps=4,
    )


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, initial_state: torch.Tensor | None = None):
    """x [B, T, C], weight [C, K], initial_state [B, C, K-1] or None ->
    (y [B, T, C] in x.dtype, final_state [B, C, K-1] in x.dtype), both contiguous."""
    bsz, t, c = x.shape
    k = weight.shape[1]
    y = torch.empty((bsz, t, c), dtype=x.dtype, device=x.device)
    final = torch.empty((bsz, c, k - 1), dtype=x.dtype, device=x.device)
    _launch(x, weight, initial_state, y, final, split_t=True)
    return y, final


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [B, T, C] (T small), conv_state [B, C, K-1] updated in place, weight [C, K] -> y [B, T, C]."""
    bsz, t, c = x.shape
    y = torch.empty((bsz, t, c), dtype=x.dtype, device=x.device)
    _launch(x, weight, conv_state, y, conv_state, split_t=False)
    return y
