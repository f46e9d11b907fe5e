"""qwen::kv_cache_store_slots and qwen::paged_attention: a paged KV cache's write and attention.

The cache layout (fixed):
- per attention layer, k_cache and v_cache: [num_blocks, block_size, Hk, D], contiguous,
  block_size a power of two >= 16 (the engine picks it; kernels take any such);
- a token's KV slot is block_id * block_size + offset_in_block (= its row in the
  [num_blocks * block_size, Hk, D] view);
- a sequence's block table: block_table [num_seqs, max_blocks_per_seq] int32, entry j the block
  holding its positions [j * block_size, (j + 1) * block_size); entries past the sequence's
  length are unused (may be anything, e.g. 0 or -1: never read);
- seq_lens [num_seqs] int32: the number of cached positions of each sequence INCLUDING this
  step's new tokens (their KV is written before attention runs).

kv_cache_store_slots(k, v, k_cache, v_cache, slot_mapping): k, v [N, Hk, D] (last dim
    contiguous, e.g. views of a fused qkv output), slot_mapping [N] int32/int64:
    k_cache.view(-1, Hk, D)[slot_mapping[i]] = k[i], v likewise; mutates the two caches. A slot
    < 0 or >= num_blocks * block_size is not written (padding tokens pass -1), on every device.
paged_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, max_query_len):
    q [N, Hq, D] packs the new tokens of every sequence, sequence i's at rows
    cu_seqlens_q[i]:cu_seqlens_q[i + 1] (cu_seqlens_q [num_seqs + 1] int32); query t of sequence
    i (qlen_i = cu[i + 1] - cu[i]) sits at position seq_lens[i] - qlen_i + t and attends causally
    to the cached positions 0..position; GQA (kv head = q head // (Hq / Hk)) -> o [N, Hq, D].
    max_query_len, a host int >= every qlen_i, sizes the grid.

The values must satisfy, and on CPU tensors are checked to (free there; on CUDA a check would
cost a host sync, so the kernel clamps instead and never reads or writes outside its tensors):
cu_seqlens_q non-decreasing from 0 to N; every qlen_i <= max_query_len; seq_lens[i] 0 (a padding
sequence: its rows output zeros) or in [qlen_i, max_blocks_per_seq * block_size]; the block table
entries a sequence reads in [0, num_blocks). A query that sees no key outputs zeros.
"""
import math

import torch
from torch import Tensor

from csrc_free_ops import paged_attention as kernels

from .checks import check_float, check_head_dim, check_index, check_same, fail
from .registry import acc_dtype, define


def kv_cache_store_slots_reference(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                                   slot_mapping: Tensor) -> None:
    slots = slot_mapping.long()
    keep = (slots >= 0) & (slots < k_cache.shape[0] * k_cache.shape[1])
    k_cache.flatten(0, 1)[slots[keep]] = k[keep]  # the [num_blocks * block_size, Hk, D] views
    v_cache.flatten(0, 1)[slots[keep]] = v[keep]


REFERENCE_CHUNK = 1 << 24
"""Elements of the gathered keys (tokens x visible positions x heads x head_dim) the reference
takes at a time: it runs over the tokens in chunks that keep its memory bounded."""


def paged_attention_reference(q: Tensor, k_cache: Tensor, v_cache: Tensor, cu_seqlens_q: Tensor, seq_lens: Tensor,
                              block_table: Tensor, scale: float, max_query_len: int) -> Tensor:
    """Every token's cached positions gathered through its sequence's block table, causal
    softmax in fp32 (float64 for float64 q), all sequences at once, in chunks of tokens
    (``REFERENCE_CHUNK``). seq_lens are clamped to the table's reach as the kernel does; a query
    that sees no key gives zeros. max_query_len only sizes the kernel's grid."""
    num_blocks, block_size, hk, d = k_cache.shape
    n, hq = q.shape[0], q.shape[1]
    dt = acc_dtype(q)
    o = torch.zeros(q.shape, dtype=dt, device=q.device)
    lens = seq_lens.long().clamp(0, block_table.shape[1] * block_size)
    if o.numel() == 0 or lens.numel() == 0 or int(lens.max()) == 0:
        return o.to(q.dtype)
    cu = cu_seqlens_q.long()
    qlens = cu[1:] - cu[:-1]
    owner = torch.repeat_interleave(torch.arange(lens.shape[0], device=q.device), qlens)  # each token's sequence
    q_pos = lens[owner] - qlens[owner] + torch.arange(n, device=q.device) - cu[owner]
    pos = torch.arange(int(lens.max()), device=q.device)
    slots = block_table[:, pos // block_size].long().clamp(0, num_blocks - 1) * block_size + pos % block_size
    keys, values = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # [num_blocks * block_size, Hk, D]
    step = max(1, REFERENCE_CHUNK // (pos.numel() * hk * d))
    for start in range(0, n, step):
        rows = slice(start, start + step)
        seq = owner[rows]
        cached = pos[None, :] < lens[seq, None]  # [t, L]: the gather's other rows hold anything, NaN too
        k = keys[slots[seq]].to(dt).masked_fill(~cached[..., None, None], 0.0)  # [t, L, Hk, D]
        v = values[slots[seq]].to(dt).masked_fill(~cached[..., None, None], 0.0)
        qg = q[rows].to(dt).view(-1, hk, hq // hk, d)  # [t, Hk, G, D]: a kv head's query heads together
        s = torch.einsum("tkgd,tlkd->tkgl", qg, k) * scale
        keep = cached & (pos[None, :] <= q_pos[rows, None])
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        p = torch.where(keep.any(-1)[:, None, None, None], torch.softmax(s, dim=-1), 0.0)
        o[rows] = torch.einsum("tkgl,tlkd->tkgd", p, v).reshape(-1, hq, d)
    return o.to(q.dtype)


def _check_cache(op: str, ref_name: str, ref: Tensor, k_cache: Tensor, v_cache: Tensor):
    """k_cache, v_cache: contiguous [num_blocks, block_size, Hk, D] of ref's dtype and device, block_size a
    power of two >= 16."""
    check_float(op, "k_cache", k_cache, ndim=4)
    check_float(op, "v_cache", v_cache, ndim=4)
    check_same(op, ref_name, ref, k_cache=k_cache, v_cache=v_cache)
    if k_cache.shape != v_cache.shape:
        fail(op, f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must have the same shape")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not c.is_contiguous():
            fail(op, f"{name} must be contiguous [num_blocks, block_size, Hk, D], got strides {c.stride()}")
    block_size = k_cache.shape[1]
    if block_size < 16 or block_size & (block_size - 1):
        fail(op, f"block_size (k_cache.shape[1]) must be a power of two >= 16, got {block_size}")


def _check_store(k, v, k_cache, v_cache, slot_mapping):
    op = "kv_cache_store_slots"
    check_float(op, "k", k, ndim=3)
    check_float(op, "v", v, ndim=3)
    _check_cache(op, "k", k, k_cache, v_cache)
    check_same(op, "k", k, v=v)
    if k.shape != v.shape:
        fail(op, f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if k.shape[1:] != k_cache.shape[2:]:
        fail(op, f"k {tuple(k.shape)} does not match k_cache {tuple(k_cache.shape)} in heads or head_dim")
    check_index(op, "slot_mapping", slot_mapping, (k.shape[0],))
    if slot_mapping.device != k.device:
        fail(op, f"slot_mapping is on {slot_mapping.device} but k is on {k.device}")


def _check_attention(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, max_query_len):
    op = "paged_attention"
    check_float(op, "q", q, ndim=3)
    _check_cache(op, "q", q, k_cache, v_cache)
    hq, d = q.shape[1], q.shape[2]
    hk = k_cache.shape[2]
    if k_cache.shape[3] != d:
        fail(op, f"q has head_dim {d} but k_cache has {k_cache.shape[3]}")
    check_head_dim(op, d)
    if hk == 0 or hq % hk:
        fail(op, f"q heads ({hq}) must be a multiple of kv heads ({hk})")
    if seq_lens.dim() != 1 or block_table.dim() != 2:
        fail(op, f"seq_lens must be [num_seqs] and block_table [num_seqs, max_blocks_per_seq], got shapes "
                 f"{tuple(seq_lens.shape)} and {tuple(block_table.shape)}")
    num_seqs = seq_lens.shape[0]
    check_index(op, "seq_lens", seq_lens, (num_seqs,))
    check_index(op, "cu_seqlens_q", cu_seqlens_q, (num_seqs + 1,))
    check_index(op, "block_table", block_table, (num_seqs, block_table.shape[1]))
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.device != q.device:
            fail(op, f"{name} is on {t.device} but q is on {q.device}")
    if not 0.0 < scale < math.inf:
        fail(op, f"scale must be a positive finite number, got {scale}")
    if max_query_len < 0:
        fail(op, f"max_query_len must be >= 0, got {max_query_len}")


def _check_values(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, max_query_len):
    """Value checks, CPU tensors only (free there; a host sync on CUDA, where the kernel clamps instead)."""
    op = "paged_attention"
    cu = cu_seqlens_q.long()
    qlens = cu[1:] - cu[:-1]
    if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or (qlens < 0).any():
        fail(op, f"cu_seqlens_q must rise from 0 to N={q.shape[0]} (q's rows), got {cu.tolist()}")
    if qlens.numel() and int(qlens.max()) > max_query_len:
        fail(op, f"a sequence has {int(qlens.max())} new tokens, more than max_query_len={max_query_len}")
    block_size = k_cache.shape[1]
    lens = seq_lens.long()
    reach = block_table.shape[1] * block_size
    bad = (lens != 0) & ((lens < qlens) | (lens > reach))
    if bad.any():
        i = int(bad.nonzero()[0])
        fail(op, f"seq_lens[{i}]={int(lens[i])} must be 0 (padding) or lie in [qlen={int(qlens[i])}, "
                 f"{reach}] (the new tokens are already stored; the block table reaches {reach} positions)")
    used = torch.arange(block_table.shape[1])[None, :] < (lens[:, None] + block_size - 1) // block_size
    ids = block_table.long()[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= k_cache.shape[0]):
        fail(op, f"block_table entries a sequence reads must lie in [0, num_blocks={k_cache.shape[0]}), "
                 f"got values in [{int(ids.min())}, {int(ids.max())}]")


kv_cache_store_slots = define(kv_cache_store_slots_reference, kernels.kv_cache_store_slots, check=_check_store,
                              fake=lambda *args: None, mutates_args=("k_cache", "v_cache"))

paged_attention = define(paged_attention_reference, kernels.paged_attention, check=_check_attention,
                         fake=lambda q, *args: q.new_empty(q.shape), check_values=_check_values)
