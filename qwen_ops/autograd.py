"""Training: backward ops and `torch.library.register_autograd` for the forward ops.

Every backward is itself a custom op (schema, fake kernel, Triton path, `*_reference` in plain
PyTorch), so the backward formulas stay traceable: AOTAutograd and torch.compile see opaque
ops, never a Triton launch on fake tensors.

| forward op            | saved for backward                  | backward op                         |
|-----------------------|-------------------------------------|-------------------------------------|
| rms_norm              | x, weight (rstd recomputed)         | rms_norm_backward                   |
| add_rms_norm          | the sum output, weight              | rms_norm_backward (+ d sum)         |
| rope                  | q, k (norm only), positions, weights| rope_backward                       |
| silu_mul              | gate_up                             | silu_mul_backward                   |
| silu_mul_split (new)  | gate, up                            | silu_mul_split_backward             |
| linear                | x, weight                           | linear_backward                     |
| attention             | q, k, v, o (lse recomputed)         | attention_backward                  |
| attention_with_lse    | q, k, v, o, lse                     | attention_backward                  |

`silu_mul_split(gate, up)` and `attention_with_lse(q, k, v, scale, causal) -> (o, lse)` are
forward ops added for training: the transformers patch has gate and up as two tensors, and
a forward that keeps lse saves the backward one pass over q k^T.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import activation as act_fwd_kernels
from csrc_free_ops import activation_backward as act_kernels
from csrc_free_ops import attention as attn_fwd_kernels
from csrc_free_ops import attention_backward as attn_kernels
from csrc_free_ops import linear_backward as linear_kernels
from csrc_free_ops import norm_backward as norm_kernels
from csrc_free_ops import rope_backward as rope_kernels

from .attention import _check_attention, causal_keep, heads_first, masked_scores
from .checks import check_float, check_same, fail
from .dispatch import acc_dtype, use_triton
from .rope import rope_cos_sin

ops = torch.ops.qwen


def _lastdim(t: Optional[Tensor]) -> Optional[Tensor]:
    """Kernels read rows with unit stride: gradients can arrive expanded (stride 0) or transposed."""
    return t if t is None or t.dim() == 0 or t.stride(-1) == 1 else t.contiguous()


def _empty(ref: Tensor) -> Tensor:
    """Placeholder output of a backward op for a gradient nobody asked for."""
    return ref.new_empty((0,))


# ---------------------------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------------------------

def rms_norm_backward_reference(dy: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                                dsum: Optional[Tensor] = None):
    dt = acc_dtype(x)
    xf, dyf = x.to(dt), dy.to(dt)
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    g = dyf * (weight.to(dt) + offset)
    dx = rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    if dsum is not None:
        dx = dx + dsum.to(dt)
    dw = (dyf * xhat).reshape(-1, x.shape[-1]).sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype)


def _check_norm_bwd(dy, x, weight, dsum):
    op = "rms_norm_backward"
    check_float(op, "x", x)
    check_float(op, "dy", dy)
    check_float(op, "weight", weight, ndim=1)
    check_same(op, "x", x, dy=dy, dsum=dsum)
    if dy.shape != x.shape or (dsum is not None and dsum.shape != x.shape):
        fail(op, f"dy {tuple(dy.shape)} / dsum must have x's shape {tuple(x.shape)}")
    if weight.shape[0] != x.shape[-1]:
        fail(op, f"weight has {weight.shape[0]} elements but x's last dim is {x.shape[-1]}")


@torch.library.custom_op("qwen::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Tensor, eps: float, offset: float = 0.0,
                      dsum: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(dx, dweight) of rms_norm(x, weight, eps, offset) for output gradient dy; dsum (add_rms_norm's
    second output's gradient) is added to dx."""
    _check_norm_bwd(dy, x, weight, dsum)
    if use_triton(x):
        return norm_kernels.rms_norm_backward(dy, x, weight, eps, offset, dsum)
    return rms_norm_backward_reference(dy, x, weight, eps, offset, dsum)


@rms_norm_backward.register_fake
def _(dy, x, weight, eps, offset=0.0, dsum=None):
    _check_norm_bwd(dy, x, weight, dsum)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty_like(weight)


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps, offset = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps, ctx.offset = eps, offset


def _rms_norm_bwd(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = ops.rms_norm_backward(_lastdim(dy), x, weight, ctx.eps, ctx.offset)
    return dx, dw, None, None


torch.library.register_autograd("qwen::rms_norm", _rms_norm_bwd, setup_context=_rms_norm_setup)


def _add_rms_norm_setup(ctx, inputs, output):
    _, _, weight, eps, offset = inputs
    ctx.save_for_backward(output[1], weight)  # the (rounded) sum is what was normalised
    ctx.eps, ctx.offset = eps, offset
    ctx.set_materialize_grads(False)


def _add_rms_norm_bwd(ctx, dy, dsum):
    summed, weight = ctx.saved_tensors
    if dy is None:
        return dsum, dsum, None, None, None
    dx, dw = ops.rms_norm_backward(_lastdim(dy), summed, weight, ctx.eps, ctx.offset, _lastdim(dsum))
    return dx, dx, dw, None, None


torch.library.register_autograd("qwen::add_rms_norm", _add_rms_norm_bwd, setup_context=_add_rms_norm_setup)


# ---------------------------------------------------------------------------------------------
# SwiGLU
# ---------------------------------------------------------------------------------------------

def _silu_mul_grads(dy, gate, up):
    dt = acc_dtype(gate)
    g, u, dyf = gate.to(dt), up.to(dt), dy.to(dt)
    s = torch.sigmoid(g)
    return dyf * u * s * (1 + g * (1 - s)), dyf * g * s


def silu_mul_backward_reference(dy: Tensor, gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.cat(_silu_mul_grads(dy, gate, up), dim=-1).to(gate_up.dtype)


def _check_silu_bwd(dy, gate_up):
    check_float("silu_mul_backward", "gate_up", gate_up)
    check_float("silu_mul_backward", "dy", dy)
    if dy.shape != (*gate_up.shape[:-1], gate_up.shape[-1] // 2):
        fail("silu_mul_backward", f"dy {tuple(dy.shape)} does not match gate_up {tuple(gate_up.shape)}")


@torch.library.custom_op("qwen::silu_mul_backward", mutates_args=())
def silu_mul_backward(dy: Tensor, gate_up: Tensor) -> Tensor:
    """d gate_up [..., 2I] of silu_mul(gate_up) for output gradient dy [..., I]."""
    _check_silu_bwd(dy, gate_up)
    if use_triton(gate_up):
        return act_kernels.silu_mul_backward(dy, gate_up)
    return silu_mul_backward_reference(dy, gate_up)


@silu_mul_backward.register_fake
def _(dy, gate_up):
    _check_silu_bwd(dy, gate_up)
    return torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _silu_mul_bwd(ctx, dy):
    (gate_up,) = ctx.saved_tensors
    return ops.silu_mul_backward(_lastdim(dy), gate_up)


torch.library.register_autograd("qwen::silu_mul", _silu_mul_bwd, setup_context=_silu_mul_setup)


def silu_mul_split_reference(gate: Tensor, up: Tensor) -> Tensor:
    dt = acc_dtype(gate)
    return (F.silu(gate.to(dt)) * up.to(dt)).to(gate.dtype)


def _check_split(op, gate, up, dy=None):
    check_float(op, "gate", gate)
    check_float(op, "up", up)
    check_same(op, "gate", gate, up=up, dy=dy)
    if up.shape != gate.shape or (dy is not None and dy.shape != gate.shape):
        fail(op, f"gate {tuple(gate.shape)}, up {tuple(up.shape)}" + ("" if dy is None else f" and dy {tuple(dy.shape)}")
             + " must have one shape")


@torch.library.custom_op("qwen::silu_mul_split", mutates_args=())
def silu_mul_split(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for gate and up held in two tensors (transformers' gate_proj / up_proj)."""
    _check_split("silu_mul_split", gate, up)
    if use_triton(gate):
        return act_fwd_kernels.silu_mul_split(gate, up)
    return silu_mul_split_reference(gate, up)


@silu_mul_split.register_fake
def _(gate, up):
    _check_split("silu_mul_split", gate, up)
    return torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)


def silu_mul_split_backward_reference(dy: Tensor, gate: Tensor, up: Tensor):
    dg, du = _silu_mul_grads(dy, gate, up)
    return dg.to(gate.dtype), du.to(gate.dtype)


@torch.library.custom_op("qwen::silu_mul_split_backward", mutates_args=())
def silu_mul_split_backward(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    _check_split("silu_mul_split_backward", gate, up, dy)
    if use_triton(gate):
        return act_kernels.silu_mul_split_backward(dy, gate, up)
    return silu_mul_split_backward_reference(dy, gate, up)


@silu_mul_split_backward.register_fake
def _(dy, gate, up):
    _check_split("silu_mul_split_backward", gate, up, dy)
    return (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(gate.shape, dtype=gate.dtype, device=gate.device))


def _silu_mul_split_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_split_bwd(ctx, dy):
    gate, up = ctx.saved_tensors
    return ops.silu_mul_split_backward(_lastdim(dy), gate, up)


torch.library.register_autograd("qwen::silu_mul_split", _silu_mul_split_bwd, setup_context=_silu_mul_split_setup)


# ---------------------------------------------------------------------------------------------
# RoPE (+ fused q/k RMSNorm)
# ---------------------------------------------------------------------------------------------

def rope_backward_reference(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, positions: Tensor, theta: float,
                            rotary_dim: int, q_norm_weight: Optional[Tensor] = None,
                            k_norm_weight: Optional[Tensor] = None, norm_eps: float = 1e-6, norm_offset: float = 0.0):
    dt = acc_dtype(q)
    half = rotary_dim // 2
    cos, sin = rope_cos_sin(positions, theta, rotary_dim, dt)

    def unrotate(dy, x, w):
        dyf = dy.to(dt)
        d1, d2, rest = dyf[..., :half], dyf[..., half:rotary_dim], dyf[..., rotary_dim:]
        g = torch.cat([d1 * cos + d2 * sin, d2 * cos - d1 * sin, rest], dim=-1)
        if w is None:
            return g.to(x.dtype), _empty(x)
        return rms_norm_backward_reference(g, x, w, norm_eps, norm_offset)

    dq_in, dqw = unrotate(dq, q, q_norm_weight)
    dk_in, dkw = unrotate(dk, k, k_norm_weight)
    return dq_in, dk_in, dqw, dkw


@torch.library.custom_op("qwen::rope_backward", mutates_args=())
def rope_backward(dq: Tensor, dk: Tensor, q: Tensor, k: Tensor, positions: Tensor, theta: float, rotary_dim: int,
                  q_norm_weight: Optional[Tensor] = None, k_norm_weight: Optional[Tensor] = None,
                  norm_eps: float = 1e-6, norm_offset: float = 0.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq_in, dk_in, d q_norm_weight, d k_norm_weight) of rope(q, k, ...) for output gradients dq, dk.
    Without norm weights the last two are empty tensors."""
    if dq.shape != q.shape or dk.shape != k.shape:
        fail("rope_backward", f"dq {tuple(dq.shape)} / dk {tuple(dk.shape)} must match q {tuple(q.shape)} / k {tuple(k.shape)}")
    if use_triton(q):
        dq_in, dk_in, dqw, dkw = rope_kernels.rope_backward(dq, dk, q, k, positions, theta, rotary_dim,
                                                            q_norm_weight, k_norm_weight, norm_eps, norm_offset)
        return dq_in, dk_in, _empty(q) if dqw is None else dqw, _empty(k) if dkw is None else dkw
    return rope_backward_reference(dq, dk, q, k, positions, theta, rotary_dim, q_norm_weight, k_norm_weight,
                                   norm_eps, norm_offset)


@rope_backward.register_fake
def _(dq, dk, q, k, positions, theta, rotary_dim, q_norm_weight=None, k_norm_weight=None, norm_eps=1e-6,
      norm_offset=0.0):
    def w_grad(w, ref):
        return _empty(ref) if w is None else torch.empty_like(w)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            w_grad(q_norm_weight, q), w_grad(k_norm_weight, k))


def _rope_setup(ctx, inputs, output):
    q, k, positions, theta, rotary_dim, qw, kw, eps, offset = inputs
    # Without the fused norm the backward is a pure rotation: q and k need not be kept.
    has_norm = qw is not None
    ctx.save_for_backward(q if has_norm else None, k if has_norm else None, positions, qw, kw)
    ctx.args = (theta, rotary_dim, eps, offset)


def _rope_bwd(ctx, dq, dk):
    q, k, positions, qw, kw = ctx.saved_tensors
    theta, rotary_dim, eps, offset = ctx.args
    if qw is None:  # only their shapes and dtypes are read
        q, k = dq, dk
    dq_in, dk_in, dqw, dkw = ops.rope_backward(_lastdim(dq), _lastdim(dk), q, k, positions, theta, rotary_dim,
                                               qw, kw, eps, offset)
    has_norm = qw is not None
    return (dq_in, dk_in, None, None, None, dqw if has_norm else None, dkw if has_norm else None, None, None)


torch.library.register_autograd("qwen::rope", _rope_bwd, setup_context=_rope_setup)


# ---------------------------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------------------------

def linear_backward_reference(dy: Tensor, x: Tensor, weight: Tensor, need_dx: bool = True, need_dw: bool = True,
                              need_db: bool = False):
    dt = acc_dtype(x)
    dy2, x2 = dy.to(dt).reshape(-1, weight.shape[0]), x.to(dt).reshape(-1, weight.shape[1])
    dx = (dy2 @ weight.to(dt)).reshape(x.shape).to(x.dtype) if need_dx else _empty(x)
    dw = (dy2.t() @ x2).to(weight.dtype) if need_dw else _empty(weight)
    db = dy2.sum(0).to(weight.dtype) if need_db else _empty(weight)
    return dx, dw, db


def _check_linear_bwd(dy, x, weight):
    op = "linear_backward"
    check_float(op, "dy", dy)
    check_float(op, "x", x)
    check_float(op, "weight", weight, ndim=2)
    check_same(op, "x", x, dy=dy, weight=weight)
    if dy.shape != (*x.shape[:-1], weight.shape[0]) or x.shape[-1] != weight.shape[1]:
        fail(op, f"dy {tuple(dy.shape)}, x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")


@torch.library.custom_op("qwen::linear_backward", mutates_args=())
def linear_backward(dy: Tensor, x: Tensor, weight: Tensor, need_dx: bool = True, need_dw: bool = True,
                    need_db: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(dx = dy @ W, dW = dy^T @ x, db = sum_rows dy) for y = x @ W^T + b; gradients not asked for
    come back as empty tensors."""
    _check_linear_bwd(dy, x, weight)
    if use_triton(x):
        dx, dw, db = linear_kernels.linear_backward(dy, x, weight, need_dx, need_dw, need_db)
        return (_empty(x) if dx is None else dx, _empty(weight) if dw is None else dw,
                _empty(weight) if db is None else db)
    return linear_backward_reference(dy, x, weight, need_dx, need_dw, need_db)


@linear_backward.register_fake
def _(dy, x, weight, need_dx=True, need_dw=True, need_db=False):
    _check_linear_bwd(dy, x, weight)
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_dx else _empty(x),
            torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dw else _empty(weight),
            weight.new_empty((weight.shape[0],)) if need_db else _empty(weight))


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_bwd(ctx, dy):
    x, weight = ctx.saved_tensors
    need_dx, need_dw, need_db = (tuple(ctx.needs_input_grad) + (False,))[:3]  # bias may be left out
    dx, dw, db = ops.linear_backward(_lastdim(dy), x, weight, need_dx, need_dw, bool(need_db and ctx.has_bias))
    return (dx if need_dx else None, dw if need_dw else None, db if need_db and ctx.has_bias else None)


torch.library.register_autograd("qwen::linear", _linear_bwd, setup_context=_linear_setup)


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

def _scores(q, k, scale, causal):
    """Masked scale q k^T [B, Hq, Sq, Sk] in the reference dtype."""
    sq, sk = q.shape[1], k.shape[1]
    keep = causal_keep(sq, sk, q.device) if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    return masked_scores(q, k, scale, keep)


def attention_with_lse_reference(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True):
    s = _scores(q, k, scale, causal)
    o = torch.softmax(s, dim=-1) @ heads_first(v, q.shape[2] // k.shape[2], s.dtype)
    return o.transpose(1, 2).contiguous().to(q.dtype), torch.logsumexp(s, dim=-1)


def attention_backward_reference(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Optional[Tensor],
                                 scale: float, causal: bool = True, dlse: Optional[Tensor] = None):
    """Plain math (o and lse are recomputed; the arguments only mirror the kernel's)."""
    s = _scores(q, k, scale, causal)
    dt, group = s.dtype, q.shape[2] // k.shape[2]
    qf, kf, vf = heads_first(q, 1, dt), heads_first(k, group, dt), heads_first(v, group, dt)
    p = torch.softmax(s, dim=-1)
    dof = do.to(dt).transpose(1, 2)
    of = p @ vf
    dp = dof @ vf.transpose(-1, -2)
    delta = (dof * of).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(dt)[..., None]
    ds = p * (dp - delta)
    dq = (ds @ kf) * scale
    dk = (ds.transpose(-1, -2) @ qf) * scale
    dv = p.transpose(-1, -2) @ dof
    b, hk, sk, d = k.shape[0], k.shape[2], k.shape[1], k.shape[3]

    def fold(t):  # [B, Hq, Sk, D] -> [B, Sk, Hk, D]: sum over the query heads of each group
        return t.reshape(b, hk, group, sk, d).sum(2).transpose(1, 2).contiguous()

    return (dq.transpose(1, 2).contiguous().to(q.dtype), fold(dk).to(k.dtype), fold(dv).to(v.dtype))


@torch.library.custom_op("qwen::attention_with_lse", mutates_args=())
def attention_with_lse(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> tuple[Tensor, Tensor]:
    """qwen::attention that also returns lse [B, Hq, Sq] (fp32, natural log; float64 for float64 q)."""
    _check_attention(q, k, v, causal)
    if use_triton(q):
        return attn_fwd_kernels.attention_with_lse(q, k, v, scale, causal)
    return attention_with_lse_reference(q, k, v, scale, causal)


@attention_with_lse.register_fake
def _(q, k, v, scale, causal=True):
    _check_attention(q, k, v, causal)
    return q.new_empty(q.shape), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc_dtype(q))


def _check_attention_bwd(do, q, k, v, o, lse, dlse, causal):
    op = "attention_backward"
    _check_attention(q, k, v, causal)
    for name, t in (("do", do), ("o", o)):
        check_float(op, name, t, ndim=4)
        if t.shape != q.shape:
            fail(op, f"{name} {tuple(t.shape)} must have q's shape {tuple(q.shape)}")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and (tuple(t.shape) != (q.shape[0], q.shape[2], q.shape[1]) or not t.is_contiguous()):
            fail(op, f"{name} must be contiguous [B, Hq, Sq] = {(q.shape[0], q.shape[2], q.shape[1])}, got {tuple(t.shape)}")


@torch.library.custom_op("qwen::attention_backward", mutates_args=())
def attention_backward(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Optional[Tensor], scale: float,
                       causal: bool = True, dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of attention(q, k, v, scale, causal) for output gradient do. lse None: recomputed."""
    _check_attention_bwd(do, q, k, v, o, lse, dlse, causal)
    if use_triton(q):
        if lse is not None:
            lse = lse.float()
        return attn_kernels.attention_backward(do, q, k, v, o, lse, scale, causal,
                                               None if dlse is None else dlse.float())
    return attention_backward_reference(do, q, k, v, o, lse, scale, causal, dlse)


@attention_backward.register_fake
def _(do, q, k, v, o, lse, scale, causal=True, dlse=None):
    _check_attention_bwd(do, q, k, v, o, lse, dlse, causal)
    return (torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype, device=k.device),
            torch.empty(v.shape, dtype=v.dtype, device=v.device))


def _attention_setup(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output)
    ctx.scale, ctx.causal = scale, causal


def _attention_bwd(ctx, do):
    q, k, v, o = ctx.saved_tensors
    dq, dk, dv = ops.attention_backward(_lastdim(do), q, k, v, o, None, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


torch.library.register_autograd("qwen::attention", _attention_bwd, setup_context=_attention_setup)


def _attention_lse_setup(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.causal = scale, causal
    ctx.set_materialize_grads(False)


def _attention_lse_bwd(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        if dlse is None:
            return None, None, None, None, None
        do = torch.zeros_like(o)
    dq, dk, dv = ops.attention_backward(_lastdim(do), q, k, v, o, lse, ctx.scale, ctx.causal,
                                        None if dlse is None else dlse.contiguous())
    return dq, dk, dv, None, None


torch.library.register_autograd("qwen::attention_with_lse", _attention_lse_bwd, setup_context=_attention_lse_setup)
