"""Flash attention for prefill, with GQA and an optional KV prefix: the launchers, forward and
backward, and their tiles. The kernels, with their math: attention_forward_kernel.py (the online
softmax) and attention_backward_kernels.py (FlashAttention-2 style).

q [B, Sq, Hq, D], k/v [B, Sk, Hk, D] (any strides, last dim contiguous) -> o [B, Sq, Hq, D]:

    o[b, i, h] = softmax(scale * q[b, i, h] . k[b, :, h // (Hq/Hk)]) @ v[b, :, h // (Hq/Hk)]

With `causal`, query i sits at position Sk - Sq + i and sees keys 0..Sk-Sq+i, so
Sk > Sq attends over a cached prefix (chunked prefill / prompt continuation).
D is any multiple of 16 up to 256: every kernel holds a head in a `head_block(D)` block,
masked past D (`head_mask`, which compiles to nothing at powers of two).

The forward can also return lse [B, Hq, Sq] fp32, the natural-log log-sum-exp of the scaled
scores (`attention_with_lse`), which the backward needs.

Backward (`attention_backward`), same layouts (dO like q) -> dq, dk, dv, contiguous, in the input
dtype. Nothing of size Sq x Sk is stored:

1. lse, when the forward did not keep it: the forward kernel run for the row
   statistics only (`attention_with_lse(..., write_o=False)`).
2. preprocess (`bwd_delta`): delta = rowsum(dO * O) (minus dlse when lse itself gets a gradient),
   grid (cdiv(Sq, BLOCK), B*Hq).
3. dK/dV (`dkdv_backward`), grid (B*Hk, cdiv(Sk, BLOCK_N)): a program owns one key block of one
   kv head and walks the query blocks of its GQA group's heads that see it.
4. dQ (`dq_backward`), grid (B*Hq, cdiv(Sq, BLOCK_M)): a program owns one query block and walks
   the key blocks it sees.

Launch order, forward and backward: heads vary fastest (grid axis 0) and, in causal attention,
the blocks with the most work start first (the last query blocks for the forward and dQ, the
first key blocks for dK/dV), so the short programs fill the tail of the launch.

Tiles: the forward's `Tiles(block_m, block_n, num_warps, num_stages)` from `forward_tiles`
(head_dim, query length, dtype) or `attention(..., tiles=)`; the backward's `BwdBlocks`, one
`Tiles` per kernel, chosen by `backward_blocks` from head_dim and dtype or passed as
`attention_backward(..., blocks=)`. `python -m bench.ops --sweep-attn-fwd` / `--sweep-attn-bwd`
time candidates against SDPA.
"""
from typing import NamedTuple

import torch

from .attention_backward_kernels import _bwd_dkdv_kernel, _bwd_dq_kernel, _bwd_preprocess_kernel
from .attention_forward_kernel import _attention_kernel
from .common import (INTERPRET, LOG2E, cdiv, next_power_of_2, pdl_options, shared_memory_per_block, softmax_headroom,
                     tuned)


def forward_tiles(d: int, sq: int, itemsize: int, shared_memory: "int | None" = None,
                  stored: "tuple | None" = None) -> "Tiles":
    """The forward's tiles: `stored` (the device's table attention_forward, by the head dim's block),
    else 64 query rows against 64 keys, 4 warps, 3 stages (128 keys for head blocks of 64; 32 keys
    and 2 stages below 64). BLOCK_M shrunk for short queries and halved for fp32 (twice the bytes
    per tile); with `shared_memory` (bytes per block), fewer stages and then narrower key blocks
    until the q tile and `num_stages` k and v tiles fit (head_dim 256 needs 224 KB at 3 stages,
    which Hopper has and most other GPUs do not). A head dim that is not a power of two takes the
    tiles of its block, which is what the kernel holds."""
    d = next_power_of_2(d)
    if stored is not None:
        bm, bn, warps, stages = stored
    else:
        bm, bn, warps, stages = (64, 128, 4, 3) if d == 64 else (64, 64, 4, 3) if d > 64 else (64, 32, 4, 2)
    if itemsize == 4:
        bm, stages = bm // 2, 2
    bm = min(bm, max(16, next_power_of_2(sq)))
    if shared_memory is not None:
        def footprint():
            return (bm + 2 * stages * bn) * d * itemsize
        while stages > 2 and footprint() > shared_memory:
            stages -= 1
        while bn > 16 and footprint() > shared_memory:
            bn //= 2
    return Tiles(bm, bn, warps, stages)


def attention_with_lse(q, k, v, scale: float, causal: bool, write_o: bool = True, tiles: "Tiles | None" = None):
    """-> (o [B, Sq, Hq, D] or None without write_o, lse [B, Hq, Sq] fp32 natural log).
    write_o=False recomputes only the softmax statistics (the backward of plain attention).
    `tiles` overrides `forward_tiles` (benchmarks, tests)."""
    bsz, sq, hq, d = q.shape
    o = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device) if write_o else None
    lse = torch.empty((bsz, hq, sq), dtype=torch.float32, device=q.device)
    if bsz * sq * hq > 0:
        _launch(q, k, v, o, lse, scale, causal, tiles)
    return o, lse


def attention(q, k, v, scale: float, causal: bool, tiles: "Tiles | None" = None) -> torch.Tensor:
    bsz, sq, hq, d = q.shape
    o = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device)
    if bsz * sq * hq > 0:
        _launch(q, k, v, o, None, scale, causal, tiles)
    return o


def _launch(q, k, v, o, lse, scale, causal, tiles):
    bsz, sq, hq, d = q.shape
    hk = k.shape[2]
    ot = o if o is not None else q  # a placeholder pointer when o is not written
    if tiles is not None:
        _check_tiles(tiles)
    bm, bn, warps, stages = tiles or forward_tiles(
        d, sq, q.element_size(), shared_memory_per_block(q.device) if q.is_cuda else None,
        tuned("attention_forward", q.device, q.dtype, (next_power_of_2(d),)))
    headroom = softmax_headroom(v.dtype)
    _attention_kernel[(bsz * hq, cdiv(sq, bm))](
        q, k, v, ot, lse if lse is not None else q,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), ot.stride(0), ot.stride(1), ot.stride(2),
        sq, k.shape[1], hq, hq // hk, scale * LOG2E,
        CAUSAL=causal, WRITE_O=o is not None, WRITE_LSE=lse is not None,
        D=d, BLOCK_M=bm, BLOCK_N=bn, HEADROOM=headroom, P_SCALE=2.0 ** -headroom, num_warps=warps, num_stages=stages,
        **pdl_options(q),
    )


class Tiles(NamedTuple):
    """One kernel's launch: steps of BLOCK_M queries x BLOCK_N keys (the forward and dQ own a
    query block and walk key blocks, dK/dV the reverse). The blocks need not divide each other."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


class BwdBlocks(NamedTuple):
    dkdv: Tiles
    dq: Tiles


def _check_tiles(t: Tiles):
    """tl.arange needs powers of two, tl.dot at least 16 rows/columns."""
    for name, x in (("block_m", t.block_m), ("block_n", t.block_n), ("num_warps", t.num_warps)):
        assert x > 0 and x & (x - 1) == 0, f"{name}={x} must be a power of two"
    assert t.block_m >= 16 and t.block_n >= 16, f"blocks {t.block_m}x{t.block_n}: tl.dot needs at least 16"
    assert t.num_stages >= 1, f"num_stages={t.num_stages}"


def backward_blocks(d: int, itemsize: int) -> BwdBlocks:
    """Default tiles per head_dim. bf16/fp16 at head_dim 64 and 128: the fastest of
    `python -m bench.ops --sweep-attn-bwd` (B=4, S=2048, causal; docs/performance.md, attention),
    well ahead of the earlier (32, 64, 8, 2) / (64, 64, 8, 2) tiles. fp32 (ieee dots) needs much smaller tiles. The
    thresholds are powers of two, so a head dim takes its block's tiles (80 and 96 those of 128)."""
    if INTERPRET:
        t = Tiles(32, 32, 4, 1)
        return BwdBlocks(t, t)
    if itemsize == 4:
        t = Tiles(32, 32, 8, 1) if d <= 64 else Tiles(16, 16, 4, 1)
        return BwdBlocks(t, t)
    if d <= 64:
        return BwdBlocks(Tiles(64, 64, 4, 3), Tiles(64, 64, 4, 3))
    if d <= 128:
        return BwdBlocks(Tiles(32, 64, 4, 3), Tiles(128, 64, 8, 3))
    t = Tiles(32, 32, 8, 1)
    return BwdBlocks(t, t)


def _qstrides(t):
    return t.stride(0), t.stride(1), t.stride(2)


def bwd_delta(o, do, dlse=None):
    """delta [B, Hq, Sq] fp32 = rowsum(dO * O) - dlse."""
    bsz, sq, hq, d = o.shape
    delta = torch.empty((bsz, hq, sq), dtype=torch.float32, device=o.device)
    block = max(16, 4096 // next_power_of_2(d))
    _bwd_preprocess_kernel[(cdiv(sq, block), bsz * hq)](
        o, do, dlse if dlse is not None else o, delta, *_qstrides(o), *_qstrides(do),
        sq, hq, HAS_DLSE=dlse is not None, D=d, BLOCK_M=block, num_warps=4,
    )
    return delta


def dkdv_backward(do, q, k, v, lse, delta, dk, dv, scale: float, causal: bool, tiles: Tiles):
    """Writes dk, dv (contiguous [B, Sk, Hk, D]); returns the launched kernel (its n_regs, n_spills
    and metadata.shared are what the tile sweep reports)."""
    _check_tiles(tiles)
    bsz, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    return _bwd_dkdv_kernel[(bsz * hk, cdiv(sk, tiles.block_n))](
        q, k, v, do, lse, delta, dk, dv, *_qstrides(q), *_qstrides(k), *_qstrides(v), *_qstrides(do),
        sq, sk, hq, hk, hq // hk, scale * LOG2E, scale,
        CAUSAL=causal, D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def dq_backward(do, q, k, v, lse, delta, dq, scale: float, causal: bool, tiles: Tiles):
    """Writes dq (contiguous [B, Sq, Hq, D]); returns the launched kernel, as dkdv_backward."""
    _check_tiles(tiles)
    bsz, sq, hq, d = q.shape
    return _bwd_dq_kernel[(bsz * hq, cdiv(sq, tiles.block_m))](
        q, k, v, do, lse, delta, dq, *_qstrides(q), *_qstrides(k), *_qstrides(v), *_qstrides(do),
        sq, k.shape[1], hq, hq // k.shape[2], scale * LOG2E, scale,
        CAUSAL=causal, D=d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )


def attention_backward(do, q, k, v, o, lse, scale: float, causal: bool, dlse=None, blocks: BwdBlocks | None = None):
    """Gradients of o = attention(q, k, v): (dq, dk, dv), contiguous, input dtype. lse: the forward's
    [B, Hq, Sq] fp32 (natural log), or None to recompute it; dlse: a gradient reaching lse, or None;
    blocks: the kernels' tiles instead of `backward_blocks`'s."""
    bsz, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    dq = torch.empty((bsz, sq, hq, d), dtype=q.dtype, device=q.device)
    dk = torch.empty((bsz, sk, hk, d), dtype=k.dtype, device=k.device)
    dv = torch.empty((bsz, sk, hk, d), dtype=v.dtype, device=v.device)
    if bsz == 0 or sk == 0:
        return dq, dk, dv
    if sq * hq == 0:  # no query sees the keys: their gradients are zero
        return dq, dk.zero_(), dv.zero_()
    if lse is None:
        _, lse = attention_with_lse(q, k, v, scale, causal, write_o=False)
    delta = bwd_delta(o, do, dlse)
    blocks = blocks or backward_blocks(d, q.element_size())
    dkdv_backward(do, q, k, v, lse, delta, dk, dv, scale, causal, blocks.dkdv)
    dq_backward(do, q, k, v, lse, delta, dq, scale, causal, blocks.dq)
    return dq, dk, dv
