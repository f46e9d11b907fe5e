"""The PyTorch references (the oracles) checked against independent float64 math."""
import math

import torch

from qwen_ops import (add_rms_norm_reference, attention_reference, decode_attention_reference,
                      kv_cache_store_reference, linear_reference, rms_norm_reference, rope_reference,
                      silu_mul_reference)
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


def test_decode_attention_reference_against_loops():
    q = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    kc, vc = torch.randn(2, 9, 2, 8, dtype=torch.float64), torch.randn(2, 9, 2, 8, dtype=torch.float64)
    lens = torch.tensor([3, 9], dtype=torch.int32)
    expected = _naive_attention(q, kc, vc, 0.3, lambda b, i, j: j <= int(lens[b]) - 2 + i)
    assert_close(decode_attention_reference(q, kc, vc, lens, 0.3), expected)


def test_kv_cache_store_reference():
    k, v = torch.randn(2, 3, 1, 4), torch.randn(2, 3, 1, 4)
    kc, vc = torch.zeros(2, 6, 1, 4), torch.zeros(2, 6, 1, 4)
    pos = torch.tensor([[0, 2, 4], [5, 1, 3]])
    kv_cache_store_reference(k, v, kc, vc, pos)
    for b in range(2):
        for t in range(3):
            assert torch.equal(kc[b, pos[b, t]], k[b, t]) and torch.equal(vc[b, pos[b, t]], v[b, t])
    assert kc[0, 1].abs().sum() == 0 and kc[1, 0].abs().sum() == 0
