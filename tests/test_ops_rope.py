import pytest
import torch

import qwen_ops
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "reference"])
def test_rope_rejects_positions_past_2_24_on_cpu(dtype):
    """fp32 angles hold integer positions exactly up to 2^24 only: beyond, forward and backward
    raise one error naming positions, on the kernel path and the reference path alike."""
    q, k = torch.randn(1, 2, 2, 16, dtype=dtype), torch.randn(1, 2, 1, 16, dtype=dtype)
    edge = torch.tensor([[2**24, -2**24]])
    assert torch.isfinite(torch.ops.qwen.rope(q, k, edge, 1e4, 16)[0]).all()
    for bad in (2**24 + 1, -2**24 - 1, 2**31 - 1):
        positions = torch.tensor([[5, bad]], dtype=torch.int32 if bad == 2**31 - 1 else torch.int64)
        with pytest.raises(qwen_ops.QwenOpError, match=r"qwen\.rope: positions must lie in \[-2\^24, 2\^24\]"):
            torch.ops.qwen.rope(q, k, positions, 1e4, 16)
        with pytest.raises(qwen_ops.QwenOpError, match=r"qwen\.rope: positions must lie in \[-2\^24, 2\^24\]"):
            torch.ops.qwen.rope_backward(q, k, q, k, positions, 1e4, 16)


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_rope_kernels_write_nan_for_positions_past_2_24(device):
    """The launchers (no value check on CUDA: it would cost a host sync) write NaN in the rotated
    dims of a head whose position is past +-2^24, where fp32 angles are off by a radian or more,
    and the reference does the same; the other rows (2^24 included) and the pass-through dims
    are unaffected."""
    from csrc_free_ops import rope as kernels

    q, k = _fused_qkv(1, 5, 2, 1, 32, torch.float32, device)
    positions = torch.tensor([[3, 2**24 + 1, -2**24 - 1, 2**31 - 1, 2**24]], dtype=torch.int32, device=device)
    rot, bad = 16, [1, 2, 3]
    out = kernels.rope(q, k, positions, 1e4, rot, None, None, 1e-6, 0.0)
    ref = rope_reference(q, k, positions, 1e4, rot)
    grads = kernels.rope_backward(*out, q, k, positions, 1e4, rot, None, None, 1e-6, 0.0)
    ref_grads = rope_backward_reference(*out, q, k, positions, 1e4, rot)
    for name, got, want in zip(("q", "k", "dq", "dk"), (*out, *grads[:2]), (*ref, *ref_grads[:2])):
        assert got[0, bad, :, :rot].isnan().all() and want[0, bad, :, :rot].isnan().all(), name
        assert torch.equal(got[0, bad, :, rot:], want[0, bad, :, rot:]), f"{name}: pass-through dims"
        assert_close(got[0, 0], want[0, 0], what=f"rope {name} at position 3")
        assert torch.isfinite(got[0, 4]).all(), f"{name} at position 2^24"
