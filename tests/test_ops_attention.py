import math

import pytest
import torch

import qwen_ops  # noqa: F401
from qwen_ops import attention_reference, decode_attention_reference, kv_cache_store_reference
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

# (batch, Sq, Sk, q heads, kv heads, head_dim)
PREFILL = {
    "cpu": [(1, 1, 1, 2, 1, 16), (2, 7, 7, 4, 2, 32), (1, 20, 33, 2, 2, 64), (1, 5, 5, 2, 1, 256), (1, 70, 100, 2, 1, 16)],
    "cuda": [(1, 255, 255, 16, 8, 128), (1, 256, 256, 14, 2, 64), (2, 1000, 1000, 8, 2, 256),
             (4, 7, 7, 16, 8, 128), (1, 1, 1, 8, 2, 128), (1, 2048, 2048, 16, 8, 128), (2, 100, 612, 16, 8, 128)],
}
# (batch, Tq, cache length, q heads, kv heads, head_dim)
DECODE = {
    "cpu": [(1, 1, 40, 4, 2, 32), (3, 2, 70, 4, 4, 16), (2, 1, 20, 2, 1, 256)],
    "cuda": [(1, 1, 4096, 16, 8, 128), (4, 1, 1000, 14, 2, 64), (2, 1, 2048, 8, 2, 256), (3, 4, 777, 16, 8, 128)],
}


def _qkv(b, sq, sk, hq, hk, d, dtype, device):
    return (randn(b, sq, hq, d, dtype=dtype, device=device), randn(b, sk, hk, d, dtype=dtype, device=device),
            randn(b, sk, hk, d, dtype=dtype, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_matches_reference(device, dtype, causal):
    for b, sq, sk, hq, hk, d in PREFILL[device]:
        q, k, v = _qkv(b, sq, sk, hq, hk, d, dtype, device)
        poison_allocator(device)
        out = torch.ops.qwen.attention(q, k, v, d ** -0.5, causal)
        assert_close(out, attention_reference(q, k, v, d ** -0.5, causal),
                     what=f"attention b{b} sq{sq} sk{sk} hq{hq} hk{hk} d{d} causal={causal}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", [(16, 32, 4, 1), (32, 16, 2, 2), (64, 64, 4, 1)], ids=str)
def test_attention_forward_tiles(device, tiles):
    """Any forward tile shape (query blocks wider or narrower than key blocks, neither dividing the
    lengths) gives the reference's result, causal with a cached prefix (Sk > Sq) and not."""
    from csrc_free_ops import attention as attention_kernels

    b, sq, sk, hq, hk, d = (1, 37, 53, 4, 2, 32) if device == "cpu" else (2, 300, 421, 16, 8, 128)
    q, k, v = _qkv(b, sq, sk, hq, hk, d, torch.bfloat16, device)
    t = attention_kernels.Tiles(*tiles)
    for causal in (True, False):
        assert_close(attention_kernels.attention(q, k, v, d ** -0.5, causal, tiles=t),
                     attention_reference(q, k, v, d ** -0.5, causal), what=f"tiles {tiles} causal={causal}")


def test_attention_forward_tiles_fit_shared_memory():
    """forward_tiles trades stages, then key-block width, for shared memory: the stored head_dim 256
    tiles need 224 KB, which an H200 gives a block; an A100 (163 KB) and a consumer GPU (99 KB) get
    tiles that fit (their footprint, q + stages * (k + v), within the limit)."""
    from csrc_free_ops.attention import FWD_TILES, Tiles, forward_tiles

    def footprint(t, d, itemsize=2):
        return (t.block_m + 2 * t.num_stages * t.block_n) * d * itemsize

    assert forward_tiles(256, 2048, 2, 232448) == Tiles(*FWD_TILES[256]) == forward_tiles(256, 2048, 2)
    for limit in (166912, 101376):
        for d in (64, 128, 256):
            t = forward_tiles(d, 2048, 2, limit)
            assert footprint(t, d) <= limit and t.num_stages >= 2 and t.block_n >= 16, (d, limit, t)
    assert forward_tiles(256, 2048, 2, 166912) == Tiles(64, 64, 4, 2)
    assert forward_tiles(256, 2048, 2, 101376) == Tiles(64, 32, 4, 2)


def test_shared_memory_per_block_reads_what_the_build_has(monkeypatch):
    """The opt-in limit where the properties have it (CUDA), the default per-block limit where they
    do not (ROCm builds), None where neither is known: launchers then keep their stored tiles."""
    from types import SimpleNamespace

    from csrc_free_ops import common

    for props, expected in ((SimpleNamespace(shared_memory_per_block_optin=232448, shared_memory_per_block=49152), 232448),
                            (SimpleNamespace(shared_memory_per_block=65536), 65536), (SimpleNamespace(), None)):
        monkeypatch.setattr(common, "cuda_properties", lambda device, p=props: p)
        assert common.shared_memory_per_block(torch.device("cuda")) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_attention_strided_qkv_views(device):
    """q/k/v sliced out of one fused QKV activation, as the model passes them."""
    b, s, hq, hk, d = 2, 9, 4, 2, 32
    qkv = randn(b, s, (hq + 2 * hk) * d, dtype=torch.float32, device=device)
    q = qkv[..., : hq * d].view(b, s, hq, d)
    k = qkv[..., hq * d : (hq + hk) * d].view(b, s, hk, d)
    v = qkv[..., (hq + hk) * d :].view(b, s, hk, d)
    assert_close(torch.ops.qwen.attention(q, k, v, 0.3), attention_reference(q, k, v, 0.3), what="strided attention")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention_matches_reference(device, dtype):
    for b, tq, cache_len, hq, hk, d in DECODE[device]:
        q = randn(b, tq, hq, d, dtype=dtype, device=device)
        k_cache = randn(b, cache_len, hk, d, dtype=dtype, device=device)
        v_cache = randn(b, cache_len, hk, d, dtype=dtype, device=device)
        # Ragged lengths: one sequence just long enough, one full, the rest random.
        seqlens = torch.randint(tq, cache_len + 1, (b,), device=device, dtype=torch.int32)
        seqlens[0] = tq
        seqlens[-1] = cache_len
        poison_allocator(device)
        out = torch.ops.qwen.decode_attention(q, k_cache, v_cache, seqlens, d ** -0.5)
        ref = decode_attention_reference(q, k_cache, v_cache, seqlens, d ** -0.5)
        assert_close(out, ref, what=f"decode_attention b{b} tq{tq} L{cache_len} hq{hq} hk{hk} d{d} lens {seqlens.tolist()}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_equals_prefill_on_last_rows(device):
    """Decode over a cache holding a whole prompt = the last rows of causal prefill attention."""
    b, s, tq, hq, hk, d = 1, 21, 3, 4, 2, 32
    q, k, v = _qkv(b, s, s, hq, hk, d, torch.float32, device)
    k_cache = torch.zeros(b, 40, hk, d, device=device)
    v_cache = torch.zeros(b, 40, hk, d, device=device)
    positions = torch.arange(s, device=device)[None]
    torch.ops.qwen.kv_cache_store(k, v, k_cache, v_cache, positions)
    seqlens = torch.full((b,), s, dtype=torch.int32, device=device)
    out = torch.ops.qwen.decode_attention(q[:, -tq:], k_cache, v_cache, seqlens, d ** -0.5)
    assert_close(out, attention_reference(q, k, v, d ** -0.5)[:, -tq:], what="decode vs prefill rows")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_store_matches_reference(device, dtype):
    b, t, cache_len, hk, d = (2, 5, 30, 2, 32) if device == "cpu" else (4, 255, 4096, 8, 128)
    kv = randn(b, t, 2 * hk * d, dtype=dtype, device=device)  # k and v as views of one activation
    k, v = kv[..., : hk * d].view(b, t, hk, d), kv[..., hk * d :].view(b, t, hk, d)
    positions = torch.stack([torch.randperm(cache_len, device=device)[:t] for _ in range(b)])
    k_cache = torch.full((b, cache_len, hk, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    torch.ops.qwen.kv_cache_store(k, v, k_cache, v_cache, positions)
    kv_cache_store_reference(k, v, k_ref, v_ref, positions)
    assert torch.equal(k_cache.nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_cache.nan_to_num(7.0), v_ref.nan_to_num(7.0))
    assert not torch.isnan(k_cache[torch.arange(b, device=device)[:, None], positions]).any()


@pytest.mark.cuda
def test_kv_cache_store_drops_out_of_range_positions_on_cuda():
    k = torch.randn(1, 2, 2, 64, device="cuda")
    k_cache = torch.zeros(1, 8, 2, 64, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    torch.ops.qwen.kv_cache_store(k, k, k_cache, v_cache, torch.tensor([[3, 8]], device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(k_cache[0, 3], k[0, 0]) and k_cache.abs().sum() == k[0, 0].abs().sum()


@pytest.mark.parametrize("device", DEVICES)
def test_attention_scale_is_applied(device):
    """Each scale matches the reference at that scale, and the two differ (a kernel ignoring the
    argument would match at most one)."""
    q, k, v = _qkv(1, 4, 4, 2, 1, 16, torch.float32, device)
    outs = []
    for scale in (0.1, 1.0 / math.sqrt(2.0)):
        outs.append(torch.ops.qwen.attention(q, k, v, scale))
        assert_close(outs[-1], attention_reference(q, k, v, scale), what=f"scale {scale}")
    assert not torch.allclose(*outs)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_strided_seqlens(device):
    q = randn(2, 1, 4, 16, dtype=torch.float32, device=device)
    k_cache, v_cache = randn(2, 20, 2, 16, dtype=torch.float32, device=device), randn(2, 20, 2, 16, dtype=torch.float32, device=device)
    seqlens = torch.tensor([[5, 17], [12, 3]], dtype=torch.int32, device=device)[:, 0]  # stride 2
    assert_close(torch.ops.qwen.decode_attention(q, k_cache, v_cache, seqlens, 0.25),
                 decode_attention_reference(q, k_cache, v_cache, seqlens, 0.25), what="strided cache_seqlens")


@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_store_caches_with_different_strides(device):
    """k_cache and v_cache of one shape but different batch strides (v a slice of a longer cache)."""
    k, v = randn(2, 1, 1, 16, dtype=torch.float32, device=device), randn(2, 1, 1, 16, dtype=torch.float32, device=device)
    k_cache = torch.zeros(2, 4, 1, 16, device=device)
    v_storage = torch.zeros(2, 8, 1, 16, device=device)
    v_cache = v_storage[:, :4]
    positions = torch.tensor([[1], [2]], device=device)
    torch.ops.qwen.kv_cache_store(k, v, k_cache, v_cache, positions)
    written = torch.zeros(2, 8, dtype=torch.bool, device=device)
    for b, pos in enumerate((1, 2)):
        assert torch.equal(k_cache[b, pos], k[b, 0]) and torch.equal(v_cache[b, pos], v[b, 0])
        written[b, pos] = True
    assert not k_cache[~written[:, :4]].any() and not v_storage[~written].any(), "wrote outside the two slots"


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_kernel_clamps_bad_lengths_inside_the_cache(device):
    """Lengths past the cache, 0, negative, < Tq or >= 2^31 never read outside the cache: the kernel
    (no host check on CUDA) clamps to [0, L], as the reference does; rows that see no key give 0.
    The caches are views of NaN-padded storage, so a read past L would show as NaN."""
    from csrc_free_ops.decode_attention import decode_attention as kernel

    b, tq, hq, hk, d, cache_len = 5, 2, 4, 2, 16, 70
    q = randn(b, tq, hq, d, dtype=torch.float32, device=device)
    storage = torch.full((2, b, 2 * cache_len, hk, d), float("nan"), device=device)
    storage[:, :, :cache_len] = randn(2, b, cache_len, hk, d, dtype=torch.float32, device=device)
    k_cache, v_cache = storage[0, :, :cache_len], storage[1, :, :cache_len]
    seqlens = torch.tensor([cache_len + 50, 0, -3, 1, 2**31 + 5], dtype=torch.int64, device=device)
    out = kernel(q, k_cache, v_cache, seqlens, 0.25)
    clamped = torch.tensor([cache_len, 0, 0, 1, cache_len], device=device)
    ref = decode_attention_reference(q, k_cache, v_cache, clamped, 0.25)
    assert_close(out, ref, what="clamped lengths")
    assert not out[1:3].any() and not out[3, 0].any(), "rows that see no key must be zero"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_decode_attention_ignores_nan_past_each_length(device, dtype):
    """NaN in the cache past each sequence's own length (inside the cache: a slot no token has filled
    yet) never reaches the output, in the kernel or the reference: lengths ending inside a key block,
    at a split boundary and one past it."""
    b, tq, hq, hk, d, cache_len = 4, 2, 4, 2, 16, 70
    q = randn(b, tq, hq, d, dtype=dtype, device=device)
    k_cache, v_cache = (randn(b, cache_len, hk, d, dtype=dtype, device=device) for _ in range(2))
    seqlens = torch.tensor([2, 33, 64, 65], dtype=torch.int32, device=device)
    for i, n in enumerate(seqlens.tolist()):
        k_cache[i, n:] = float("nan")
        v_cache[i, n:] = float("nan")
    out = torch.ops.qwen.decode_attention(q, k_cache, v_cache, seqlens, 0.25)
    ref = decode_attention_reference(q, k_cache, v_cache, seqlens, 0.25)
    assert torch.isfinite(ref).all(), "the reference lets the cache past a length reach the output"
    assert torch.isfinite(out).all(), "the kernel reads the cache past a sequence's length"
    assert_close(out, ref, what="decode_attention with NaN past each length")


def test_decode_attention_rejects_bad_lengths_on_cpu():
    q = randn(1, 2, 4, 16, dtype=torch.float32, device="cpu")
    cache = randn(1, 8, 2, 16, dtype=torch.float32, device="cpu")
    for bad in (9, 1, 0, -1):
        with pytest.raises(qwen_ops.QwenOpError, match=r"cache_seqlens must lie in \[Tq=2, L=8\]"):
            torch.ops.qwen.decode_attention(q, cache, cache, torch.tensor([bad], dtype=torch.int32), 0.25)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tq", [1, 2])
def test_decode_attention_split_boundaries(device, tq):
    """Fixed lengths on every boundary the kernel has: 1, Tq, one key block (64), one split and
    one more, the last split's edge, the cache length, and a length whose last split holds only
    masked keys for the first query (Tq=2, L=70, length 65)."""
    from csrc_free_ops.decode_attention import split_plan

    b, hq, hk, d, cache_len = 1, 4, 2, 16, 70
    _, split_len = split_plan(b, hk, cache_len, 64)
    k_cache, v_cache = (randn(b, cache_len, hk, d, dtype=torch.float32, device=device) for _ in range(2))
    q = randn(b, tq, hq, d, dtype=torch.float32, device=device)
    for n in sorted({1, tq, 2, split_len, split_len + 1, 2 * split_len, 2 * split_len + 1, 64, 65, 66,
                     cache_len - 1, cache_len} - {0}):
        if tq <= n <= cache_len:
            lens = torch.tensor([n], dtype=torch.int32, device=device)
            assert_close(torch.ops.qwen.decode_attention(q, k_cache, v_cache, lens, 0.25),
                         decode_attention_reference(q, k_cache, v_cache, lens, 0.25), what=f"length {n}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_kv_cache_store_kernel_drops_positions_outside_the_cache(device):
    """The kernel (no host check on CUDA) never writes outside [0, L): the caches are views of a
    longer storage, and positions -1, L and L + 3 must leave every slot of it untouched."""
    from csrc_free_ops.kv_cache import kv_cache_store as kernel

    b, t, hk, d, cache_len = 2, 3, 2, 16, 6
    k, v = (randn(b, t, hk, d, dtype=torch.float32, device=device) for _ in range(2))
    storage = torch.zeros(2, b, cache_len + 4, hk, d, device=device)
    k_cache, v_cache = storage[0, :, 1:cache_len + 1], storage[1, :, 1:cache_len + 1]
    positions = torch.tensor([[-1, 2, cache_len], [cache_len + 3, 0, cache_len - 1]], device=device)
    kernel(k, v, k_cache, v_cache, positions)
    written = torch.zeros(b, cache_len + 4, dtype=torch.bool, device=device)
    for (bi, ti, pos) in ((0, 1, 2), (1, 1, 0), (1, 2, cache_len - 1)):
        assert torch.equal(k_cache[bi, pos], k[bi, ti]) and torch.equal(v_cache[bi, pos], v[bi, ti])
        written[bi, pos + 1] = True
    assert not storage[:, ~written].any(), "a position outside the cache was written"
