"""qwen::decode_attention: flash-decoding of a few new queries per sequence over a KV cache.

q [B, Tq, Hq, D], k_cache/v_cache [B, L, Hk, D], cache_seqlens [B] -> o [B, Tq, Hq, D];
query t of sequence b sits at position cache_seqlens[b] - Tq + t and sees
cache[b, :position + 1] (the new tokens are already stored).

cache_seqlens must lie in [Tq, L]: checked on CPU tensors (free there); on CUDA, where a
check would cost a host sync, the kernel clamps it to [0, L] so it never reads outside the
cache, and a query that sees no key outputs zeros (the reference does the same).
"""
import torch
from torch import Tensor

from csrc_free_ops import decode_attention as kernels

from .attention import check_heads, heads_first, masked_scores
from .checks import check_index, fail
from .registry import define

MAX_DECODE_ROWS = 128
"""decode_attention handles Tq * (Hq / Hk) <= 128 query rows per kv head: a few tokens, not a prefill."""


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float) -> Tensor:
    """Lengths are clamped to [0, L] as the kernel does; a query that sees no key gives zeros. Cache
    entries past a sequence's length are zeroed before the products (the kernel never reads them),
    so whatever they hold (NaN included) cannot reach the output."""
    tq, cache_len = q.shape[1], k_cache.shape[1]
    seqlens = cache_seqlens.long().clamp(0, cache_len)
    slots = torch.arange(cache_len, device=q.device)
    stored = (slots[None, :] < seqlens[:, None])[:, :, None, None]  # [B, L, 1, 1]
    k_cache, v_cache = k_cache.where(stored, 0.0), v_cache.where(stored, 0.0)
    q_pos = seqlens[:, None] - tq + torch.arange(tq, device=q.device)  # [B, Tq]
    keep = (slots[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, Tq, L]
    s = masked_scores(q, k_cache, scale, keep)
    p = torch.where(keep.any(-1, keepdim=True), torch.softmax(s, dim=-1), 0.0)
    o = p @ heads_first(v_cache, q.shape[2] // k_cache.shape[2], s.dtype)
    return o.transpose(1, 2).contiguous().to(q.dtype)


def _check_decode(q, k_cache, v_cache, cache_seqlens):
    op = "decode_attention"
    check_heads(op, q, k_cache, v_cache, "k_cache", "v_cache")
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
    if cache_seqlens.numel():
        lo, hi = int(cache_seqlens.min()), int(cache_seqlens.max())
        if lo < tq or hi > cache_len:
            fail("decode_attention", f"cache_seqlens must lie in [Tq={tq}, L={cache_len}] (the new tokens are "
                                     f"already stored, the cache holds L), got values in [{lo}, {hi}]")


decode_attention = define(
    decode_attention_reference, kernels.decode_attention,
    check=lambda q, k_cache, v_cache, cache_seqlens, scale: _check_decode(q, k_cache, v_cache, cache_seqlens),
    fake=lambda q, *args: q.new_empty(q.shape),
    check_values=lambda q, k_cache, v_cache, cache_seqlens, scale: _check_seqlens(cache_seqlens, q.shape[1],
                                                                                  k_cache.shape[1]))
