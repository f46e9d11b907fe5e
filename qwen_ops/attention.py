"""qwen::attention (prefill, flash) and qwen::decode_attention (flash-decoding over a KV cache).

attention: q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] -> o [B, Sq, Hq, D]
    o = softmax(scale * q k^T + mask) v, kv head = q head // (Hq / Hk);
    causal: query i sits at position Sk - Sq + i (Sk > Sq: a cached prefix).
decode_attention: q [B, Tq, Hq, D], k_cache/v_cache [B, L, Hk, D], cache_seqlens [B]
    -> o [B, Tq, Hq, D]; query t of sequence b sits at position cache_seqlens[b] - Tq + t
    and sees cache[b, :position + 1] (the new tokens are already stored).
"""
import torch
from torch import Tensor

from csrc_free_ops import attention as attention_kernels
from csrc_free_ops import decode_attention as decode_kernels

from .checks import check_float, check_head_dim, check_index, check_same, fail
from .dispatch import acc_dtype, use_triton

MAX_DECODE_ROWS = 128
"""decode_attention handles Tq * (Hq / Hk) <= 128 query rows per kv head: a few tokens, not a prefill."""


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


def _softmax_attention(q, k, v, scale, keep):
    s = masked_scores(q, k, scale, keep)
    o = torch.softmax(s, dim=-1) @ heads_first(v, q.shape[2] // k.shape[2], s.dtype)
    return o.transpose(1, 2).contiguous().to(q.dtype)


def attention_reference(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> Tensor:
    sq, sk = q.shape[1], k.shape[1]
    keep = causal_keep(sq, sk, q.device) if causal else torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    return _softmax_attention(q, k, v, scale, keep)


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float) -> Tensor:
    """Lengths are clamped to [0, L] as the kernel does; a query that sees no key gives zeros."""
    tq, cache_len = q.shape[1], k_cache.shape[1]
    seqlens = cache_seqlens.long().clamp(0, cache_len)
    q_pos = seqlens[:, None] - tq + torch.arange(tq, device=q.device)  # [B, Tq]
    keep = (torch.arange(cache_len, device=q.device)[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, Tq, L]
    s = masked_scores(q, k_cache, scale, keep)
    p = torch.where(keep.any(-1, keepdim=True), torch.softmax(s, dim=-1), 0.0)
    o = p @ heads_first(v_cache, q.shape[2] // k_cache.shape[2], s.dtype)
    return o.transpose(1, 2).contiguous().to(q.dtype)


def _check_heads(op, q, k, v, k_name, v_name):
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


def _check_attention(q, k, v, causal):
    _check_heads("attention", q, k, v, "k", "v")
    if k.shape[1] == 0:
        fail("attention", "k and v must hold at least one position")
    if causal and k.shape[1] < q.shape[1]:
        fail("attention", f"causal attention needs Sk >= Sq, got Sk={k.shape[1]} < Sq={q.shape[1]}")


@torch.library.custom_op("qwen::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = True) -> Tensor:
    _check_attention(q, k, v, causal)
    if use_triton(q):
        return attention_kernels.attention(q, k, v, scale, causal)
    return attention_reference(q, k, v, scale, causal)


@attention.register_fake
def _(q, k, v, scale, causal=True):
    _check_attention(q, k, v, causal)
    return q.new_empty(q.shape)


def _check_decode(q, k_cache, v_cache, cache_seqlens):
    op = "decode_attention"
    _check_heads(op, q, k_cache, v_cache, "k_cache", "v_cache")
    check_index(op, "cache_seqlens", cache_seqlens, (q.shape[0],))
    if cache_seqlens.device != q.device:
        fail(op, f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    tq, cache_len = q.shape[1], k_cache.shape[1]
    if tq > cache_len:
        fail(op, f"{tq} new tokens do not fit a cache of length {cache_len}")
    if tq * (q.shape[2] // k_cache.shape[2]) > MAX_DECODE_ROWS:
        fail(op, f"Tq={tq} new tokens x {q.shape[2] // k_cache.shape[2]} q heads per kv head exceeds "
                 f"{MAX_DECODE_ROWS} rows; use attention for prefill")


def _check_seqlens(cache_seqlens: Tensor, tq: int, cache_len: int):
    """Value check, CPU tensors only (free there; a host sync on CUDA, where the kernel clamps instead)."""
    if cache_seqlens.device.type == "cpu" and cache_seqlens.numel():
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < tq or hi > cache_len:
            fail("decode_attention", f"cache_seqlens must lie in [Tq={tq}, L={cache_len}] (the new tokens are "
                                     f"already stored, the cache holds L), got values in [{lo}, {hi}]")


@torch.library.custom_op("qwen::decode_attention", mutates_args=())
def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float) -> Tensor:
    _check_decode(q, k_cache, v_cache, cache_seqlens)
    _check_seqlens(cache_seqlens, q.shape[1], k_cache.shape[1])
    if use_triton(q):
        return decode_kernels.decode_attention(q, k_cache, v_cache, cache_seqlens, scale)
    return decode_attention_reference(q, k_cache, v_cache, cache_seqlens, scale)


@decode_attention.register_fake
def _(q, k_cache, v_cache, cache_seqlens, scale):
    _check_decode(q, k_cache, v_cache, cache_seqlens)
    return q.new_empty(q.shape)
