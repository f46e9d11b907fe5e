"""qwen::kv_cache_store: k_cache[b, positions[b, t]] = k[b, t], v_cache likewise; mutates the two caches.

k, v [B, T, Hk, D]; k_cache, v_cache [B, L, Hk, D]; positions [B, T] int32/int64 in [0, L).
On CPU tensors a position outside [0, L) raises; on CUDA checking would cost a host
sync per call, so the kernel instead drops such writes (it never stores out of
bounds) and callers (modeling's generator) check lengths on the host.
"""
import torch
from torch import Tensor

from csrc_free_ops import kv_cache as kernels

from .checks import check_float, check_index, check_same, fail
from .registry import define


def kv_cache_store_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, positions: Tensor) -> None:
    batch, slots = torch.arange(k.shape[0], device=k.device)[:, None], positions.long()  # [B, 1], [B, T]
    k_cache[batch, slots] = k
    v_cache[batch, slots] = v


def _check(k, v, k_cache, v_cache, positions):
    op = "kv_cache_store"
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(op, name, t, ndim=4)
    check_same(op, "k_cache", k_cache, k=k, v=v, v_cache=v_cache)
    if k.shape != v.shape:
        fail(op, f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k_cache.shape != v_cache.shape:
        fail(op, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape")
    bsz, t, hk, d = k.shape
    if (k_cache.shape[0], k_cache.shape[2], k_cache.shape[3]) != (bsz, hk, d):
        fail(op, f"k_cache {tuple(k_cache.shape)} does not match k {tuple(k.shape)} in batch, heads or head_dim")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.numel() and c.shape[2] > 1 and c.stride(2) != d:  # the kernel steps heads by D
            fail(op, f"{name} must be contiguous over [Hk, D], got strides {c.stride()}")
    if t > k_cache.shape[1]:
        fail(op, f"{t} tokens do not fit a cache of length {k_cache.shape[1]}")
    check_index(op, "positions", positions, (bsz, t))
    if positions.device != k.device:
        fail(op, f"positions is on {positions.device} but k is on {k.device}")


def _check_positions(positions: Tensor, cache_len: int):
    """Value check, CPU tensors only (free there; a device sync on CUDA)."""
    if positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cache_len:
            fail("kv_cache_store", f"positions must lie in [0, {cache_len}) (cache length), got [{lo}, {hi}]")


kv_cache_store = define(kv_cache_store_reference, kernels.kv_cache_store, check=_check, fake=lambda *args: None,
                        mutates_args=("k_cache", "v_cache"),
                        check_values=lambda k, v, k_cache, v_cache, positions: _check_positions(positions,
                                                                                                k_cache.shape[1]))
