"""qwen::attention (prefill, flash), qwen::attention_with_lse and qwen::attention_backward.

attention: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] -> o [B, Sq, Hq, D]
    o = softmax(scale * q k^T + mask) v, kv head = q head // (Hq / Hk);
    causal: query i sits at position Sk - Sq + i (Sk > Sq: a cached prefix).
attention_with_lse: also returns lse [B, Hq, Sq] (fp32, natural log; float64 for float64 q),
    which the backward needs; a training forward that keeps it saves the backward a pass.
attention_backward: (dq, dk, dv) for output gradient do (and lse's gradient dlse);
    lse None: recomputed.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from csrc_free_ops import attention as kernels
from csrc_free_ops.common import empty_contiguous_like

from .checks import check_float, check_head_dim, check_same, fail
from .registry import acc_dtype, define, last_dim_contiguous, register_autograd


def heads_first(t: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    """[B, S, H, D] -> [B, H * group, S, D] in dtype: each kv head repeated for its q heads."""
    return t.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)


def masked_scores(q: Tensor, k: Tensor, scale: float, keep: Tensor) -> Tensor:
    """scale q k^T [B, Hq, Sq, Sk] in the reference dtype, -inf where keep (broadcastable) is False."""
    dt = acc_dtype(q)
    s = (heads_first(q, 1, dt) @ heads_first(k, q.shape[2] // k.shape[2], dt).transpose(-1, -2)) * scale
    return s.masked_fill(~keep, float("-inf"))


def causal_keep(sq: int, sk: int, device) -> Tensor:
    """[Sq, Sk] True where query i (at position Sk - Sq + i) sees key j."""
    return torch.arange(sk, device=device)[None, :] <= torch.arange(sq, device=device)[:, None] + (sk - sq)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> Tensor:
    return attention_with_lse_reference(q, k, v, scale, causal)[0]


def attention_with_lse_reference(q: Tensor, k: Tensor, v: Tensor, scale: float,
                                 causal: bool = True) -> tuple[Tensor, Tensor]:
    s = _scores(q, k, scale, causal)
    o = torch.softmax(s, dim=-1) @ heads_first(v, q.shape[2] // k.shape[2], s.dtype)
    return o.transpose(1, 2).contiguous().to(q.dtype), torch.logsumexp(s, dim=-1)


def _scores(q, k, scale, causal):
    """Masked scale q k^T [B, Hq, Sq, Sk] in the reference dtype."""
    sq, sk = q.shape[1], k.shape[1]
    keep = causal_keep(sq, sk, q.device) if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    return masked_scores(q, k, scale, keep)


def attention_backward_reference(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Optional[Tensor],
                                 scale: float, causal: bool = True,
                                 dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
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


def check_heads(op, q, k, v, k_name, v_name):
    check_float(op, "q", q, ndim=4)
    check_float(op, k_name, k, ndim=4)
    check_float(op, v_name, v, ndim=4)
    check_same(op, "q", q, **{k_name: k, v_name: v})
    if k.shape != v.shape:
        fail(op, f"{k_name} {tuple(k.shape)} and {v_name} {tuple(v.shape)} must have the same shape")
    if k.shape[0] != q.shape[0]:
        fail(op, f"q has batch {q.shape[0]} but {k_name} has {k.shape[0]}")
    if k.shape[3] != q.shape[3]:
        fail(op, f"q has head_dim {q.shape[3]} but {k_name} has {k.shape[3]}")
    check_head_dim(op, q.shape[3])
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        fail(op, f"q heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")


def _check_attention(q, k, v, scale, causal=True):
    check_heads("attention", q, k, v, "k", "v")
    if not 0.0 < scale < math.inf:
        fail("attention", f"scale must be a positive finite number, got {scale}")
    if k.shape[1] == 0:
        fail("attention", "k and v must hold at least one position")
    if causal and k.shape[1] < q.shape[1]:
        fail("attention", f"causal attention needs Sk >= Sq, got Sk={k.shape[1]} < Sq={q.shape[1]}")


def _check_backward(do, q, k, v, o, lse, scale, causal, dlse):
    op = "attention_backward"
    _check_attention(q, k, v, scale, causal)
    for name, t in (("do", do), ("o", o)):
        check_float(op, name, t, ndim=4)
        if t.shape != q.shape:
            fail(op, f"{name} {tuple(t.shape)} must have q's shape {tuple(q.shape)}")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and (tuple(t.shape) != (q.shape[0], q.shape[2], q.shape[1]) or not t.is_contiguous()):
            fail(op, f"{name} must be contiguous [B, Hq, Sq] = {(q.shape[0], q.shape[2], q.shape[1])}, got {tuple(t.shape)}")


def _backward_kernel(do, q, k, v, o, lse, scale, causal, dlse):
    return kernels.attention_backward(do, q, k, v, o, None if lse is None else lse.float(), scale, causal,
                                      None if dlse is None else dlse.float())


attention = define(attention_reference, kernels.attention, check=_check_attention,
                   fake=lambda q, k, v, scale, causal: q.new_empty(q.shape))

attention_with_lse = define(
    attention_with_lse_reference, kernels.attention_with_lse, check=_check_attention,
    fake=lambda q, k, v, scale, causal: (q.new_empty(q.shape),
                                         q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=acc_dtype(q))))

attention_backward = define(attention_backward_reference, _backward_kernel, check=_check_backward,
                            fake=lambda do, q, k, v, *args: tuple(map(empty_contiguous_like, (q, k, v))),
                            dispatch_arg=1)


def _setup(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    ctx.save_for_backward(q, k, v, output)
    ctx.scale, ctx.causal = scale, causal


def _backward(ctx, do):
    q, k, v, o = ctx.saved_tensors
    dq, dk, dv = attention_backward(last_dim_contiguous(do), q, k, v, o, None, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None


def _setup_with_lse(ctx, inputs, output):
    q, k, v, scale, causal = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.causal = scale, causal
    ctx.set_materialize_grads(False)


def _backward_with_lse(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    if do is None:
        if dlse is None:
            return None, None, None, None, None
        do = torch.zeros_like(o)
    dq, dk, dv = attention_backward(last_dim_contiguous(do), q, k, v, o, lse, ctx.scale, ctx.causal,
                                    None if dlse is None else dlse.contiguous())
    return dq, dk, dv, None, None


register_autograd(attention, _backward, _setup)
register_autograd(attention_with_lse, _backward_with_lse, _setup_with_lse)
