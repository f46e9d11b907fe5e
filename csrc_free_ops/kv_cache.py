"""KV-cache write: k_cache[b, positions[b, t]] = k[b, t] (and the same for v).

k, v [B, T, Hk, D] (any strides with the last dim contiguous, e.g. slices of a
fused QKV output); caches [B, L, Hk, D] contiguous. Grid: (B*T,), one program
copies the Hk*D values of one token for both k and v. A position outside
[0, L) is not written: the kernel never stores out of bounds.
"""
import triton.language as tl

from .common import kernel, next_power_of_2, pdl_launch_dependents, pdl_options, pdl_wait


@kernel
def _kv_cache_store_kernel(
    k_ptr, v_ptr, kc_ptr, vc_ptr, pos_ptr,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_vcb, stride_vct, stride_pb, stride_pt,
    T, L, HK,
    D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    pdl_wait(USE_PDL)
    pos = tl.load(pos_ptr + b * stride_pb + t * stride_pt).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)  # D rounded up to a power of two, masked past D
    heads_to_write = tl.where((pos >= 0) & (pos < L), HK, 0)
    mask = (heads[:, None] < heads_to_write) & (d[None, :] < D)
    head_off = heads[:, None] * D + d[None, :]
    k = tl.load(k_ptr + b * stride_kb + t * stride_kt + heads[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + b * stride_vb + t * stride_vt + heads[:, None] * stride_vh + d[None, :], mask=mask)
    pdl_launch_dependents(USE_PDL)
    tl.store(kc_ptr + b * stride_kcb + pos * stride_kct + head_off, k, mask=mask)
    tl.store(vc_ptr + b * stride_vcb + pos * stride_vct + head_off, v, mask=mask)


def kv_cache_store(k, v, k_cache, v_cache, positions) -> None:
    """Writes into the caches in place; k, v, k_cache, v_cache may each have their own strides."""
    bsz, t, hk, d = k.shape
    if bsz * t * hk * d == 0:
        return
    _kv_cache_store_kernel[(bsz * t,)](
        k, v, k_cache, v_cache, positions,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        positions.stride(0), positions.stride(1),
        t, k_cache.shape[1], hk,
        D=d, BLOCK_H=next_power_of_2(hk), BLOCK_D=next_power_of_2(d), num_warps=4, **pdl_options(k),
    )
