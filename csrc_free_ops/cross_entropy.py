"""Fused lm_head + cross-entropy: mean_i CE(hidden_i @ weight^T, target_i) without the [N, V] logits.

hidden [N, H], weight [V, H], targets [N] (int64/int32; rows whose target is `ignore_index`
count for nothing), n_valid = count(targets != ignore_index), kept on the device. A target that is
neither ignore_index nor in [0, V) makes its row's loss NaN, so the loss and both gradients are NaN
(checking the values on the host would cost a sync; qwen_ops raises for CPU tensors first).

Forward, in row chunks of R tokens (R from PARTIALS_BYTES), two kernels:

    _logits_lse_kernel   GEMM tile l = h[rows] @ W[cols]^T (fp32, never stored); its epilogue
                         writes the tile's row max and sum exp(l - max) to [R, V/BLOCK_N] fp32
                         partials, and l[target] from the one tile that holds the target column.
    _lse_loss_kernel     per row: lse = log-sum-exp over the partials, loss_i = lse - l[target]
                         (0 for ignored rows).

    loss = sum(loss_i) / n_valid (a device division: NaN when every target is ignored, as
    torch's mean cross-entropy; no host sync). lse [N] fp32 is the forward's other output.

Backward, given g_loss (the loss's incoming gradient), lse and maybe lse's gradient g_lse, in vocabulary slices of Vs
columns (Vs from SLICE_BYTES), recomputing the logits instead of storing them:

    _logits_grad_kernel  GEMM tile l as above; epilogue G = (exp(l - lse) - onehot(target))
                         * g_loss / n_valid (0 for ignored rows), plus exp(l - lse) * g_lse
                         when lse gets a gradient too  -> G [N, Vs] in h's dtype
    dW[slice] = G^T @ h  written once: the fp32 sum over all N tokens stays inside one GEMM
    dh       += G @ W[slice]   (fp32 accumulator [N, H], slices added in order)

Four GEMMs over N x V x H in all (one forward, three backward) and no [N, V] buffer: the
peak memory is dW plus the G slice and dh's accumulator. Deterministic: no atomics.
"""
import torch
import triton
import triton.language as tl

from .common import INTERPRET, cdiv, gemm_blocks, grouped_tile, kernel, mm, next_power_of_2, tile_product

PARTIALS_BYTES = 32 << 20
"""Byte budget of the forward's per-tile row statistics (8 bytes per row per BLOCK_N columns)."""

SLICE_BYTES = 64 << 20
"""Byte budget of the backward's gradient slice G [N, Vs] (h's dtype)."""


@triton.jit
def _counts(t, ignore_index, V):
    """Whether a target takes part in the loss: not ignore_index and a real vocabulary row."""
    return (t != ignore_index) & (t >= 0) & (t < V)


@triton.jit
def _per_target(x, t, ignore_index, V):
    """x where target t takes part in the loss, 0 where it is ignore_index, NaN where it is neither
    (outside the vocabulary: the loss and the gradients it reaches turn NaN)."""
    return tl.where(_counts(t, ignore_index, V), x, tl.where(t == ignore_index, 0.0, float("nan")))


@kernel
def _logits_lse_kernel(
    h_ptr, w_ptr, targets_ptr, pmax_ptr, psum_ptr, target_logit_ptr,
    R, V, H, stride_h, stride_w, TILES_V,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), R, V, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    logits = tile_product(h_ptr, w_ptr, rm, rn, R, V, 0, H, stride_h, 1, 1, stride_w, BLOCK_M, BLOCK_N, BLOCK_K)
    logits = tl.where(rn[None, :] < V, logits, float("-inf"))
    row_max = tl.max(logits, axis=1)
    row_sum = tl.sum(tl.exp(logits - row_max[:, None]), axis=1)
    row_ok = rm < R
    stat = rm.to(tl.int64) * TILES_V + pid_n
    tl.store(pmax_ptr + stat, row_max, mask=row_ok)
    tl.store(psum_ptr + stat, row_sum, mask=row_ok)
    t = tl.load(targets_ptr + rm, mask=row_ok, other=-1).to(tl.int64)
    here = row_ok & (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N) & (t < V)
    picked = tl.sum(tl.where(rn[None, :] == t[:, None], logits, 0.0), axis=1)
    tl.store(target_logit_ptr + rm, picked, mask=here)


@kernel
def _lse_loss_kernel(
    pmax_ptr, psum_ptr, target_logit_ptr, targets_ptr, lse_ptr, loss_ptr,
    R, R0, V, TILES_V, ignore_index, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """lse and loss of the chunk's rows R0 + r (the partials hold the chunk's R rows)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    tiles = tl.arange(0, BLOCK_T)
    base = rows.to(tl.int64)[:, None] * TILES_V
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for t0 in range(0, TILES_V, BLOCK_T):
        mask = row_ok[:, None] & (t0 + tiles[None, :] < TILES_V)
        pm = tl.load(pmax_ptr + base + t0 + tiles[None, :], mask=mask, other=float("-inf"))
        ps = tl.load(psum_ptr + base + t0 + tiles[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(pm, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the end see only -inf
        # The select rounds each product before the sum: fused into the sum's first cross-lane add
        # as an FMA, the lanes holding a row would get different bits of l, and lse (stored through
        # shared memory from every such lane) would differ in its last bit from run to run.
        l = l * tl.exp(m - m_safe) + tl.sum(tl.where(mask, ps * tl.exp(pm - m_safe[:, None]), 0.0), axis=1)
        m = m_new
    lse = tl.where(row_ok, m + tl.log(tl.where(row_ok, l, 1.0)), 0.0)
    t = tl.load(targets_ptr + R0 + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    valid = _counts(t, ignore_index, V)
    picked = tl.load(target_logit_ptr + rows, mask=row_ok & valid, other=0.0)
    tl.store(lse_ptr + R0 + rows, lse, mask=row_ok)
    tl.store(loss_ptr + R0 + rows, _per_target(lse - picked, t, ignore_index, V), mask=row_ok)


@kernel
def _logits_grad_kernel(
    h_ptr, w_ptr, targets_ptr, lse_ptr, dlse_ptr, scale_ptr, g_ptr,
    N, VS, V0, V, H, stride_h, stride_w, stride_g, ignore_index,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = grouped_tile(tl.program_id(0), N, VS, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    logits = tile_product(h_ptr, w_ptr, rm, rn, N, VS, 0, H, stride_h, 1, 1, stride_w, BLOCK_M, BLOCK_N, BLOCK_K)
    row_ok = rm < N
    t = tl.load(targets_ptr + rm, mask=row_ok, other=ignore_index).to(tl.int64)
    lse = tl.load(lse_ptr + rm, mask=row_ok, other=0.0)
    scale = _per_target(tl.load(scale_ptr), t, ignore_index, V)  # rows past N read ignore_index: 0
    coef = scale
    if HAS_DLSE:
        coef += tl.load(dlse_ptr + rm, mask=row_ok, other=0.0)
    g = tl.exp(logits - lse[:, None]) * coef[:, None] - tl.where(V0 + rn[None, :] == t[:, None], scale[:, None], 0.0)
    mask = row_ok[:, None] & (rn[None, :] < VS)
    tl.store(g_ptr + rm.to(tl.int64)[:, None] * stride_g + rn[None, :], g.to(g_ptr.dtype.element_ty), mask=mask)


def _gemm_launch(rows: int, cols: int, h: int, itemsize: int):
    bm, bn, bk, warps, stages = gemm_blocks(rows, cols, h, itemsize)
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)


def linear_cross_entropy(hidden, weight, targets, ignore_index: int):
    """-> (loss fp32 [], lse fp32 [N]). hidden/weight with unit last-dim stride, targets contiguous."""
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    targets = targets.contiguous()  # the kernels read row r at offset r
    count = (targets != ignore_index).sum()
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    losses = torch.empty(n, dtype=torch.float32, device=dev)
    cfg = _gemm_launch(n, v, h, hidden.element_size())
    tiles_v = cdiv(v, cfg["BLOCK_N"])
    r = max(cfg["BLOCK_M"], PARTIALS_BYTES // (8 * tiles_v) // cfg["BLOCK_M"] * cfg["BLOCK_M"])
    r = min(r, max(n, 1))
    pmax = torch.empty((r, tiles_v), dtype=torch.float32, device=dev)
    psum = torch.empty_like(pmax)
    target_logit = torch.empty(r, dtype=torch.float32, device=dev)
    block_t = min(next_power_of_2(tiles_v), 64 if INTERPRET else 256)
    block_r = 16
    for r0 in range(0, n, r):
        rows = min(r, n - r0)
        h_c, t_c = hidden[r0:r0 + rows], targets[r0:r0 + rows]
        _logits_lse_kernel[(cdiv(rows, cfg["BLOCK_M"]) * tiles_v,)](
            h_c, weight, t_c, pmax, psum, target_logit, rows, v, h, h_c.stride(0), weight.stride(0), tiles_v, **cfg,
        )
        _lse_loss_kernel[(cdiv(rows, block_r),)](  # writes lse and losses at row r0 (no view: see common.mm)
            pmax, psum, target_logit, targets, lse, losses, rows, r0, v, tiles_v, ignore_index,
            BLOCK_R=block_r, BLOCK_T=block_t, num_warps=4,
        )
    return losses.sum() / count.to(torch.float32), lse


def linear_cross_entropy_backward(grad_loss, grad_lse, hidden, weight, targets, lse, ignore_index: int,
                                  need_dh: bool, need_dw: bool):
    """-> (dhidden [N, H] or None, dweight [V, H] or None) of grad_loss * loss + sum_i grad_lse_i * lse_i
    (grad_lse [N] or None)."""
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    targets, lse = targets.contiguous(), lse.contiguous()  # read at unit stride
    dlse = lse if grad_lse is None else grad_lse.to(torch.float32).contiguous()
    scale = grad_loss.to(torch.float32) / (targets != ignore_index).sum().clamp_min(1).to(torch.float32)
    dh_acc = torch.empty((n, h), dtype=torch.float32, device=dev) if need_dh else None
    dw = torch.empty((v, h), dtype=weight.dtype, device=dev) if need_dw else None
    fit = max(16, SLICE_BYTES // max(1, n * hidden.element_size()))
    vs = min(1 << (fit.bit_length() - 1), v)  # a power of two: whole GEMM tiles per slice
    g = torch.empty((n, vs), dtype=hidden.dtype, device=dev)
    for v0 in range(0, v, vs):
        cols = min(vs, v - v0)
        cfg = _gemm_launch(n, cols, h, hidden.element_size())
        w_s = weight[v0:v0 + cols]  # the slice's rows (a 64-bit offset from the host); read only
        _logits_grad_kernel[(cdiv(n, cfg["BLOCK_M"]) * cdiv(cols, cfg["BLOCK_N"]),)](  # g[:, :cols]
            hidden, w_s, targets, lse, dlse, scale, g, n, cols, v0, v, h, hidden.stride(0), weight.stride(0),
            g.stride(0), ignore_index, HAS_DLSE=grad_lse is not None, **cfg,
        )
        g_s = g[:, :cols]
        if need_dw:
            mm(g_s.t(), hidden, dw, out_row0=v0)  # dw[v0:v0 + cols], written without a view (see common.mm)
        if need_dh:
            mm(g_s, w_s, dh_acc, accumulate=v0 > 0)
    dh = None
    if need_dh:
        dh = dh_acc if hidden.dtype == torch.float32 else dh_acc.to(hidden.dtype)
    return dh, dw
