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
tile's loads go out together, before the wait. One sequence's GEMV is elementwise products and a
row sum in fp32; two to eight sequences' (bf16, fp16 or fp32 weights) are one tensor-core product
of all rows, K cut into chunks across the warps (`decode_layers_tasks._products`), rounded as the
fused decode ops round. Attention uses tl.dot over a 16-row block of the group's heads.

FP8 weights (the four linear weights float8_e4m3fn with their stacked block scales
`*_weight_scale_inv` [NL, cdiv(N, 128), cdiv(K, 128)], Qwen's block format: csrc_free_ops/fp8.py):
a tile is read as stored, [rows, K / 128, 128], with its rows' scales, both before the wait; its
GEMV sums each 128-wide group of K in fp32 and scales it by its block's scale, the weight-only
product of `fp8_block_linear` and the fused decode ops (x is never quantised).

Under the interpreter programs run one after another, so a spin-wait on a later program would
never end: P = 1 there, and that program meets every dependency in task order.
"""
import math
import os

import torch
import triton.language as tl

from .common import (_FP8_BLOCK, INTERPRET, LOG2E, cdiv, cuda_properties, device_buffer, fp32, kernel,
                     next_power_of_2, softmax_headroom)
from .decode_layers_tasks import _attention_task, _gate_up_task, _qkv_task, _residual_task, _stamp

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
"""None, or an int64 CUDA tensor of 3 x (the call's tasks: `phase_tasks`; the hybrid kernel's
`decode_hybrid_layers.step_tasks`) elements: then each task t of this kernel or of the hybrid one
stamps %globaltimer (ns) at timeline[3t] when it starts, [3t + 1] when its wait is met and
[3t + 2] when it ends (`python -m bench.decode_layers --timeline`; a kernel compiled with the
stamps, not the op's default)."""


def timeline_stamps(tasks: int, device: torch.device):
    """`timeline` for a call of `tasks` tasks on `device`, or None without one; ValueError unless it
    is int64 on the device with at least 3 x tasks elements."""
    if timeline is not None and (timeline.dtype != torch.int64 or timeline.device != device
                                 or timeline.numel() < 3 * tasks):
        raise ValueError(f"decode_layers.timeline must be an int64 tensor of at least {3 * tasks} elements on "
                         f"{device}, got {timeline.dtype} [{timeline.numel()}] on {timeline.device}")
    return timeline


@kernel
def _decode_layers_kernel(
    x_ptr, out_ptr, pos_ptr, seqlens_ptr, bt_ptr,
    in_norm_ptr, qkv_w_ptr, qkv_b_ptr, qn_ptr, kn_ptr, o_w_ptr, post_norm_ptr, gu_w_ptr, down_w_ptr,
    qkv_s_ptr, o_s_ptr, gu_s_ptr, down_s_ptr,
    kc_ptr, vc_ptr, qkv_ptr, attn_ptr, h_ptr, act_ptr, po_ptr, plse_ptr, cnt_ptr, err_ptr, tl_ptr,
    M, NL, stride_bt, stride_kl, stride_kb, stride_kt, stride_kh, CACHE_LEN, BS,
    eps, offset, log2_theta, qk_scale,
    H: tl.constexpr, I: tl.constexpr, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_QK_NORM: tl.constexpr, FP8: tl.constexpr, BLOCK_M: tl.constexpr,
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
    B: tl.constexpr = _FP8_BLOCK  # a layer's FP8 block scales of each weight: SQ, SO, SG, SD
    SQ: tl.constexpr = ((NQKV + B - 1) // B) * ((H + B - 1) // B)
    SO: tl.constexpr = ((H + B - 1) // B) * ((HO + B - 1) // B)
    SG: tl.constexpr = ((2 * I + B - 1) // B) * ((H + B - 1) // B)
    SD: tl.constexpr = ((H + B - 1) // B) * ((I + B - 1) // B)
    n_attn = M * HK * S
    per_layer = N_QKV + n_attn + N_O + N_GU + N_DN
    arr_base = cnt_ptr + NL * PHASES
    done = -1  # the highest phase this program has seen complete
    for t in range(tl.program_id(0), NL * per_layer, tl.num_programs(0)):
        layer = t // per_layer
        j = t % per_layer
        ph = layer * PHASES
        stamp = tl_ptr + t * 3
        _stamp(stamp, TIMELINE)
        if layer == 0:  # the layer's input: the embeddings, then the output of the layer before
            x_in = x_ptr
        else:
            x_in = out_ptr
        if j < N_QKV:
            done = _qkv_task(x_in, in_norm_ptr + layer * H, qkv_w_ptr + layer.to(tl.int64) * (NQKV * H),
                             qkv_s_ptr + layer * SQ, qkv_b_ptr + layer * NQKV, qkv_ptr, cnt_ptr, err_ptr, j * RQ, M,
                             ph, N_DN, done, eps, offset, NQKV, H, HAS_BIAS, BLOCK_M, RQ, FP8, SPIN_LIMIT, stamp,
                             TIMELINE)
        elif j < N_QKV + n_attn:
            a_id = j - N_QKV  # (m, g, s), s fastest
            done = _attention_task(qkv_ptr, qn_ptr + layer * D, kn_ptr + layer * D, pos_ptr, seqlens_ptr, bt_ptr,
                                   kc_ptr + layer.to(tl.int64) * stride_kl, vc_ptr + layer.to(tl.int64) * stride_kl,
                                   attn_ptr, po_ptr, plse_ptr, arr_base + layer * (M * HK), cnt_ptr, err_ptr,
                                   a_id // (HK * S), (a_id // S) % HK, a_id % S, ph + 1, N_QKV, done,
                                   stride_bt, stride_kb, stride_kt, stride_kh, CACHE_LEN, BS,
                                   eps, offset, log2_theta, qk_scale, HQ, HK, D, ROT, HAS_QK_NORM, False, S, BLOCK_T,
                                   HEADROOM, P_SCALE, SPIN_LIMIT, stamp, TIMELINE)
        elif j < N_QKV + n_attn + N_O:
            done = _residual_task(attn_ptr, o_w_ptr + layer.to(tl.int64) * (H * HO), o_s_ptr + layer * SO, x_in,
                                  h_ptr, cnt_ptr, err_ptr, (j - N_QKV - n_attn) * RO, M, ph + 1, M * HK, done, H, HO,
                                  BLOCK_M, RO, FP8, SPIN_LIMIT, stamp, TIMELINE)
        elif j < N_QKV + n_attn + N_O + N_GU:
            done = _gate_up_task(h_ptr, post_norm_ptr + layer * H, gu_w_ptr + layer.to(tl.int64) * (2 * I * H),
                                 gu_s_ptr + layer * SG, act_ptr, cnt_ptr, err_ptr, (j - N_QKV - n_attn - N_O) * RG, M,
                                 ph + 2, N_O, done, eps, offset, I, H, BLOCK_M, RG, FP8, SPIN_LIMIT, stamp, TIMELINE)
        else:
            done = _residual_task(act_ptr, down_w_ptr + layer.to(tl.int64) * (H * I), down_s_ptr + layer * SD, h_ptr,
                                  out_ptr, cnt_ptr, err_ptr, (j - N_QKV - n_attn - N_O - N_GU) * RD, M, ph + 3, N_GU,
                                  done, H, I, BLOCK_M, RD, FP8, SPIN_LIMIT, stamp, TIMELINE)
        _stamp(stamp + 2, TIMELINE)


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
"""Co-resident programs per SM the launcher aims for (fewer where occupancy allows fewer). Two (the
most the kernel's 248 registers a thread allow) decode faster than one (docs/performance.md)."""

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
                  theta: float, rotary_dim: int, num_heads: int, num_splits: int, qkv_weight_scale_inv=None,
                  o_weight_scale_inv=None, gate_up_weight_scale_inv=None, down_weight_scale_inv=None):
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
    stamps = timeline_stamps(nl * sum(phase_tasks(m, nqkv, h, num_heads * d, inter, hk, num_splits, size)), dev)
    scales = (qkv_weight_scale_inv, o_weight_scale_inv, gate_up_weight_scale_inv, down_weight_scale_inv)
    args = (x, out, positions, cache_seqlens, block_table, input_norm, qkv_weight,
            qkv_bias if qkv_bias is not None else qkv_weight, q_norm if q_norm is not None else input_norm,
            k_norm if k_norm is not None else input_norm, o_weight, post_norm, gate_up_weight, down_weight,
            *(s if s is not None else input_norm for s in scales),
            k_cache, v_cache, qkv, attn, hmid, act, parts, lse, counters, error_flag(dev),
            stamps if stamps is not None else counters,
            m, nl, block_table.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
            block_table.shape[1] * bs, bs, eps, offset, math.log2(theta), d ** -0.5 * LOG2E)
    meta = dict(H=h, I=inter, HQ=num_heads, HK=hk, D=d, ROT=rotary_dim, HAS_BIAS=qkv_bias is not None,
                HAS_QK_NORM=q_norm is not None, FP8=qkv_weight_scale_inv is not None, BLOCK_M=next_power_of_2(m),
                RQ=rq, RO=ro, RG=rg, RD=rd, S=num_splits,
                BLOCK_T=BLOCK_T, HEADROOM=headroom, P_SCALE=2.0 ** -headroom, SPIN_LIMIT=SPIN_LIMIT,
                TIMELINE=stamps is not None,
                num_warps=NUM_WARPS, num_stages=1)
    launch(_decode_layers_kernel, args, meta, dev)
    return out


def launch(persistent_kernel, args: tuple, meta: dict, device: torch.device) -> None:
    """Launch a persistent kernel: one program under the interpreter (which runs programs one after
    another), else a cooperative grid of as many programs as fit on ``device`` (``programs``: the
    kernel compiled once per device, tensor dtypes and constexprs, each a variant of its own
    registers, not launched, to read them)."""
    if INTERPRET:
        persistent_kernel[(1,)](*args, **meta)
        return
    dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
    key = (persistent_kernel, device.index, dtypes, tuple(meta.items()))
    grid = _grids.get(key)
    if grid is None:
        compiled = persistent_kernel.fn.warmup(*args, grid=(1,), launch_cooperative_grid=True, **meta)
        grid = _grids[key] = (programs(compiled, device),)
    persistent_kernel[grid](*args, launch_cooperative_grid=True, **meta)


_grids: dict = {}  # (kernel, device, dtypes, constexprs) -> the launch grid


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
    the sequence's current length. More splits are faster at one sequence while each keeps a block
    of 32 positions; at eight sequences fewer are, once the attention tasks would outnumber the
    co-resident programs (`python -m bench.decode_layers`, docs/performance.md)."""
    return max(1, min(cdiv(cache_len, 32), 32 // max(1, rows)))
