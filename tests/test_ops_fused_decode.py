"""The fused decode ops against the composition of the references they replace."""
import re

import pytest
import torch

import qwen_ops
from csrc_free_ops import fused_decode as kernels
from csrc_free_ops.common import semaphores
from qwen_ops import quantize_weight_fp8_block
from tests.helpers import DEVICES, DTYPES, REL_TOL, assert_close, opcheck_without_schema_test, poison_allocator, randn


def _tol(dtype, device):
    """Three to five roundings to the model dtype in a row (the norm, the projection, the
    epilogue): bf16 on the CPU interpreter, which truncates at each, gets three times the bound."""
    return REL_TOL[dtype] * (3 if dtype == torch.bfloat16 and device == "cpu" else 1)


# (M, K, N): awkward K and N; on CUDA the Qwen3-0.6B decode shapes
CASES = {"cpu": [(1, 72, 40), (3, 40, 100), (17, 96, 24)],
         "cuda": [(1, 1024, 2048), (1, 3072, 1024), (8, 1024, 1024), (32, 896, 4864), (1, 1024, 151936)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_linear(device, dtype):
    for m, k, n in CASES[device]:
        x, nw = randn(m, k, dtype=dtype, device=device), randn(k, dtype=dtype, device=device)
        w, b = randn(n, k, dtype=dtype, device=device, scale=k**-0.5), randn(n, dtype=dtype, device=device)
        for bias in (None, b):
            poison_allocator(device)
            out = torch.ops.qwen.norm_linear(x, nw, w, bias, 1e-6, 1.0)
            assert_close(out, qwen_ops.norm_linear_reference(x, nw, w, bias, 1e-6, 1.0), _tol(dtype, device),
                         f"norm_linear M{m} K{k} N{n} bias={bias is not None}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_residual(device, dtype):
    for m, k, n in CASES[device]:
        x, w = randn(2, m, k, dtype=dtype, device=device), randn(n, k, dtype=dtype, device=device, scale=k**-0.5)
        residual = randn(2, m, n, dtype=dtype, device=device)
        poison_allocator(device)
        assert_close(torch.ops.qwen.linear_residual(x, w, residual),
                     qwen_ops.linear_residual_reference(x, w, residual), _tol(dtype, device),
                     f"linear_residual M{m} K{k} N{n}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_gate_up_silu(device, dtype):
    for m, k, n in CASES[device]:
        x, nw = randn(m, k, dtype=dtype, device=device), randn(k, dtype=dtype, device=device)
        w = randn(2 * n, k, dtype=dtype, device=device, scale=k**-0.5)
        poison_allocator(device)
        assert_close(torch.ops.qwen.norm_gate_up_silu(x, nw, w, 1e-6, 0.0),
                     qwen_ops.norm_gate_up_silu_reference(x, nw, w, 1e-6, 0.0), _tol(dtype, device),
                     f"norm_gate_up_silu M{m} K{k} I{n}")


# (N, K, Hq, Hk, D, rotary_dim, gated, bias, qk_norm): qwen3, qwen2, Qwen3.5's gated attention
QKV = {"cpu": [(2, 40, 4, 2, 16, 16, False, False, True), (3, 72, 2, 2, 32, 32, False, True, False),
               (3, 48, 4, 1, 32, 8, True, False, True)],
       "cuda": [(1, 1024, 16, 8, 128, 128, False, False, True), (8, 896, 14, 2, 64, 64, False, True, False),
                (2, 1024, 8, 2, 256, 64, True, False, True), (32, 1024, 16, 8, 128, 128, False, False, True)]}
QKV_SLOTS = 4 * 16
"""The paged caches of qkv_args: 4 blocks of 16 slots."""


def qkv_args(n, k, hq, hk, d, rot, gated, bias, qk_norm, dtype, device):
    """norm_qkv_rope_store's arguments for n rows. The paged caches are NaN, views of NaN storage one
    block longer at each end; each row's RoPE position (in [0, 64)) and KV slot are drawn apart. The
    slots are distinct and even, so the slot after each written one stays NaN (a store past the
    last head's D shows there); row 1 is a padding row (slot -1), row 2 one whose slot lies just
    past the cache."""
    rows = (hq * (2 if gated else 1) + 2 * hk) * d
    r = lambda *s, **kw: randn(*s, dtype=dtype, device=device, **kw)  # noqa: E731
    storage = torch.full((2, QKV_SLOTS // 16 + 2, 16, hk, d), float("nan"), dtype=dtype, device=device)
    slots = 2 * torch.randperm(QKV_SLOTS // 2, device=device)[:n]
    slots[1:3] = torch.tensor([-1, QKV_SLOTS], device=device)[:n - 1]
    return [r(n, k), r(k), r(rows, k, scale=k**-0.5), r(rows) if bias else None, r(d) if qk_norm else None,
            r(d) if qk_norm else None, storage[0, 1:-1], storage[1, 1:-1], torch.randint(0, 64, (n,), device=device),
            slots, 1e-6, 1.0, 1e4, rot, hq, gated]


def check_qkv(q, args, tol=None, what="norm_qkv_rope_store"):
    """q (and the gate) as the reference gives them, and the cache rows of the slots inside the
    cache as the reference writes them into NaN caches; every other element of the caches' storage
    (the padding rows' slots, the slot after each written one, the blocks around) still NaN."""
    storage = args[6]._base
    expected = torch.full_like(storage, float("nan"))
    ref = qwen_ops.norm_qkv_rope_store_reference(*args[:6], expected[0, 1:-1], expected[1, 1:-1], *args[8:])
    assert_close(q, ref, tol, f"{what} q")
    written = ~expected.isnan()
    slots = args[9]
    in_cache = int(((slots >= 0) & (slots < QKV_SLOTS)).sum())
    assert int(written.sum()) == 2 * in_cache * storage[0, 0, 0].numel(), f"{what}: the reference's cache rows"
    assert_close(storage[written], expected[written], tol, f"{what} cache rows")
    assert storage[~written].isnan().all(), f"{what}: written outside the rows' slots"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_qkv_rope_store(device, dtype):
    """q (and the gate) rotated at the rows' positions, their keys and values stored at their slots
    (the paged cache), nothing else of the cache written, padding rows (slot -1, a slot past the
    cache) included."""
    torch.manual_seed(0)
    for spec in QKV[device]:
        args = qkv_args(*spec, dtype, device)
        poison_allocator(device)
        check_qkv(torch.ops.qwen.norm_qkv_rope_store(*args), args, _tol(dtype, device), f"norm_qkv_rope_store {spec}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_qkv_positions_past_2_24(device):
    """As rope's: the launcher (no value check on CUDA: it would cost a host sync) writes NaN in the
    rotated dims of q and of the stored k of a row whose position is past +-2^24, where fp32 angles
    are off by a radian or more, as the reference does; on CPU tensors the op refuses such positions."""
    torch.manual_seed(0)
    rot = 8
    args = qkv_args(4, 40, 4, 2, 16, rot, False, False, True, torch.float32, device)
    args[8] = torch.tensor([3, 2**24 + 1, -2**24 - 1, 2**40], device=device)  # rows 1, 2: padding slots
    storage = args[6]._base
    expected = torch.full_like(storage, float("nan"))
    ref = qwen_ops.norm_qkv_rope_store_reference(*args[:6], expected[0, 1:-1], expected[1, 1:-1], *args[8:])
    q = kernels.norm_qkv_rope_store(*args)
    assert ref[1:, :, :rot].isnan().all() and not ref[0].isnan().any() and not ref[..., rot:].isnan().any()
    for what, got, want in (("q", q, ref), ("cache", storage, expected)):
        same_nan = torch.equal(got.isnan(), want.isnan())
        assert same_nan, f"{what}: NaN where the reference has none, or the reverse"
        assert_close(got[~want.isnan()], want[~want.isnan()], what=what)
    if device == "cpu":
        with pytest.raises(qwen_ops.QwenOpError, match=r"qwen\.norm_qkv_rope_store: positions must lie in \[-2\^24"):
            torch.ops.qwen.norm_qkv_rope_store(*args)


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_every_split_factor(device, split_k):
    """Every K split (uneven slices included) ends in the same result: the last program to arrive
    sums the slices, and the counters are back at zero for the next launch."""
    f32 = dict(dtype=torch.float32, device=device)
    cfg = kernels.GemvConfig(block_n=16, block_k=32, split_k=split_k)
    x, nw, res = randn(3, 160, **f32), randn(160, **f32), randn(3, 40, **f32)
    w = randn(80, 160, **f32, scale=0.1)
    assert_close(kernels.norm_linear(x, nw, w, None, 1e-6, 0.0, cfg=cfg),
                 qwen_ops.norm_linear_reference(x, nw, w, None, 1e-6, 0.0), what=f"norm_linear split {split_k}")
    assert_close(kernels.linear_residual(x, w[:40], res, cfg=cfg), qwen_ops.linear_residual_reference(x, w[:40], res),
                 what=f"linear_residual split {split_k}")
    assert_close(kernels.norm_gate_up_silu(x, nw, w, 1e-6, 0.0, cfg=cfg),
                 qwen_ops.norm_gate_up_silu_reference(x, nw, w, 1e-6, 0.0), what=f"gate_up split {split_k}")
    args = qkv_args(3, 160, 2, 1, 16, 16, False, True, True, torch.float32, device)
    check_qkv(kernels.norm_qkv_rope_store(*args, cfg=cfg), args, what=f"qkv split {split_k}")
    assert int(semaphores(torch.device(device)).abs().sum()) == 0, "arrival counters not reset"


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("m", [65, 130])
def test_split_k_with_several_row_blocks(device, m):
    """More rows than one row block (64): each (row block, output tile) has its own arrival
    counter, so the programs of one row block never sum another's slices."""
    f32 = dict(dtype=torch.float32, device=device)
    cfg = kernels.GemvConfig(block_n=16, block_k=32, split_k=2)
    x, nw, res, w = randn(m, 64, **f32), randn(64, **f32), randn(m, 16, **f32), randn(32, 64, **f32, scale=0.1)
    assert_close(kernels.norm_linear(x, nw, w, None, 1e-6, 0.0, cfg=cfg),
                 qwen_ops.norm_linear_reference(x, nw, w, None, 1e-6, 0.0), what=f"norm_linear M{m}")
    assert_close(kernels.linear_residual(x, w[:16], res, cfg=cfg), qwen_ops.linear_residual_reference(x, w[:16], res),
                 what=f"linear_residual M{m}")
    assert_close(kernels.norm_gate_up_silu(x, nw, w, 1e-6, 0.0, cfg=cfg),
                 qwen_ops.norm_gate_up_silu_reference(x, nw, w, 1e-6, 0.0), what=f"norm_gate_up_silu M{m}")
    assert int(semaphores(torch.device(device)).abs().sum()) == 0, "arrival counters not reset"


@pytest.mark.parametrize("device", DEVICES)
def test_qkv_slots_outside_the_cache_are_not_written(device):
    """Slots outside the cache (padding rows: negative, past it, an int64 one that int32 would wrap
    into it) are skipped on every device, as kv_cache_store_slots skips them; q is still computed."""
    args = qkv_args(3, 40, 2, 1, 16, 16, False, False, True, torch.float32, device)
    args[9] = torch.tensor([QKV_SLOTS, -1, 2**32 + 2], device=device)
    check_qkv(torch.ops.qwen.norm_qkv_rope_store(*args), args)


# FP8 weights. (M, K, N): K over three scale blocks (the last partial; slices of 256 under the
# interpreter's config, so the loop's steps) or inside one (prefetched), N not a multiple of 128 (a
# partial row block; gate_up's 2N rows put the gate's last rows and the up half's first in one
# block); on CUDA Qwen3-0.6B's o_proj and down, and partial blocks.
FP8_CASES = {"cpu": [(1, 300, 136), (3, 72, 40)],
             "cuda": [(1, 2048, 1024), (1, 3072, 1024), (1, 1000, 300), (8, 1024, 1024)]}
# norm_qkv_rope_store: on the CPU, heads of 32 over two scale blocks, heads of 80 across block
# boundaries (gated); on CUDA Qwen3-0.6B and Qwen3.5's gated attention.
FP8_QKV = {"cpu": [(2, 200, 4, 2, 32, 32, False, True, False), (3, 136, 2, 1, 80, 40, True, False, True)],
           "cuda": [(1, 1024, 16, 8, 128, 128, False, False, True), (2, 1024, 8, 2, 256, 64, True, False, True)]}


def fp8(weight, scale_dtype=torch.float32):
    """weight in the block FP8 format: (float8_e4m3fn weight, weight_scale_inv in scale_dtype)."""
    w8, scale = quantize_weight_fp8_block(weight)
    return w8, scale.to(scale_dtype)


def fp8_qkv_args(spec, dtype, device):
    """qkv_args with qkv_weight in the block FP8 format, its scales the last argument."""
    args = qkv_args(*spec, dtype, device)
    args[2], scale = fp8(args[2])
    return args + [scale]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_weights(device, dtype):
    """Each op with its weight in the block FP8 format against its reference, which dequantises the
    weight (gate_up's scales in bf16, as some checkpoints hold them)."""
    tol = _tol(dtype, device)
    for m, k, n in FP8_CASES[device]:
        x, nw = randn(m, k, dtype=dtype, device=device), randn(k, dtype=dtype, device=device)
        w, s = fp8(randn(n, k, dtype=torch.float32, device=device, scale=k**-0.5))
        gate_up, gate_up_s = fp8(randn(2 * n, k, dtype=torch.float32, device=device, scale=k**-0.5), torch.bfloat16)
        b, residual = randn(n, dtype=dtype, device=device), randn(m, n, dtype=dtype, device=device)
        poison_allocator(device)
        assert_close(torch.ops.qwen.norm_linear(x, nw, w, b, 1e-6, 1.0, s),
                     qwen_ops.norm_linear_reference(x, nw, w, b, 1e-6, 1.0, s), tol, f"fp8 norm_linear M{m} K{k} N{n}")
        assert_close(torch.ops.qwen.linear_residual(x, w, residual, s),
                     qwen_ops.linear_residual_reference(x, w, residual, s), tol, f"fp8 linear_residual M{m} K{k} N{n}")
        assert_close(torch.ops.qwen.norm_gate_up_silu(x, nw, gate_up, 1e-6, 0.0, gate_up_s),
                     qwen_ops.norm_gate_up_silu_reference(x, nw, gate_up, 1e-6, 0.0, gate_up_s), tol,
                     f"fp8 norm_gate_up_silu M{m} K{k} I{n}")
    for spec in FP8_QKV[device]:
        args = fp8_qkv_args(spec, dtype, device)
        poison_allocator(device)
        check_qkv(torch.ops.qwen.norm_qkv_rope_store(*args), args, tol, f"fp8 norm_qkv_rope_store {spec}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "loop"])
def test_fp8_k_steps_and_splits(device, prefetch, monkeypatch):
    """FP8 weights with K = 300 (three scale blocks, the last partial) in three slices of at most
    128, each loaded ahead or in the pipelined loop's steps of 64 (two a block); and in one slice,
    whose 256-deep steps are cut to 128 (the loop, prefetching or not). The arrival counters are
    back at zero."""
    monkeypatch.setattr(kernels, "PREFETCH", prefetch)
    f32 = dict(dtype=torch.float32, device=device)
    x, nw, residual = randn(3, 300, **f32), randn(300, **f32), randn(3, 40, **f32)
    w, s = fp8(randn(80, 300, **f32, scale=0.1))
    args = fp8_qkv_args((3, 300, 2, 1, 16, 16, False, True, True), torch.float32, device)
    for cfg in (kernels.GemvConfig(block_n=16, block_k=64, split_k=3), kernels.GemvConfig(32, 256, 1)):
        assert_close(kernels.norm_linear(x, nw, w, None, 1e-6, 0.0, s, cfg=cfg),
                     qwen_ops.norm_linear_reference(x, nw, w, None, 1e-6, 0.0, s), what=f"norm_linear {cfg}")
        assert_close(kernels.linear_residual(x, w[:40], residual, s, cfg=cfg),
                     qwen_ops.linear_residual_reference(x, w[:40], residual, s), what=f"linear_residual {cfg}")
        assert_close(kernels.norm_gate_up_silu(x, nw, w, 1e-6, 0.0, s, cfg=cfg),
                     qwen_ops.norm_gate_up_silu_reference(x, nw, w, 1e-6, 0.0, s), what=f"norm_gate_up_silu {cfg}")
        check_qkv(kernels.norm_qkv_rope_store(*args[:-1], args[-1], cfg=cfg), args, what=f"qkv {cfg}")
    assert int(semaphores(torch.device(device)).abs().sum()) == 0, "arrival counters not reset"


def _fp8_samples(device):
    f32 = dict(dtype=torch.float32, device=device)
    x, nw, b, residual = randn(2, 200, **f32), randn(200, **f32), randn(24, **f32), randn(2, 24, **f32)
    w, s = fp8(randn(24, 200, **f32))
    return {"norm_linear": (x, nw, w, b, 1e-6, 1.0, s), "linear_residual": (x, w, residual, s),
            "norm_gate_up_silu": (x, nw, w, 1e-6, 0.0, s),
            "norm_qkv_rope_store": tuple(fp8_qkv_args((2, 40, 4, 2, 16, 16, False, False, True), torch.float32,
                                                      device))}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["norm_linear", "linear_residual", "norm_gate_up_silu", "norm_qkv_rope_store"])
def test_fp8_opcheck(device, name):
    """opcheck of the FP8 calls, without its schema test, which cannot compare float8 inputs
    (`opcheck_without_schema_test`; tests/test_ops_contract.py runs the full opcheck without scales)."""
    opcheck_without_schema_test(getattr(torch.ops.qwen, name).default, _fp8_samples(device)[name])


def test_fp8_bad_input():
    x, nw = torch.randn(2, 8), torch.randn(8)
    w, s = fp8(torch.randn(6, 8))
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.norm_linear: weight is float8_e4m3fn: pass its "
                                                   "weight_scale_inv"):
        torch.ops.qwen.norm_linear(x, nw, w, None, 1e-6, 0.0)
    with pytest.raises(qwen_ops.QwenOpError, match=r"qwen.linear_residual: weight_scale_inv must have shape \(1, 1\)"):
        torch.ops.qwen.linear_residual(x, w, torch.randn(2, 6), torch.ones(2, 1))
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.norm_gate_up_silu: gate_up_weight must be float8_e4m3fn"):
        torch.ops.qwen.norm_gate_up_silu(x, nw, torch.randn(6, 8), 1e-6, 0.0, s)
    args = fp8_qkv_args((2, 40, 4, 2, 16, 16, False, False, True), torch.float32, "cpu")
    args[-1] = args[-1].half()
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.norm_qkv_rope_store: qkv_weight_scale_inv must be float32 "
                                                   "or bfloat16"):
        torch.ops.qwen.norm_qkv_rope_store(*args)


@pytest.mark.parametrize("bad, message", [
    (lambda a: a.__setitem__(2, a[2][:-16]), "qkv_weight has 112 rows"),
    (lambda a: a.__setitem__(14, 3), r"num_heads \(3\) must be a positive multiple"),
    (lambda a: a.__setitem__(13, 18), "rotary_dim must be even"),
    (lambda a: a.__setitem__(5, None), "give both q_norm_weight and k_norm_weight"),
    (lambda a: a.__setitem__(4, torch.randn(32)[::2]), "q_norm_weight must be contiguous"),
    (lambda a: a.__setitem__(3, torch.tensor([1.0]).expand(128)), "qkv_bias must be contiguous"),
    (lambda a: a.__setitem__(0, a[0][None]), "x must have 2 dims"),
    (lambda a: a.__setitem__(7, a[7][:, :8]), "must both be contiguous"),
    (lambda a: a.__setitem__(9, a[9][:1]), r"slot_mapping must have shape \(2,\)"),
    (lambda a: a.__setitem__(8, a[8].float()), "positions must be int32 or int64"),
])
def test_qkv_bad_input(bad, message):
    args = qkv_args(2, 40, 4, 2, 16, 16, False, False, True, torch.float32, "cpu")
    bad(args)
    with pytest.raises(qwen_ops.QwenOpError, match=message):
        torch.ops.qwen.norm_qkv_rope_store(*args)


def test_bad_input():
    x, w = torch.randn(2, 8), torch.randn(6, 8)
    with pytest.raises(qwen_ops.QwenOpError, match="residual must have shape"):
        torch.ops.qwen.linear_residual(x, w, torch.randn(2, 5))
    for leading in ((3, 6), (1, 2, 6), (6,)):  # the right last dim, the wrong rows
        message = re.escape(f"qwen.linear_residual: residual must have shape (2, 6), got {leading}")
        with pytest.raises(qwen_ops.QwenOpError, match=message):
            torch.ops.qwen.linear_residual(x, w, torch.randn(leading))
    with pytest.raises(qwen_ops.QwenOpError, match="even number of rows"):
        torch.ops.qwen.norm_gate_up_silu(x, torch.randn(8), torch.randn(5, 8), 1e-6, 0.0)
    with pytest.raises(qwen_ops.QwenOpError, match="norm_weight has 7 elements"):
        torch.ops.qwen.norm_linear(x, torch.randn(7), w, None, 1e-6, 0.0)
    with pytest.raises(qwen_ops.QwenOpError, match="bias must be contiguous"):  # read with unit stride
        torch.ops.qwen.norm_linear(x, torch.randn(8), w, torch.randn(12)[::2], 1e-6, 0.0)
