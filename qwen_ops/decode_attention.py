"""qwen::decode_attention: flash-decoding of a few new queries per sequence over a KV cache.

q [B, Tq, Hq, D], k_cache/v_cache [B, L, Hk, D], cache_seqlens [B] -> o [B, Tq, Hq, D];
query t of sequence b sits at position cache_seqlens[b] - Tq + t and sees
cache[b, :position + 1] (the new tokens are already stored).

cache_seqlens must lie in [Tq, L]: checked on CPU tensors (free there); on CUDA, where a
check would cost a host sync, the kernel clamps it to [0, L] so it never reads outside the
cache, and a query that sees no key outputs zeros (the reference does the same).
"""
import torch
import torch.nn.functional as F
from torch import Tensor

from csrc_free_ops import decode_attention as kernels

from .attention import check_heads, grouped_output, grouped_scores
from .checks import check_index, fail
from .registry import acc_dtype, define, to_dtype

MAX_DECODE_ROWS = 128
"""decode_attention handles Tq * (Hq / Hk) <= 128 query rows per kv head: a few tokens, not a prefill."""


def decode_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, scale: float) -> Tensor:
    """softmax(scale q k^T + mask) v over each sequence's cache[b, :cache_seqlens[b]], query t at
    position cache_seqlens[b] - Tq + t seeing the slots up to its own. Lengths are clamped to
    [0, L] as the kernel does; a query that sees no key gives zeros. Whatever a slot past a
    sequence's length holds (NaN included) cannot reach the output: its scores are replaced by
    -inf and its values by 0 (0 * NaN would be NaN). On the CPU only the slots some sequence
    holds are read, and where every query sees all of them (held_slots) there is no mask: one
    F.scaled_dot_product_attention call over the grouped heads."""
    tq, dt = q.shape[1], acc_dtype(q)
    seqlens = cache_seqlens.clamp(0, k_cache.shape[1])
    shortest, n = held_slots(seqlens, k_cache.shape[1])
    keys, values = (to_dtype(c[:, :n], dt).transpose(1, 2) for c in (k_cache, v_cache))  # [B, Hk, n, D]
    if shortest - tq + 1 >= n:  # the first query of the shortest sequence sees all n slots: so does every query
        o = F.scaled_dot_product_attention(to_dtype(q, dt).transpose(1, 2), keys, values, scale=scale, enable_gqa=True)
        return to_dtype(o.transpose(1, 2), q.dtype).contiguous()
    s = grouped_scores(q, keys, scale)  # [B, Hk, G, Tq, n]
    slots = torch.arange(n, device=q.device)
    if shortest < n:  # a sequence ends before slot n
        values = values.where(slots[:, None] < seqlens[:, None, None, None], 0.0)
    positions = seqlens[:, None] - tq + torch.arange(tq, device=q.device)  # [B, Tq]
    unseen = slots > positions[:, None, None, :, None]  # [B, 1, 1, Tq, n]; includes every slot past the length
    p = torch.softmax(s.masked_fill(unseen, float("-inf")), dim=-1).masked_fill(unseen.all(-1, keepdim=True), 0.0)
    return grouped_output(p, values, q.dtype)


def held_slots(seqlens: Tensor, cache_len: int) -> tuple[int, int]:
    """(slots every sequence holds, slots some sequence holds): the shortest and the longest
    length on the CPU, where reading them is free; (0, L) elsewhere, where it would cost a host sync."""
    if seqlens.device.type != "cpu":
        return 0, cache_len
    lengths = seqlens.tolist()
    return (min(lengths), max(lengths)) if lengths else (0, 0)


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
    lengths = cache_seqlens.tolist()
    if lengths:
        lo, hi = min(lengths), max(lengths)
        if lo < tq or hi > cache_len:
            fail("decode_attention", f"cache_seqlens must lie in [Tq={tq}, L={cache_len}] (the new tokens are "
                                     f"already stored, the cache holds L), got values in [{lo}, {hi}]")


decode_attention = define(
    decode_attention_reference, kernels.decode_attention,
    check=lambda q, k_cache, v_cache, cache_seqlens, scale: _check_decode(q, k_cache, v_cache, cache_seqlens),
    fake=lambda q, *args: q.new_empty(q.shape),
    check_values=lambda q, k_cache, v_cache, cache_seqlens, scale: _check_seqlens(cache_seqlens, q.shape[1],
                                                                                  k_cache.shape[1]))
