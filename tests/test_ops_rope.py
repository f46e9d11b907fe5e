import pytest
import torch

import qwen_ops  # noqa: F401
from qwen_ops import rope_backward_reference, rope_reference
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

# (batch, tokens, q heads, kv heads, head_dim, rotary_dim)
CASES = {
    "cpu": [(1, 1, 4, 2, 32, 32), (2, 7, 4, 4, 16, 16), (1, 5, 2, 1, 64, 16)],
    "cuda": [(1, 1, 16, 8, 128, 128), (4, 255, 14, 2, 64, 64), (1, 1000, 8, 2, 256, 64), (2, 256, 16, 8, 128, 128)],
}


def _fused_qkv(b, t, hq, hk, d, dtype, device):
    """q and k as strided views into one fused QKV activation, as the model produces them."""
    qkv = randn(b, t, (hq + 2 * hk) * d, dtype=dtype, device=device)
    return qkv[..., : hq * d].view(b, t, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_matches_reference(device, dtype, qk_norm):
    for b, t, hq, hk, d, rot in CASES[device]:
        q, k = _fused_qkv(b, t, hq, hk, d, dtype, device)
        positions = torch.randint(0, 4096, (b, t), device=device)
        norm = (randn(d, dtype=dtype, device=device), randn(d, dtype=dtype, device=device)) if qk_norm else (None, None)
        poison_allocator(device)
        q_out, k_out = torch.ops.qwen.rope(q, k, positions, 1e6, rot, *norm, norm_eps=1e-6)
        q_ref, k_ref = rope_reference(q, k, positions, 1e6, rot, *norm, norm_eps=1e-6)
        what = f"rope b{b} t{t} hq{hq} hk{hk} d{d} rot{rot}"
        # Angles up to 4096 rad: one ulp of inv_freq (exp2 here, pow in the reference) moves the
        # angle by ~2e-4 rad, so fp32 agrees to ~1e-4, not 1e-5.
        tol = 1.5e-4 if dtype == torch.float32 else None
        assert_close(q_out, q_ref, tol, what=what + " q")
        assert_close(k_out, k_ref, tol, what=what + " k")


@pytest.mark.parametrize("device", DEVICES)
def test_rope_int32_positions_and_offset_norm(device):
    q, k = _fused_qkv(1, 6, 4, 2, 32, torch.float32, device)
    positions = torch.arange(6, dtype=torch.int32, device=device)[None]
    wq, wk = randn(32, dtype=torch.float32, device=device), randn(32, dtype=torch.float32, device=device)
    out = torch.ops.qwen.rope(q, k, positions, 1e4, 8, wq, wk, norm_eps=1e-6, norm_offset=1.0)
    ref = rope_reference(q, k, positions, 1e4, 8, wq, wk, 1e-6, 1.0)
    assert_close(out[0], ref[0], what="rope q (partial rotary, offset norm)")
    assert_close(out[1], ref[1], what="rope k (partial rotary, offset norm)")


@pytest.mark.parametrize("device", DEVICES)
def test_rope_expanded_and_sliced_positions(device):
    """positions that are views with stride != 1 (expanded, or a column of a wider tensor)."""
    q, k = _fused_qkv(3, 1, 4, 2, 16, torch.float32, device)
    wide = torch.randint(0, 500, (3, 2), device=device)
    for positions in (torch.tensor([[7]], device=device).expand(3, 1), wide[:, 1:]):
        out = torch.ops.qwen.rope(q, k, positions, 1e4, 16)
        ref = rope_reference(q, k, positions, 1e4, 16)
        assert_close(out[0], ref[0], what=f"rope q, positions strides {positions.stride()}")
        assert_close(out[1], ref[1], what=f"rope k, positions strides {positions.stride()}")


@pytest.mark.parametrize("device", DEVICES)
def test_rope_qk_norm_of_an_all_zero_head_is_zero(device):
    """eps keeps the fused per-head norm finite on an all-zero head."""
    q, k = _fused_qkv(1, 2, 4, 2, 32, torch.float32, device)
    q[0, 1, 2] = 0
    k[0, 0, 1] = 0
    w = randn(32, dtype=torch.float32, device=device)
    positions = torch.tensor([[3, 9]], device=device)
    q_out, k_out = torch.ops.qwen.rope(q, k, positions, 1e4, 32, w, w, norm_eps=1e-6)
    assert torch.isfinite(q_out).all() and torch.isfinite(k_out).all()
    assert not q_out[0, 1, 2].any() and not k_out[0, 0, 1].any()
    assert_close(q_out, rope_reference(q, k, positions, 1e4, 32, w, w, 1e-6)[0], what="q with a zero head")


@pytest.mark.parametrize("device", DEVICES)
def test_rope_long_context_angles(device):
    """Positions of 1e5-3e5 (angles to 3e5 rad), forward and backward: the kernels subtract k * 2pi
    from each angle before the hardware sin/cos, and a wrong reduction shows as errors of order 1.
    The fp32 angle itself is only good to ~0.03 rad there (one ulp of inv_freq times the position,
    exp2 here against pow in the reference; 4e-4 relative error on the CPU), hence the loose tolerance."""
    q, k = _fused_qkv(1, 64, 4, 2, 32, torch.float32, device)
    positions = torch.randint(100_000, 300_000, (1, 64), device=device)
    out = torch.ops.qwen.rope(q, k, positions, 1e4, 32)
    ref = rope_reference(q, k, positions, 1e4, 32)
    grads = torch.ops.qwen.rope_backward(*out, q, k, positions, 1e4, 32)
    ref_grads = rope_backward_reference(*out, q, k, positions, 1e4, 32)
    for name, got, want in zip(("q", "k", "dq", "dk"), (*out, *grads[:2]), (*ref, *ref_grads[:2])):
        assert_close(got, want, 3e-3, what=f"rope {name} at positions 1e5-3e5")
