import pytest
import torch
import triton
from triton.runtime import _allocation

import qwen_ops
from csrc_free_ops import linear as linear_kernels
from qwen_ops import linear_reference
from tests.helpers import DEVICES, DTYPES, REL_TOL, assert_close, poison_allocator, randn, require_tma

# (M, K, N): decode (split-K) rows first, then prefill tiles; awkward K and N on purpose.
CASES = {
    "cpu": [(1, 96, 200), (3, 72, 100), (16, 64, 130), (17, 40, 72), (130, 96, 60)],
    "cuda": [(1, 1024, 4096), (1, 2048, 1024), (1, 1024, 6144), (1, 3072, 1024), (1, 1024, 151936),
             (1, 896, 1152), (1, 896, 9728), (1, 4864, 896), (4, 1024, 4096), (16, 3584, 896),
             (255, 896, 9728), (256, 1024, 6144), (1000, 4864, 896), (2048, 1024, 3072),
             # the H200 table's 256-token rows with narrow 64 x 32 x 256 tiles, and qkv's 4-stage tile
             (256, 2048, 1024), (200, 3072, 1024), (77, 1024, 896), (256, 1024, 4096),
             # the 512 and 1024 classes: 64 x 128 x 128 tiles, K split in two for down at 512
             (512, 3072, 1024), (300, 4864, 896), (700, 2048, 1024), (1024, 896, 1536)],
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


def test_prefill_m_classes(monkeypatch):
    """M takes the device's config stored at the smallest class >= M (the largest beyond it) that
    lists its (N, K); a shape stored at no class >= M takes the rule."""
    classes = [linear_kernels.prefill_m_class(m) for m in (17, 33, 64, 65, 129, 256, 257, 512, 513, 1024, 1025, 2048,
                                                            8192)]
    assert classes == [32, 64, 64, 128, 256, 256, 512, 512, 1024, 1024, 2048, 2048, 2048]
    table = {(64, 4096, 1024): (64, 32, 256, 4, 4, 1), (256, 4096, 1024): (64, 128, 128, 4, 4, 1),
             (256, 896, 4864): (64, 128, 128, 4, 4, 4)}
    monkeypatch.setattr(linear_kernels, "tuned", lambda name, device, dtype, key: table.get(key)
                        if name == "linear_prefill" else None)
    gpu, bf16 = torch.device("cuda", 0), torch.bfloat16
    assert linear_kernels.prefill_config(40, 4096, 1024, gpu, bf16) == linear_kernels.PrefillConfig(64, 32, 256, 4, 4, 1)
    assert linear_kernels.prefill_config(65, 4096, 1024, gpu, bf16) == linear_kernels.PrefillConfig(64, 128, 128, 4, 4, 1)
    # no row below 256 for this shape: M = 40 takes the 256 row, not the rule
    assert linear_kernels.prefill_config(40, 896, 4864, gpu, bf16) == linear_kernels.PrefillConfig(64, 128, 128, 4, 4, 4)
    monkeypatch.setattr(linear_kernels, "INTERPRET", True)  # the rule, without asking the device
    assert linear_kernels.prefill_config(300, 4096, 1024, gpu, bf16) == linear_kernels.PrefillConfig(32, 32, 32, 4, 1)


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
    assert_close(linear_kernels.linear(x, w, b, config=cfg), linear_reference(x, w, b), what=f"split_k={split_k}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_prefill_tma_edge_tiles_and_splits(device, split_k):
    """The TMA GEMM: edge tiles past M, N and K (zero-filled loads, clipped stores), uneven K
    slices summed with the bias, and more work items than programs (the persistent loop)."""
    m, k, n = (45, 88, 40) if device == "cpu" else (300, 1000, 200)
    x = randn(m, k, dtype=torch.bfloat16, device=device)
    w = randn(n, k, dtype=torch.bfloat16, device=device, scale=k ** -0.5)
    b = randn(n, dtype=torch.bfloat16, device=device)
    y = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    require_tma(device)
    assert linear_kernels.tma_ok(x, w, y)
    tile = 16 if device == "cpu" else 64
    cfg = linear_kernels.PrefillConfig(tile, tile, tile, 4, 1 if device == "cpu" else 3, split_k)
    assert_close(linear_kernels.linear(x, w, b, config=cfg), linear_reference(x, w, b), what=f"split_k={split_k}")


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_unaligned_rows_take_the_tiled_gemm(device):
    """Rows TMA cannot describe (a 2-byte offset, a row stride that is not a multiple of 16 bytes)
    go to the strided GEMM, with the same result."""
    flat = randn(40 * 96 + 1, dtype=torch.bfloat16, device=device)
    wide = randn(40, 97, dtype=torch.bfloat16, device=device)
    w = randn(24, 96, dtype=torch.bfloat16, device=device, scale=0.1)
    for x in (flat[1:].view(40, 96), wide[:, :96]):
        assert not linear_kernels.tma_ok(x, w, torch.empty(40, 24, dtype=torch.bfloat16, device=device))
        assert_close(torch.ops.qwen.linear(x, w), linear_reference(x, w), what="unaligned x")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_k", [1, 3])
def test_prefill_tma_device_descriptors(device, split_k, monkeypatch):
    """The descriptor form torch.compile traces (pointers in, descriptors made per program) gives
    the host-descriptor result."""
    require_tma(device)
    m, k, n = (45, 88, 40) if device == "cpu" else (300, 1000, 200)
    x = randn(m, k, dtype=torch.bfloat16, device=device)
    w = randn(n, k, dtype=torch.bfloat16, device=device, scale=k ** -0.5)
    b = randn(n, dtype=torch.bfloat16, device=device)
    tile = 16 if device == "cpu" else 64
    cfg = linear_kernels.PrefillConfig(tile, tile, tile, 4, 1 if device == "cpu" else 3, split_k)
    host = linear_kernels.linear(x, w, b, config=cfg)
    monkeypatch.setattr(linear_kernels, "is_traced", lambda: True)
    allocator = _allocation._allocator.get()
    try:
        torch.testing.assert_close(linear_kernels.linear(x, w, b, config=cfg), host, rtol=0, atol=0)
    finally:
        triton.set_allocator(allocator)  # the traced form sets Triton's scratch allocator where none is set
    offset = randn(m * k + 8, dtype=torch.bfloat16, device=device)[1:m * k + 1].view(m, k)
    assert not linear_kernels.tma_ok(offset, w, torch.empty(m, n, dtype=torch.bfloat16, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_tma_refuses_broadcast_rows_and_wrong_configs(device):
    """Rows a descriptor cannot describe (a broadcast x, stride 0) take the strided GEMM; a config
    of the wrong kind, or a PrefillConfig for such rows, is an error rather than ignored."""
    w = randn(24, 64, dtype=torch.bfloat16, device=device, scale=0.1)
    x = randn(1, 64, dtype=torch.bfloat16, device=device).expand(40, 64)
    assert not linear_kernels.tma_ok(x, w, torch.empty(40, 24, dtype=torch.bfloat16, device=device))
    assert_close(torch.ops.qwen.linear(x, w), linear_reference(x, w), what="broadcast x")
    prefill_cfg = linear_kernels.PrefillConfig(16, 16, 16, 4, 1)
    with pytest.raises(ValueError, match="TMA path cannot take"):
        linear_kernels.linear(x, w, None, config=prefill_cfg)
    with pytest.raises(ValueError, match="PrefillConfig for M = 4"):
        linear_kernels.linear(x[:4].contiguous(), w, None, config=prefill_cfg)
    with pytest.raises(ValueError, match="DecodeConfig for M = 40"):
        linear_kernels.linear(x.contiguous(), w, None, config=linear_kernels.DecodeConfig(16, 16, 1))


# (M, K, I): decode rows and rows TMA refuses (I * 2 bytes not a multiple of 16) take linear then
# silu_mul; the others the GEMM with the SwiGLU epilogue.
SILU_MUL_CASES = {
    "cpu": [(3, 64, 48, False), (40, 64, 48, True), (70, 200, 40, True), (33, 96, 100, False)],
    "cuda": [(1, 1024, 3072, False), (32, 1024, 3072, True), (256, 1024, 3584, True), (2048, 1024, 3584, True),
             (300, 4096, 12288, True), (777, 896, 4864, True), (40, 64, 100, False)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_silu_mul_matches_reference(device, dtype, monkeypatch):
    """The op against silu_mul(linear(...))'s reference; the fused GEMM runs exactly where TMA takes
    16-bit operands above the decode rows (counted through the kernel module's entry)."""
    fused = []
    entry = linear_kernels.linear_silu_mul
    monkeypatch.setattr(linear_kernels, "linear_silu_mul", lambda x, w: fused.append(entry(x, w)) or fused[-1])
    for m, k, i, takes_tma in SILU_MUL_CASES[device]:
        if takes_tma and device == "cuda":
            require_tma(device)
        x = randn(m, k, dtype=dtype, device=device)
        w = randn(2 * i, k, dtype=dtype, device=device, scale=k ** -0.5)
        fused.clear()
        poison_allocator(device)
        got = torch.ops.qwen.linear_silu_mul(x, w)
        # two roundings to 16 bits (gate_up, the product) where the fallback runs: twice linear's bound
        assert_close(got, qwen_ops.linear_silu_mul_reference(x, w), rel_tol=2 * REL_TOL[dtype],
                     what=f"linear_silu_mul M{m} K{k} I{i}")
        if device == "cuda" or qwen_ops.registry.runs_kernels("cpu", dtype):
            assert [y is not None for y in fused] == [takes_tma and dtype != torch.float32], (m, k, i, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_silu_mul_opcheck_and_errors(device):
    x = randn(2, 20, 32, dtype=torch.bfloat16, device=device)
    w = randn(64, 32, dtype=torch.bfloat16, device=device, scale=0.2)
    torch.library.opcheck(torch.ops.qwen.linear_silu_mul.default, (x, w))
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.linear_silu_mul: gate_up_weight needs an even number"):
        torch.ops.qwen.linear_silu_mul(x, w[:63])
    with pytest.raises(qwen_ops.QwenOpError,
                       match=r"qwen.linear_silu_mul: gate_up_weight is \(64, 16\) \(\[N, K\]\) but x's"):
        torch.ops.qwen.linear_silu_mul(x, w[:, :16])
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.linear_silu_mul: gate_up_weight has dtype"):
        torch.ops.qwen.linear_silu_mul(x, w.float())
