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
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import attention as kernels
from csrc_free_ops.common import empty_contiguous_like

from .checks import check_float, check_head_dim, check_same, fail
from .registry import acc_dtype, define, last_dim_contiguous, register_autograd, to_dtype


QUERY_BLOCK = 128
"""The prefill references take the queries this many positions at a time: a block's scores
(Hq x QUERY_BLOCK x Sk per sequence) stay small, and a causal block reads only the keys it sees."""


def heads_first(t: Tensor, group: int, dtype: torch.dtype) -> Tensor:
    """[B, S, H, D] -> [B, H * group, S, D] in dtype: each kv head repeated for its q heads."""
    return t.to(dtype).transpose(1, 2).repeat_interleave(group, dim=1)


def query_rows(t: Tensor, hk: int, dtype: torch.dtype) -> Tensor:
    """[B, S, Hq, D] -> [B, Hk, G * S, D] in dtype, G = Hq / Hk: kv head h's rows are its G query
    heads' positions, head by head, so one product per kv head serves them all (k, v never copied)."""
    b, sq, hq, d = t.shape
    return to_dtype(t, dtype).transpose(1, 2).reshape(b, hk, hq // hk * sq, d)


def heads_last(t: Tensor, g: int, s: int, dtype: torch.dtype) -> Tensor:
    """query_rows' inverse: [B, Hk, G * S, D] -> [B, S, Hk * G, D], contiguous, in dtype."""
    b, hk, _, d = t.shape
    return to_dtype(t.reshape(b, hk * g, s, d).transpose(1, 2).contiguous(), dtype)


def grouped_scores(q: Tensor, keys: Tensor, scale: float) -> Tensor:
    """scale q k^T as [B, Hk, G, Sq, Sk] in keys' dtype (query_rows' layout); keys: k [B, Sk, Hk, D]
    heads first, [B, Hk, Sk, D] (k.transpose(1, 2): a view, or a copy, which the products read faster)."""
    rows = query_rows(q, keys.shape[1], keys.dtype) * scale
    return (rows @ keys.transpose(-1, -2)).unflatten(2, (q.shape[2] // keys.shape[1], q.shape[1]))


def grouped_output(p: Tensor, values: Tensor, dtype: torch.dtype) -> Tensor:
    """p [B, Hk, G, Sq, Sk] @ values (v [B, Sk, Hk, D] heads first, [B, Hk, Sk, D]) -> o [B, Sq, Hk * G, D],
    contiguous, in dtype."""
    return heads_last(p.flatten(2, 3) @ values, p.shape[2], p.shape[3], dtype)


def causal_mask(sq: int, sk: int, dtype: torch.dtype, device) -> Tensor:
    """[Sq, Sk], added to the scores: 0 where query i (at position Sk - Sq + i) sees key j <= Sk - Sq + i,
    -inf where it does not."""
    sees = torch.arange(sk, device=device)[None, :] <= torch.arange(sq, device=device)[:, None] + (sk - sq)
    return torch.zeros(sq, sk, dtype=dtype, device=device).masked_fill(~sees, float("-inf"))


def _block_scores(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool):
    """For each block of QUERY_BLOCK queries: its masked scores [B, Hk, G, block, Sk'] and the
    values they weigh ([B, Hk, Sk', D]), Sk' the keys its last query sees (all Sk without causal)."""
    sq, sk, dt = q.shape[1], k.shape[1], acc_dtype(q)
    keys, values = to_dtype(k, dt).transpose(1, 2).contiguous(), to_dtype(v, dt).transpose(1, 2)
    for start in range(0, max(sq, 1), QUERY_BLOCK):  # Sq = 0: one empty block
        stop = min(start + QUERY_BLOCK, sq)
        seen = sk - sq + stop if causal else sk
        s = grouped_scores(q[:, start:stop], keys[:, :, :seen], scale)
        if causal:  # every query of the block sees all but the last stop - start keys
            s[..., seen - (stop - start):] += causal_mask(stop - start, stop - start, dt, q.device)
        yield s, values[:, :, :seen]


def attention_reference(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> Tensor:
    """softmax(scale q k^T + mask) v. Without a cached prefix (Sq = Sk, where SDPA's causal mask is
    ours) or without causal, one F.scaled_dot_product_attention call over the grouped heads; with
    one, QUERY_BLOCK queries at a time."""
    if causal and q.shape[1] != k.shape[1]:
        return torch.cat([grouped_output(torch.softmax(s, dim=-1), vb, q.dtype)
                          for s, vb in _block_scores(q, k, v, scale, causal)], dim=1)
    dt = acc_dtype(q)
    o = F.scaled_dot_product_attention(*(to_dtype(t, dt).transpose(1, 2) for t in (q, k, v)), scale=scale,
                                       is_causal=causal, enable_gqa=True)
    return to_dtype(o.transpose(1, 2), q.dtype).contiguous()


def attention_with_lse_reference(q: Tensor, k: Tensor, v: Tensor, scale: float,
                                 causal: bool = True) -> tuple[Tensor, Tensor]:
    """attention_reference's output and the logsumexp of each query's masked scores [B, Hq, Sq]."""
    outs, lses = [], []
    for s, vb in _block_scores(q, k, v, scale, causal):
        outs.append(grouped_output(torch.softmax(s, dim=-1), vb, q.dtype))
        lses.append(torch.logsumexp(s, dim=-1).flatten(1, 2))
    return torch.cat(outs, dim=1), torch.cat(lses, dim=-1)


def attention_backward_reference(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Optional[Tensor],
                                 scale: float, causal: bool = True,
                                 dlse: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Plain math over the whole score matrix in query_rows' layout (dk, dv sum over the rows of
    each kv head's query heads); o and lse are recomputed, the arguments only mirror the kernel's."""
    sq, sk, hk, dt = q.shape[1], k.shape[1], k.shape[2], acc_dtype(q)
    kf, vf = to_dtype(k, dt).transpose(1, 2), to_dtype(v, dt).transpose(1, 2)  # [B, Hk, Sk, D]
    s = grouped_scores(q, kf, scale)
    if causal:
        s = s + causal_mask(sq, sk, s.dtype, q.device)
    g = s.shape[2]
    p = torch.softmax(s, dim=-1).flatten(2, 3)  # [B, Hk, G * Sq, Sk]
    dof = query_rows(do, hk, dt)
    delta = (dof * (p @ vf)).sum(-1, keepdim=True)
    if dlse is not None:
        delta = delta - dlse.to(dt).unflatten(1, (hk, g)).flatten(2, 3)[..., None]
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    dq = heads_last((ds @ kf) * scale, g, sq, q.dtype)
    dk = (ds.transpose(-1, -2) @ query_rows(q, hk, dt)) * scale
    dv = p.transpose(-1, -2) @ dof
    return dq, dk.transpose(1, 2).contiguous().to(k.dtype), dv.transpose(1, 2).contiguous().to(v.dtype)


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
    check_same(op, "q", q, do=do, o=o)  # the kernels' dots take do with q's, k's and v's dtype
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and t.device != q.device:
            fail(op, f"{name} is on {t.device} but q is on {q.device}")
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
