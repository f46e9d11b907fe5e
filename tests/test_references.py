"""The PyTorch references (the oracles) checked against independent float64 math."""
import math

import torch
import torch.nn.functional as F

from qwen_ops import (add_rms_norm_reference, attention_reference, attention_with_lse_reference,
                      kv_cache_store_slots_reference, linear_reference, paged_attention_reference, rms_norm_reference,
                      rope_reference, silu_mul_reference)
from tests.helpers import assert_close


def test_rms_norm_reference():
    x, w = torch.randn(5, 33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    for offset in (0.0, 1.0):
        expected = torch.stack([row / math.sqrt(float((row * row).mean()) + 1e-6) * (w + offset) for row in x])
        assert_close(rms_norm_reference(x, w, 1e-6, offset), expected)
        assert_close(rms_norm_reference(x.bfloat16(), w.bfloat16(), 1e-6, offset), expected.bfloat16(), 1e-2)
    r = torch.randn(5, 33, dtype=torch.float64)
    normed, summed = add_rms_norm_reference(x, r, w, 1e-6)
    assert_close(summed, x + r)
    expected_sum = torch.stack([row / math.sqrt(float((row * row).mean()) + 1e-6) * w for row in x + r])
    assert_close(normed, expected_sum)


def test_rope_reference_is_a_complex_rotation():
    """NeoX rope = multiplying (x[i] + j x[i + R/2]) by exp(j * pos * theta^(-2i/R))."""
    b, t, h, d, rot, theta = 2, 5, 3, 16, 8, 1e4
    q, k = torch.randn(b, t, h, d, dtype=torch.float64), torch.randn(b, t, 1, d, dtype=torch.float64)
    pos = torch.randint(0, 500, (b, t))
    freqs = torch.tensor([theta ** (-2 * i / rot) for i in range(rot // 2)], dtype=torch.float64)
    rotor = torch.polar(torch.ones(b, t, 1, rot // 2, dtype=torch.float64), pos[..., None, None] * freqs)
    for x, out in zip((q, k), rope_reference(q, k, pos, theta, rot)):
        z = torch.complex(x[..., : rot // 2], x[..., rot // 2 : rot]) * rotor
        assert_close(out, torch.cat([z.real, z.imag, x[..., rot:]], dim=-1))


def test_linear_and_silu_mul_references():
    x, w, b = (torch.randn(4, 9, dtype=torch.float64), torch.randn(6, 9, dtype=torch.float64),
               torch.randn(6, dtype=torch.float64))
    expected = torch.tensor([[sum(x[i, kk] * w[j, kk] for kk in range(9)) + b[j] for j in range(6)] for i in range(4)],
                            dtype=torch.float64)
    assert_close(linear_reference(x, w, b), expected)
    gu = torch.randn(3, 10, dtype=torch.float64)
    g, u = gu[:, :5], gu[:, 5:]
    assert_close(silu_mul_reference(gu), g / (1 + torch.exp(-g)) * u)


def test_linear_reference_in_slices():
    """A few rows by a weight wider than SLICE_FEATURES (three slices, the last partial) with a bias:
    the same product as x @ w.T + b; one row and many rows (taken whole) too."""
    from qwen_ops.linear import SLICE_FEATURES, SLICED_ROWS

    n = 2 * SLICE_FEATURES + 5
    w, b = torch.randn(n, 8, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    for rows in (1, 3, SLICED_ROWS.stop):
        x = torch.randn(rows, 8, dtype=torch.float64)
        assert_close(linear_reference(x, w, b), torch.addmm(b, x, w.t()), what=f"{rows} rows")
        assert_close(linear_reference(x, w), x @ w.t(), what=f"{rows} rows, no bias")


def _naive_attention(q, k, v, scale, allowed):
    """Per (batch, head, query) loops; allowed(b, i, j) says whether query i sees key j."""
    bsz, sq, hq, d = q.shape
    group = hq // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(bsz):
        for h in range(hq):
            for i in range(sq):
                js = [j for j in range(k.shape[1]) if allowed(b, i, j)]
                s = torch.stack([q[b, i, h] @ k[b, j, h // group] * scale for j in js])
                p = torch.softmax(s, 0)
                out[b, i, h] = sum(p[n] * v[b, j, h // group] for n, j in enumerate(js))
    return out


def test_attention_reference_against_loops():
    q = torch.randn(2, 4, 4, 8, dtype=torch.float64)
    k, v = torch.randn(2, 6, 2, 8, dtype=torch.float64), torch.randn(2, 6, 2, 8, dtype=torch.float64)
    assert_close(attention_reference(q, k, v, 0.4, causal=True), _naive_attention(q, k, v, 0.4, lambda b, i, j: j <= i + 2))
    assert_close(attention_reference(q, k, v, 0.4, causal=False), _naive_attention(q, k, v, 0.4, lambda b, i, j: True))


def _paged(caches, block_size, spare):
    """Contiguous caches [B, L, Hk, D] (L a multiple of block_size) as paged ones: each sequence's
    blocks at shuffled ids of a pool with `spare` more blocks, of NaN -> (pools, block_table)."""
    b, length, hk, d = caches[0].shape
    per = length // block_size
    table = torch.randperm(b * per + spare)[:b * per].view(b, per)
    pools = []
    for c in caches:
        pool = torch.full((b * per + spare, block_size, hk, d), float("nan"), dtype=c.dtype)
        pool[table.flatten()] = c.reshape(b * per, block_size, hk, d)
        pools.append(pool)
    return pools, table.to(torch.int32)


def test_paged_attention_reference_against_loops():
    """Two new tokens per sequence, lengths ending inside the first block and in the second."""
    q = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    kc, vc = torch.randn(2, 32, 2, 8, dtype=torch.float64), torch.randn(2, 32, 2, 8, dtype=torch.float64)
    lens = torch.tensor([3, 25], dtype=torch.int32)
    expected = _naive_attention(q, kc, vc, 0.3, lambda b, i, j: j <= int(lens[b]) - 2 + i)
    (k_pool, v_pool), table = _paged((kc, vc), 16, spare=2)
    cu = torch.tensor([0, 2, 4], dtype=torch.int32)
    assert_close(paged_attention_reference(q.flatten(0, 1), k_pool, v_pool, cu, lens, table, 0.3, 2),
                 expected.flatten(0, 1))


def _sdpa64(q, k, v, scale, keep=None):
    """float64 SDPA of q [Sq, Hq, D] over k, v [Sk, Hk, D]; keep [Sq, Sk] True where a query sees a key."""
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=True).transpose(0, 1)


def test_attention_reference_matches_float64_sdpa():
    """Prefill over several query blocks (the last one partial), causal with a cached prefix (Sk > Sq) and
    without, GQA: float64 in, float64 out, equal to SDPA to float64 rounding; lse is the logsumexp of
    each query's masked scores. fp32 in: within fp32 rounding of the same float64 result."""
    from qwen_ops.attention import QUERY_BLOCK

    sq, sk, hq, hk, d = 2 * QUERY_BLOCK + 37, 2 * QUERY_BLOCK + 50, 4, 2, 16
    q, k, v = torch.randn(1, sq, hq, d, dtype=torch.float64), *torch.randn(2, 1, sk, hk, d, dtype=torch.float64)
    for causal in (True, False):
        keep = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq) if causal else None
        expected = _sdpa64(q[0], k[0], v[0], 0.3, keep)[None]
        out, lse = attention_with_lse_reference(q, k, v, 0.3, causal)
        assert out.dtype == lse.dtype == torch.float64
        assert_close(out, expected, what=f"causal={causal}")
        assert_close(attention_reference(q, k, v, 0.3, causal), expected, what=f"causal={causal}")
        s = torch.einsum("qhd,khd->hqk", q[0], k[0].repeat_interleave(hq // hk, 1)) * 0.3
        assert_close(lse[0], s.masked_fill(~keep, float("-inf")).logsumexp(-1) if causal else s.logsumexp(-1))
        assert_close(attention_reference(q.float(), k.float(), v.float(), 0.3, causal), expected.float())


def test_paged_attention_reference_matches_float64_sdpa_on_ragged_batches():
    """Ragged lengths (one just its new tokens, one the table's whole reach) and equal ones, decode
    rows and chunks, NaN past each length (in its last block, and the pool's spare blocks):
    float64 stays float64 and equals float64 SDPA over each sequence's own positions; fp32 within
    fp32 rounding of it. No NaN reaches the output, and a wider table (its extra entries into NaN
    blocks) does not change the result."""
    hq, hk, d, length = 4, 2, 16, 96
    for qlens, lens in (([1, 1, 1, 1], [1, 37, 64, 96]), ([3, 1, 3, 3], [3, 40, 41, 96]), ([2, 2], [50, 50]),
                        ([20, 1], [20, 77])):
        b, what = len(lens), f"new tokens {qlens} lengths {lens}"
        k_cache, v_cache = torch.randn(2, b, length, hk, d, dtype=torch.float64)
        for i, n in enumerate(lens):
            k_cache[i, n:] = v_cache[i, n:] = float("nan")
        (k_pool, v_pool), table = _paged((k_cache, v_cache), 16, spare=3)
        cu = [0] + torch.tensor(qlens).cumsum(0).tolist()
        q = torch.randn(cu[-1], hq, d, dtype=torch.float64)
        expected = torch.cat([_sdpa64(q[cu[i]:cu[i + 1]], k_cache[i, :n], v_cache[i, :n], 0.3,
                                      torch.arange(n)[None, :] <= torch.arange(qlens[i])[:, None] + (n - qlens[i]))
                              for i, n in enumerate(lens)])
        args = (torch.tensor(cu, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32))
        out = paged_attention_reference(q, k_pool, v_pool, *args, table, 0.3, max(qlens))
        assert out.dtype == torch.float64 and torch.isfinite(out).all(), what
        assert_close(out, expected, what=f"float64 {what}")
        out32 = paged_attention_reference(q.float(), k_pool.float(), v_pool.float(), *args, table, 0.3, max(qlens))
        assert out32.dtype == torch.float32 and torch.isfinite(out32).all()
        assert_close(out32, expected.float(), what=f"fp32 {what}")
        spare = [j for j in range(k_pool.shape[0]) if j not in table]
        wider = torch.cat([table, torch.tensor(spare, dtype=torch.int32).expand(b, -1)], 1)
        assert torch.equal(paged_attention_reference(q, k_pool, v_pool, *args, wider, 0.3, max(qlens)), out), \
            f"the table's width changed the result ({what})"


def test_kv_cache_store_slots_reference():
    """Row slot_mapping[i] of the [num_blocks * block_size, Hk, D] views gets token i; a slot < 0 or
    past the cache is not written."""
    k, v = torch.randn(5, 1, 4), torch.randn(5, 1, 4)
    kc, vc = torch.zeros(2, 16, 1, 4), torch.zeros(2, 16, 1, 4)
    slots = torch.tensor([0, 17, -1, 31, 32])
    kv_cache_store_slots_reference(k, v, kc, vc, slots)
    for i, slot in ((0, 0), (1, 17), (3, 31)):
        block, offset = divmod(slot, 16)
        assert torch.equal(kc[block, offset], k[i]) and torch.equal(vc[block, offset], v[i])
    written = torch.zeros(32, dtype=torch.bool)
    written[[0, 17, 31]] = True
    assert not kc.flatten(0, 1)[~written].any() and not vc.flatten(0, 1)[~written].any()
