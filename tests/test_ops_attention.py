import math

import pytest
import torch

import qwen_ops  # noqa: F401
from qwen_ops import attention_reference
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

# (batch, Sq, Sk, q heads, kv heads, head_dim)
PREFILL = {
    "cpu": [(1, 1, 1, 2, 1, 16), (2, 7, 7, 4, 2, 32), (1, 20, 33, 2, 2, 64), (1, 5, 5, 2, 1, 256), (1, 70, 100, 2, 1, 16)],
    "cuda": [(1, 255, 255, 16, 8, 128), (1, 256, 256, 14, 2, 64), (2, 1000, 1000, 8, 2, 256),
             (4, 7, 7, 16, 8, 128), (1, 1, 1, 8, 2, 128), (1, 2048, 2048, 16, 8, 128), (2, 100, 612, 16, 8, 128),
             (2, 300, 300, 4, 2, 32), (1, 100, 130, 2, 1, 16)],  # the last two: heads of 32 and 16
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
    """forward_tiles trades stages, then key-block width, for shared memory: the head_dim 256 tiles
    of the rule need 224 KB, which Hopper gives a block; an A100 (163 KB) and a consumer GPU
    (99 KB) get tiles that fit (their footprint, q + stages * (k + v), within the limit). A device's
    stored tiles replace the rule's, then shrink the same way."""
    from csrc_free_ops.attention import Tiles, forward_tiles

    def footprint(t, d, itemsize=2):
        return (t.block_m + 2 * t.num_stages * t.block_n) * d * itemsize

    assert forward_tiles(256, 2048, 2, 232448) == Tiles(64, 64, 4, 3) == forward_tiles(256, 2048, 2)
    assert forward_tiles(128, 2048, 2, 232448, (128, 32, 8, 2)) == Tiles(128, 32, 8, 2)
    assert forward_tiles(128, 40, 4, None, (128, 32, 8, 3)) == Tiles(64, 32, 8, 2)
    for limit in (166912, 101376):
        for d in (64, 128, 256):
            t = forward_tiles(d, 2048, 2, limit)
            assert footprint(t, d) <= limit and t.num_stages >= 2 and t.block_n >= 16, (d, limit, t)
    assert forward_tiles(256, 2048, 2, 166912) == Tiles(64, 64, 4, 2)
    assert forward_tiles(256, 2048, 2, 101376) == Tiles(64, 32, 4, 2)


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
def test_attention_scale_is_applied(device):
    """Each scale matches the reference at that scale, and the two differ (a kernel ignoring the
    argument would match at most one)."""
    q, k, v = _qkv(1, 4, 4, 2, 1, 16, torch.float32, device)
    outs = []
    for scale in (0.1, 1.0 / math.sqrt(2.0)):
        outs.append(torch.ops.qwen.attention(q, k, v, scale))
        assert_close(outs[-1], attention_reference(q, k, v, scale), what=f"scale {scale}")
    assert not torch.allclose(*outs)
