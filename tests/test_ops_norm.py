import pytest
import torch

import qwen_ops  # noqa: F401
from qwen_ops import add_rms_norm_reference, rms_norm_reference
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

SHAPES = {"cpu": [(1, 96), (7, 896), (2, 3, 100)], "cuda": [(1, 1024), (255, 896), (1000, 2048), (4, 256, 1024)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_reference(device, dtype, offset):
    for shape in SHAPES[device]:
        x = randn(*shape, dtype=dtype, device=device, scale=3.0)
        w = randn(shape[-1], dtype=dtype, device=device)
        poison_allocator(device)
        out = torch.ops.qwen.rms_norm(x, w, 1e-6, offset)
        assert_close(out, rms_norm_reference(x, w, 1e-6, offset), what=f"rms_norm {shape}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_matches_reference(device, dtype):
    for shape in SHAPES[device]:
        x, r = randn(*shape, dtype=dtype, device=device), randn(*shape, dtype=dtype, device=device)
        w = randn(shape[-1], dtype=dtype, device=device)
        poison_allocator(device)
        normed, summed = torch.ops.qwen.add_rms_norm(x, r, w, 1e-6)
        ref_normed, ref_summed = add_rms_norm_reference(x, r, w, 1e-6)
        assert_close(summed, ref_summed, what=f"add_rms_norm sum {shape}")
        assert_close(normed, ref_normed, what=f"add_rms_norm norm {shape}")


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_strided_input(device):
    """A row-strided view (e.g. a slice of a wider activation) is read correctly."""
    big = randn(9, 160, dtype=torch.float32, device=device)
    x = big[:, 16:112]
    w = randn(96, dtype=torch.float32, device=device)
    assert_close(torch.ops.qwen.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), what="strided rms_norm")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zero_rows_stay_zero_and_finite(device, dtype):
    """eps keeps rsqrt finite on an all-zero row: the output is exactly zero, not NaN."""
    x = randn(4, 96, dtype=dtype, device=device)
    x[1] = 0
    w = randn(96, dtype=dtype, device=device)
    out = torch.ops.qwen.rms_norm(x, w, 1e-6)
    assert torch.isfinite(out).all() and not out[1].any()
    assert_close(out, rms_norm_reference(x, w, 1e-6), what="zero row")
    normed, summed = torch.ops.qwen.add_rms_norm(x, -x, w, 1e-6)
    assert not summed.any() and not normed.any() and torch.isfinite(normed).all()


@pytest.mark.parametrize("device", DEVICES)
def test_add_rms_norm_stores_the_rounded_sum_exactly(device):
    """The residual output is (x + r) rounded once to the dtype, bit for bit, and the norm is taken
    of that rounded sum (what the next layer reads). fp16, whose rounding the interpreter gets
    right (its bf16 conversion truncates); the sums are exact in fp32, so only the final rounding
    matters, and magnitudes up to 1e3 make it drop bits."""
    x = randn(8, 96, dtype=torch.float16, device=device, scale=300.0)
    r = randn(8, 96, dtype=torch.float16, device=device, scale=0.3)
    w = randn(96, dtype=torch.float16, device=device)
    normed, summed = torch.ops.qwen.add_rms_norm(x, r, w, 1e-6)
    exact = x.float() + r.float()
    assert not torch.equal(exact, exact.half().float()), "the case must need rounding"
    assert torch.equal(summed, exact.half())
    assert torch.equal(normed, torch.ops.qwen.rms_norm(summed, w, 1e-6)), "the norm must be of the rounded sum"
    assert_close(normed, rms_norm_reference(summed, w, 1e-6), what="norm of the rounded sum")


@pytest.mark.parametrize("device", DEVICES)
def test_large_activations_stay_finite(device):
    """Rows of size 1e18: their squares (1e36) sit near the top of the fp32 (and bf16) range."""
    x = randn(4, 96, dtype=torch.bfloat16, device=device, scale=1e18)
    w = randn(96, dtype=torch.bfloat16, device=device)
    out = torch.ops.qwen.rms_norm(x, w, 1e-6)
    ref = rms_norm_reference(x, w, 1e-6)
    assert torch.isfinite(ref).all() and torch.isfinite(out).all()
    assert_close(out, ref, what="large rows")
