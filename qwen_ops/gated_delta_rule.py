"""qwen::chunk_gated_delta_rule, qwen::recurrent_gated_delta_rule_varlen, qwen::gated_rms_norm:
the core of Qwen3.5's Gated DeltaNet layers (transformers' Qwen3_5GatedDeltaNet).

Shapes: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv] with Hv a multiple of Hk (value head h reads
key head h // (Hv / Hk), as transformers' repeat_interleave), g, beta [B, T, Hv], the state
[B, Hv, Dk, Dv] in fp32 (float64 for float64 inputs). Dk, Dv: multiples of 16 up to 256 (checks.HEAD_DIMS).
Qwen3.5-0.8B: Hk = Hv = 16, Dk = Dv = 128 (the Qwen3_5TextConfig defaults have Hv = 32).

Per value head, token by token (fp32 math; the l2 norm is optional, eps 1e-6 inside the sqrt):

    q_t <- scale * l2norm(q_t),  k_t <- l2norm(k_t)
    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - S^T k_t))^T
    o_t = S^T q_t

chunk_gated_delta_rule(q, k, v, g, beta, scale, state=None, cu_seqlens=None, state_slots=None, continues=None,
                       use_qk_l2norm=False) -> o, state updated in place: prefill, computed in chunks
    of 64 tokens (WY / UT representation, see csrc_free_ops/gated_delta_rule.py); g is the log
    decay (<= 0, fp32 recommended).
    - fixed length (cu_seqlens None) -> o [B, T, Hv, Dv] in q's dtype. state [B, Hv, Dk, Dv] fp32
      or None: row b is sequence b's initial state, replaced by its final state;
      without it the state starts at zeros and is not kept.
    - packed: q, k [N, Hk, Dk], v [N, Hv, Dv], g, beta [N, Hv] of S sequences, sequence i the rows
      cu_seqlens[i]:cu_seqlens[i + 1] (int32 [S + 1]: 0, nondecreasing, N) -> o [N, Hv, Dv].
      Sequence i starts from state[state_slots[i]] (a pool [P, Hv, Dk, Dv] fp32, contiguous;
      slots int64 [S]) where continues[i] (bool [S]), else from zeros, and leaves its final state
      there; length-0 sequences touch nothing. Chunks of 64 never cross a sequence boundary;
      grids from shapes only (CUDA graphs). Flat [N, ...] rows, not flash-linear-attention's
      [1, N, ...]: the engine's step tensors and paged_attention's q are flat, and a leading 1
      would only say "no batch". One call serves a mixed engine step (a decode token is a
      sequence of length 1 that continues).
recurrent_gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, state_slots, continues,
                                  scale, use_qk_l2norm=True) -> o [N, Hv, Dv]: the decode step over S
    packed sequences (usually one token each; q, k [N, Hk, Dk], v [N, Hv, Dv], a, b [N, Hv]), each
    reading its state from state_pool[state_slots[i]] where continues[i] (else zeros) and writing
    it back in place, inside the kernel (no gather / scatter of the pool rows); length-0 sequences
    touch nothing. The packed arguments as chunk_gated_delta_rule's (the pool is its state). Only the
    packed form exists: it is the decode step's, where every sequence continues its pool slot. The gates are computed
    inside the kernel from the raw projections exactly as transformers does:
        g = -exp(A_log) * softplus(a + dt_bias)   (fp32),   beta = sigmoid(b)  (in b's dtype)
    a, b [N, Hv]; A_log, dt_bias [Hv]. Graph-capture safe (no sync, fixed allocations).
gated_rms_norm(x, z, weight, eps) -> rms_norm(x) * weight * silu(z), x, z [..., D], weight [D]:
    transformers' Qwen3_5RMSNormGated (a plain weight, no +1 offset). Like it, the normalised x
    is rounded to x's dtype before the weight, the weight product is rounded too when the weight
    has x's dtype, and the gate product is fp32; output in x's dtype.

The references compute in fp32 (float64 for float64 inputs); `chunked_delta_rule` is the chunked
form of fixed-length sequences (as transformers' torch_chunk_gated_delta_rule, returning the final
state), `gated_delta_recurrence` the token-by-token one (as torch_recurrent_gated_delta_rule).
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import gated_delta_rule as kernels
from csrc_free_ops import gated_delta_rule_step as step_kernels
from csrc_free_ops.common import empty_contiguous_like

from .causal_conv1d import check_packed, check_packed_values, check_unpacked, packed_sequences
from .checks import check_float, check_head_dim, check_like, check_same, fail
from .registry import acc_dtype, define

CHUNK = kernels.CHUNK


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """transformers' (and FLA's) l2norm over the last dim: x * rsqrt(sum(x^2) + eps)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_delta_gates_reference(a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """(g, beta) from the raw projections, as Qwen3_5GatedDeltaNet: g = -exp(A_log) softplus(a + dt_bias)
    in fp32 (float64 for float64 a), beta = sigmoid(b) in b's dtype; both contiguous."""
    dt = acc_dtype(a)
    g = -A_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt))
    return g.contiguous(), b.sigmoid().contiguous()


def _heads_first(q, k, v, g, beta, scale, use_qk_l2norm, dt):
    """Inputs in dtype dt as [B, Hv, T, D] / [B, Hv, T], keys repeated to Hv heads, normalised, q scaled."""
    rep = v.shape[2] // k.shape[2]
    q, k = (x.to(dt).repeat_interleave(rep, dim=2) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    return [x.transpose(1, 2).to(dt) for x in (q, k, v, g, beta)]


def gated_delta_recurrence(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                           initial_state: Optional[Tensor] = None, use_qk_l2norm: bool = False,
                           dtype: Optional[torch.dtype] = None) -> tuple[Tensor, Tensor]:
    """Token-by-token gated delta rule in `dtype` (default: fp32, float64 for float64 q) ->
    (o [B, T, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv] in `dtype`)."""
    dt = dtype or acc_dtype(q)
    out_dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, use_qk_l2norm, dt)
    bsz, hv, t, dk = k.shape
    s = torch.zeros(bsz, hv, dk, v.shape[-1], dtype=dt, device=q.device) if initial_state is None \
        else initial_state.to(dt).clone()
    out = torch.empty_like(v)
    for i in range(t):
        s = s * g[:, :, i].exp()[..., None, None]
        kt = k[:, :, i]
        delta = (v[:, :, i] - (s * kt[..., None]).sum(-2)) * beta[:, :, i, None]
        s = s + kt[..., None] * delta[..., None, :]
        out[:, :, i] = (s * q[:, :, i, :, None]).sum(-2)
    return out.transpose(1, 2).to(out_dtype).contiguous(), s


def chunked_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                       initial_state: Optional[Tensor] = None, use_qk_l2norm: bool = False) -> tuple[Tensor, Tensor]:
    """(o [B, T, Hv, Dv] in q's dtype, final state [B, Hv, Dk, Dv] fp32) of fixed-length sequences."""
    dt = acc_dtype(q)
    out_dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, scale, use_qk_l2norm, dt)
    bsz, hv, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // CHUNK
    q, k, v = (x.reshape(bsz, hv, n, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(bsz, hv, n, CHUNK) for x in (g, beta))
    gc = g.cumsum(-1)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    a = (k * beta[..., None]) @ k.transpose(-1, -2) * decay  # its diagonal is ignored (unit triangular)
    w = torch.linalg.solve_triangular(a, k * (beta * gc.exp())[..., None], upper=False, unitriangular=True)
    u = torch.linalg.solve_triangular(a, v * beta[..., None], upper=False, unitriangular=True)
    attn = q @ k.transpose(-1, -2) * decay
    s = torch.zeros(bsz, hv, dk, dv, dtype=dt, device=q.device) if initial_state is None else initial_state.to(dt)
    out = torch.empty_like(v)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ s
        out[:, :, c] = (q[:, :, c] * gc[:, :, c, :, None].exp()) @ s + attn[:, :, c] @ v_new
        g_last = gc[:, :, c, -1, None, None]
        s = s * g_last.exp() + (k[:, :, c] * (g_last - gc[:, :, c, :, None]).exp()).transpose(-1, -2) @ v_new
    out = out.reshape(bsz, hv, n * CHUNK, dv)[:, :, :t]
    return out.transpose(1, 2).to(out_dtype).contiguous(), s.contiguous()


def chunk_gated_delta_rule_reference(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                                     state: Optional[Tensor] = None, cu_seqlens: Optional[Tensor] = None,
                                     state_slots: Optional[Tensor] = None, continues: Optional[Tensor] = None,
                                     use_qk_l2norm: bool = False) -> Tensor:
    if cu_seqlens is None:
        out, final = chunked_delta_rule(q, k, v, g, beta, scale, state, use_qk_l2norm)
        if state is not None:
            state.copy_(final)
        return out
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for rows, slot, cont in packed_sequences(cu_seqlens, state_slots, continues):
        o, s = chunked_delta_rule(q[None, rows], k[None, rows], v[None, rows], g[None, rows], beta[None, rows], scale,
                                  state[slot:slot + 1] if cont else None, use_qk_l2norm)
        out[rows] = o[0]
        state[slot] = s[0]
    return out


def recurrent_gated_delta_rule_varlen_reference(q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, A_log: Tensor,
                                                dt_bias: Tensor, state_pool: Tensor, cu_seqlens: Tensor,
                                                state_slots: Tensor, continues: Tensor, scale: float,
                                                use_qk_l2norm: bool = True) -> Tensor:
    out = torch.empty(v.shape, dtype=q.dtype, device=q.device)
    for rows, slot, cont in packed_sequences(cu_seqlens, state_slots, continues):
        state = state_pool[slot:slot + 1] if cont else state_pool.new_zeros((1, *state_pool.shape[1:]))
        g, beta = gated_delta_gates_reference(a[None, rows], b[None, rows], A_log, dt_bias)
        o, s = gated_delta_recurrence(q[None, rows], k[None, rows], v[None, rows], g, beta, scale, state, use_qk_l2norm)
        out[rows] = o[0]
        state_pool[slot] = s[0]
    return out


def gated_rms_norm_reference(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    dt = acc_dtype(x)
    xf = x.to(dt)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = weight * normed  # type promotion as transformers: rounded to x's dtype when weight has it
    return (y.to(dt) * F.silu(z.to(dt))).to(x.dtype).contiguous()


# ---------------------------------------------------------------------------------------------- checks


def _check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t, ndim=4)
    check_same(op, "q", q, k=k, v=v)
    if q.shape != k.shape:
        fail(op, f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape [B, T, Hk, Dk]")
    bsz, t, hk, dk = k.shape
    if tuple(v.shape[:2]) != (bsz, t):
        fail(op, f"v {tuple(v.shape)} must be [B, T, Hv, Dv] with k's B, T = {(bsz, t)}")
    hv, dv = v.shape[2], v.shape[3]
    if hk == 0 or hv % hk:
        fail(op, f"v's head count {hv} must be a multiple of k's {hk}")
    for name, d in (("k", dk), ("v", dv)):
        check_head_dim(op, d, f"{name} head dim")
    return bsz, t, hv, dk, dv


def _check_per_head(op: str, q: Tensor, shape: tuple, **tensors):
    for name, t in tensors.items():
        check_float(op, name, t, ndim=len(shape))
        if t.device != q.device:
            fail(op, f"{name} is on {t.device} but q is on {q.device}")
        if tuple(t.shape) != shape:
            fail(op, f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _check_state(op: str, name: str, q: Tensor, state: Tensor, shape: tuple):
    check_float(op, name, state, ndim=4)
    if state.device != q.device:
        fail(op, f"{name} is on {state.device} but q is on {q.device}")
    if state.dtype != acc_dtype(q):
        fail(op, f"{name} must be {acc_dtype(q)} (the state is kept in {acc_dtype(q)}), got {state.dtype}")
    if tuple(state.shape) != shape:
        fail(op, f"{name} must have shape [B, Hv, Dk, Dv] = {shape}, got {tuple(state.shape)}")


def _check_qkv_packed(op: str, q: Tensor, k: Tensor, v: Tensor):
    """q, k [N, Hk, Dk], v [N, Hv, Dv]: the fixed-length checks on their [1, N, ...] views."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_float(op, name, t, ndim=3)
    return _check_qkv(op, q[None], k[None], v[None])[1:]


def _check_pool(op: str, q: Tensor, state_pool: Tensor, shape: tuple, name: str = "state_pool"):
    check_float(op, name, state_pool, ndim=4)
    if state_pool.device != q.device:
        fail(op, f"{name} is on {state_pool.device} but q is on {q.device}")
    if state_pool.dtype != acc_dtype(q):
        fail(op, f"{name} must be {acc_dtype(q)} (the state is kept in {acc_dtype(q)}), got {state_pool.dtype}")
    if tuple(state_pool.shape[1:]) != shape:
        fail(op, f"{name} must have shape [P, Hv, Dk, Dv] = [P, {', '.join(map(str, shape))}], "
                 f"got {tuple(state_pool.shape)}")
    if not state_pool.is_contiguous():
        fail(op, f"{name} must be contiguous")


def _check_chunk(q, k, v, g, beta, scale, state=None, cu_seqlens=None, state_slots=None, continues=None,
                 use_qk_l2norm=False):
    op = "chunk_gated_delta_rule"
    if cu_seqlens is None:
        check_unpacked(op, state_slots, continues)
        bsz, t, hv, dk, dv = _check_qkv(op, q, k, v)
        _check_per_head(op, q, (bsz, t, hv), g=g, beta=beta)
        if state is not None:
            _check_state(op, "state", q, state, (bsz, hv, dk, dv))
        return
    n, hv, dk, dv = _check_qkv_packed(op, q, k, v)
    _check_per_head(op, q, (n, hv), g=g, beta=beta)
    if state is None:
        fail(op, "packed sequences (cu_seqlens) need state [P, Hv, Dk, Dv], the pool their states live in")
    _check_pool(op, q, state, (hv, dk, dv), "state")
    check_packed(op, n, state.shape[0], cu_seqlens, state_slots, continues, q.device)


def _check_chunk_values(q, k, v, g, beta, scale, state=None, cu_seqlens=None, state_slots=None, continues=None,
                        use_qk_l2norm=False):
    if cu_seqlens is not None:
        check_packed_values("chunk_gated_delta_rule", q.shape[0], state.shape[0], cu_seqlens, state_slots)


def _check_recurrent_varlen(q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, state_slots, continues, scale,
                            use_qk_l2norm=True):
    op = "recurrent_gated_delta_rule_varlen"
    n, hv, dk, dv = _check_qkv_packed(op, q, k, v)
    _check_per_head(op, q, (n, hv), a=a, b=b)
    _check_per_head(op, q, (hv,), A_log=A_log, dt_bias=dt_bias)
    _check_pool(op, q, state_pool, (hv, dk, dv))
    check_packed(op, n, state_pool.shape[0], cu_seqlens, state_slots, continues, q.device)


def _check_recurrent_varlen_values(q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, state_slots, continues,
                                   scale, use_qk_l2norm=True):
    check_packed_values("recurrent_gated_delta_rule_varlen", q.shape[0], state_pool.shape[0], cu_seqlens,
                        state_slots)


def _check_norm(x, z, weight, eps):
    op = "gated_rms_norm"
    check_float(op, "x", x)
    check_like(op, "x", x, z=z)
    check_float(op, "weight", weight, ndim=1)
    if weight.device != x.device:
        fail(op, f"weight is on {weight.device} but x is on {x.device}")
    if weight.shape[0] != x.shape[-1]:
        fail(op, f"weight has {weight.shape[0]} elements but x's last dim is {x.shape[-1]}")


# ----------------------------------------------------------------------------------------------- fakes


def _fake_chunk(q, k, v, g, beta, scale, state=None, cu_seqlens=None, state_slots=None, continues=None,
                use_qk_l2norm=False):
    return torch.empty(v.shape, dtype=q.dtype, device=q.device)


def _fake_recurrent_varlen(q, k, v, a, b, A_log, dt_bias, state_pool, cu_seqlens, state_slots, continues, scale,
                           use_qk_l2norm=True):
    return torch.empty(v.shape, dtype=q.dtype, device=q.device)


def _fake_norm(x, z, weight, eps):
    return empty_contiguous_like(x)


chunk_gated_delta_rule = define(chunk_gated_delta_rule_reference, kernels.chunk_gated_delta_rule, _check_chunk,
                                _fake_chunk, mutates_args=("state",), check_values=_check_chunk_values)
recurrent_gated_delta_rule_varlen = define(recurrent_gated_delta_rule_varlen_reference,
                                           step_kernels.recurrent_gated_delta_rule_varlen, _check_recurrent_varlen,
                                           _fake_recurrent_varlen, mutates_args=("state_pool",),
                                           check_values=_check_recurrent_varlen_values)
gated_rms_norm = define(gated_rms_norm_reference, step_kernels.gated_rms_norm, _check_norm, _fake_norm)


def _check_gates(a, b, A_log, dt_bias):
    op = "gated_delta_gates"
    check_float(op, "a", a)
    check_like(op, "a", a, b=b)
    h = a.shape[-1]
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        check_float(op, name, t, ndim=1)
        if t.device != a.device:
            fail(op, f"{name} is on {t.device} but a is on {a.device}")
        if t.shape[0] != h:
            fail(op, f"{name} has {t.shape[0]} elements but a's last dim (heads) is {h}")


def _fake_gates(a, b, A_log, dt_bias):
    return (torch.empty(a.shape, dtype=acc_dtype(a), device=a.device),
            empty_contiguous_like(b))


gated_delta_gates = define(gated_delta_gates_reference, step_kernels.gated_delta_gates, _check_gates, _fake_gates)
