import pytest
import torch

import qwen_ops  # noqa: F401
from csrc_free_ops import linear as linear_kernels
from qwen_ops import linear_reference
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

# (M, K, N): decode (split-K) rows first, then prefill tiles; awkward K and N on purpose.
CASES = {
    "cpu": [(1, 96, 200), (3, 72, 100), (16, 64, 130), (17, 40, 72), (130, 96, 60)],
    "cuda": [(1, 1024, 4096), (1, 2048, 1024), (1, 1024, 6144), (1, 3072, 1024), (1, 1024, 151936),
             (1, 896, 1152), (1, 896, 9728), (1, 4864, 896), (4, 1024, 4096), (16, 3584, 896),
             (255, 896, 9728), (256, 1024, 6144), (1000, 4864, 896), (2048, 1024, 3072)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_matches_reference(device, dtype, bias):
    for m, k, n in CASES[device]:
        x = randn(m, k, dtype=dtype, device=device)
        w = randn(n, k, dtype=dtype, device=device, scale=k ** -0.5)
        b = randn(n, dtype=dtype, device=device) if bias else None
        poison_allocator(device)
        assert_close(torch.ops.qwen.linear(x, w, b), linear_reference(x, w, b), what=f"linear M{m} K{k} N{n}")


@pytest.mark.parametrize("device", DEVICES)
def test_linear_leading_dims(device):
    x = randn(2, 3, 40, dtype=torch.float32, device=device)
    w = randn(24, 40, dtype=torch.float32, device=device)
    out = torch.ops.qwen.linear(x, w)
    assert out.shape == (2, 3, 24)
    assert_close(out, linear_reference(x, w), what="linear [2, 3, K]")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_k", [1, 2, 3, 5])
def test_splitk_every_split_factor(device, split_k):
    """Every split factor (uneven K slices included) sums to the same product, with bias."""
    x = randn(2, 160, dtype=torch.float32, device=device)
    w = randn(48, 160, dtype=torch.float32, device=device)
    b = randn(48, dtype=torch.float32, device=device)
    cfg = linear_kernels.DecodeConfig(block_n=16, block_k=32, split_k=split_k)
    assert_close(linear_kernels.linear(x, w, b, decode_cfg=cfg), linear_reference(x, w, b), what=f"split_k={split_k}")
