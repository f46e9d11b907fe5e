"""Backward of every trainable op: float64 gradcheck (reference path), the Triton backward kernels
against autograd through the `*_reference` functions (CPU: fp32 under the interpreter, tiny shapes;
cuda: bf16 and fp32 at realistic shapes), opcheck with requires_grad inputs, determinism, and a
compiled (fullgraph) forward + backward."""
import math
import os
import subprocess
import sys

import pytest
import torch

import qwen_ops
from csrc_free_ops import attention as attn_kernels
from csrc_free_ops import cross_entropy as ce_kernels
from qwen_ops import (add_rms_norm_reference, attention_reference, linear_cross_entropy_reference, linear_reference,
                      rms_norm_reference, rope_reference, silu_mul_reference)
from qwen_ops.cross_entropy import linear_cross_entropy_with_lse_reference
from qwen_ops import attention_backward_reference, attention_with_lse_reference, silu_mul_split_reference
from tests.helpers import DEVICES, SANITIZING, assert_close, gpu_memory_lock, poison_allocator, randn

ops = torch.ops.qwen
F64 = dict(dtype=torch.float64)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads(fn, inputs, douts):
    """Gradients of sum(out * dout) w.r.t. the floating inputs that require grad."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    pairs = [(o, d) for o, d in zip(outs, douts) if d is not None]
    return outs, torch.autograd.grad([o for o, _ in pairs], leaves, [d for _, d in pairs])


def _check_against_reference(op_fn, ref_fn, inputs, tol=None, what=""):
    """Run op and reference forward + backward on the same leaves and compare outputs and gradients."""
    leaves = [_leaf(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    poison_allocator(next(t for t in leaves if isinstance(t, torch.Tensor)).device.type)
    out = op_fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    douts = [randn(*o.shape, dtype=o.dtype, device=o.device) if o.dim() else torch.randn((), device=o.device).to(o.dtype)
             for o in out]
    _, g = _grads(op_fn, leaves, douts)
    ref, g_ref = _grads(ref_fn, leaves, douts)
    for i, (o, r) in enumerate(zip(out, ref)):
        assert_close(o, r.to(o.dtype), tol, what=f"{what} output {i}")
    for i, (a, b) in enumerate(zip(g, g_ref)):
        assert_close(a, b, tol, what=f"{what} grad {i}")


# ---------------------------------------------------------------------------------------------
# float64 gradcheck: the backward ops' reference formulas against finite differences
# ---------------------------------------------------------------------------------------------

def _gc(fn, *inputs):
    leaves = [_leaf(t) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs]
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_rms_norm():
    _gc(lambda x, w: ops.rms_norm(x, w, 1e-6, 0.0), torch.randn(3, 8, **F64), torch.randn(8, **F64))
    _gc(lambda x, w: ops.rms_norm(x, w, 1e-5, 1.0), torch.randn(2, 3, 8, **F64), torch.randn(8, **F64))


def test_gradcheck_add_rms_norm():
    _gc(lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6, 0.0), torch.randn(3, 8, **F64), torch.randn(3, 8, **F64),
        torch.randn(8, **F64))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_gradcheck_rope(qk_norm):
    pos = torch.tensor([[0, 3, 7], [1, 2, 50]])
    ws = (torch.randn(16, **F64), torch.randn(16, **F64)) if qk_norm else ()
    _gc(lambda q, k, *w: ops.rope(q, k, pos, 1e4, 8, *w, norm_eps=1e-6, norm_offset=0.5),
        torch.randn(2, 3, 2, 16, **F64), torch.randn(2, 3, 1, 16, **F64), *ws)


def test_gradcheck_silu_mul():
    _gc(ops.silu_mul, torch.randn(3, 10, **F64))
    _gc(ops.silu_mul_split, torch.randn(3, 5, **F64), torch.randn(3, 5, **F64))


@pytest.mark.parametrize("bias", [False, True])
def test_gradcheck_linear(bias):
    b = (torch.randn(6, **F64),) if bias else ()
    _gc(ops.linear, torch.randn(2, 3, 5, **F64), torch.randn(6, 5, **F64), *b)


@pytest.mark.parametrize("sq,sk,causal", [(5, 5, True), (3, 6, True), (4, 6, False)])
def test_gradcheck_attention(sq, sk, causal):
    q, k, v = torch.randn(1, sq, 4, 16, **F64), torch.randn(1, sk, 2, 16, **F64), torch.randn(1, sk, 2, 16, **F64)
    _gc(lambda q, k, v: ops.attention(q, k, v, 0.3, causal), q, k, v)
    _gc(lambda q, k, v: ops.attention_with_lse(q, k, v, 0.3, causal), q, k, v)  # lse's gradient too


def test_gradcheck_linear_cross_entropy():
    targets = torch.tensor([0, 4, -100, 2, 6, -100, 1])
    _gc(lambda h, w: ops.linear_cross_entropy(h, w, targets), torch.randn(7, 5, **F64), torch.randn(7, 5, **F64))
    other = torch.tensor([0, 4, 4, 2, 6, 3, 1])
    _gc(lambda h, w: ops.linear_cross_entropy(h, w, other, 4), torch.randn(7, 5, **F64), torch.randn(7, 5, **F64))
    # lse is an output with a gradient of its own
    _gc(lambda h, w: ops.linear_cross_entropy_with_lse(h, w, targets), torch.randn(7, 5, **F64), torch.randn(7, 5, **F64))


# ---------------------------------------------------------------------------------------------
# Triton backward kernels vs autograd through the references
# ---------------------------------------------------------------------------------------------

def _dtypes(device):
    return [torch.float32] if device == "cpu" else [torch.bfloat16, torch.float32]


def _cases(table, device):
    """A case table's shapes for `device`; under compute-sanitizer (QWEN_SANITIZER=1) only the last
    GPU case, the smallest, with sizes that are not multiples of any block (racecheck slows the
    large ones past a 10-minute device call)."""
    return table[device][-1:] if SANITIZING and device == "cuda" else table[device]


NORM_SHAPES = {"cpu": [(5, 48), (2, 3, 100)], "cuda": [(4096, 1024), (3, 333, 896), (17, 4096)]}


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_backward_kernels(device):
    for dtype in _dtypes(device):
        for shape in NORM_SHAPES[device]:
            x = randn(*shape, dtype=dtype, device=device, scale=2.0)
            w = randn(shape[-1], dtype=dtype, device=device)
            for offset in (0.0, 1.0):
                _check_against_reference(lambda x, w: ops.rms_norm(x, w, 1e-6, offset),
                                         lambda x, w: rms_norm_reference(x, w, 1e-6, offset),
                                         [x, w], what=f"rms_norm {shape} {dtype} offset {offset}")
            r = randn(*shape, dtype=dtype, device=device)
            _check_against_reference(lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6),
                                     lambda x, r, w: add_rms_norm_reference(x, r, w, 1e-6),
                                     [x, r, w], what=f"add_rms_norm {shape} {dtype}")


ROPE_CASES = {  # (batch, tokens, q heads, kv heads, head_dim, rotary_dim)
    "cpu": [(2, 3, 4, 2, 16, 16), (1, 5, 2, 1, 32, 8)],
    "cuda": [(4, 512, 16, 8, 128, 128), (2, 300, 14, 2, 64, 64), (1, 100, 8, 2, 256, 64)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_backward_kernels(device, qk_norm):
    for dtype in _dtypes(device):
        for b, t, hq, hk, d, rot in ROPE_CASES[device]:
            qkv = randn(b, t, (hq + 2 * hk) * d, dtype=dtype, device=device)
            q = qkv[..., : hq * d].view(b, t, hq, d)  # strided views, as the model produces them
            k = qkv[..., hq * d:(hq + hk) * d].view(b, t, hk, d)
            pos = torch.randint(0, 4096, (b, t), device=device)
            ws = [randn(d, dtype=dtype, device=device), randn(d, dtype=dtype, device=device)] if qk_norm else []
            tol = 3e-4 if dtype == torch.float32 else None  # large angles: see test_ops_rope
            _check_against_reference(lambda q, k, *w: ops.rope(q, k, pos, 1e6, rot, *w, norm_eps=1e-6),
                                     lambda q, k, *w: rope_reference(q, k, pos, 1e6, rot, *w, norm_eps=1e-6),
                                     [q, k, *ws], tol, what=f"rope {b, t, hq, hk, d, rot} {dtype}")


ACT_SHAPES = {"cpu": [(3, 40), (2, 3, 24)], "cuda": [(4096, 6144), (3, 100, 9728)]}


@pytest.mark.parametrize("device", DEVICES)
def test_silu_mul_backward_kernels(device):
    for dtype in _dtypes(device):
        for shape in ACT_SHAPES[device]:
            gu = randn(*shape, dtype=dtype, device=device, scale=2.0)
            _check_against_reference(ops.silu_mul, silu_mul_reference, [gu], what=f"silu_mul {shape} {dtype}")
            half = (*shape[:-1], shape[-1] // 2)
            g, u = randn(*half, dtype=dtype, device=device), randn(*half, dtype=dtype, device=device)
            _check_against_reference(ops.silu_mul_split, silu_mul_split_reference, [g, u],
                                     what=f"silu_mul_split {half} {dtype}")


LINEAR_CASES = {"cpu": [(7, 40, 24), (33, 20, 36)], "cuda": [(8192, 1024, 4096), (4000, 3072, 1024), (300, 896, 1536)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_backward_kernels(device, bias):
    for dtype in _dtypes(device):
        for m, k, n in _cases(LINEAR_CASES, device):
            x = randn(m, k, dtype=dtype, device=device)
            w = randn(n, k, dtype=dtype, device=device, scale=k ** -0.5)
            args = [x, w] + ([randn(n, dtype=dtype, device=device)] if bias else [])
            _check_against_reference(ops.linear, linear_reference, args, what=f"linear {m, k, n} {dtype}")


ATTN_CASES = {  # (batch, Sq, Sk, q heads, kv heads, head_dim)
    "cpu": [(1, 5, 5, 2, 1, 16), (2, 20, 33, 4, 2, 32), (1, 17, 17, 2, 2, 64)],
    "cuda": [(4, 1024, 1024, 16, 8, 128), (1, 255, 255, 14, 2, 64), (2, 300, 700, 8, 2, 128), (1, 200, 200, 8, 2, 256)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_attention_backward_kernels(device, causal):
    for dtype in _dtypes(device):
        for b, sq, sk, hq, hk, d in _cases(ATTN_CASES, device):
            q = randn(b, sq, hq, d, dtype=dtype, device=device)
            k = randn(b, sk, hk, d, dtype=dtype, device=device)
            v = randn(b, sk, hk, d, dtype=dtype, device=device)
            scale = 1 / math.sqrt(d)
            what = f"attention {b, sq, sk, hq, hk, d} {dtype} causal={causal}"
            _check_against_reference(lambda q, k, v: ops.attention(q, k, v, scale, causal),
                                     lambda q, k, v: attention_reference(q, k, v, scale, causal), [q, k, v], what=what)
            _check_against_reference(lambda q, k, v: ops.attention_with_lse(q, k, v, scale, causal),
                                     lambda q, k, v: attention_with_lse_reference(q, k, v, scale, causal), [q, k, v],
                                     what=what + " with lse")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("sq,sk", [(64, 64), (37, 53), (48, 80)])
def test_attention_backward_block_split(device, causal, sq, sk):
    """The kernels' masked / unmasked steps: small explicit tiles, so that every program walks several
    blocks, some crossing the diagonal or a sequence end and some not (Sq, Sk multiples of the tiles
    or not, Sk > Sq), with a gradient reaching lse."""
    Tiles = attn_kernels.Tiles
    for dtype in _dtypes(device):
        q = randn(1, sq, 4, 16, dtype=dtype, device=device)
        k, v = randn(1, sk, 2, 16, dtype=dtype, device=device), randn(1, sk, 2, 16, dtype=dtype, device=device)
        do, dlse = randn(1, sq, 4, 16, dtype=dtype, device=device), randn(1, 4, sq, dtype=torch.float32, device=device)
        o, lse = attention_with_lse_reference(q, k, v, 0.25, causal)
        ref = attention_backward_reference(do, q, k, v, o, lse, 0.25, causal, dlse)
        for dkdv, dq in (((16, 32), (16, 16)), ((32, 16), (16, 32))):
            blocks = attn_kernels.BwdBlocks(Tiles(*dkdv, 4, 1), Tiles(*dq, 4, 1))
            got = attn_kernels.attention_backward(do, q, k, v, o, lse.float(), 0.25, causal, dlse, blocks=blocks)
            for name, a, b in zip(("dq", "dk", "dv"), got, ref):
                assert_close(a, b, what=f"{name} Sq={sq} Sk={sk} causal={causal} {dtype} {blocks}")


LCE_CASES = {"cpu": [(30, 24, 50), (9, 16, 7)], "cuda": [(8192, 1024, 151936), (1000, 896, 5000), (260, 200, 1000)]}


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_kernels(device):
    """The fp32 reference of the vocabulary-sized case holds its [8192, 151936] logits several
    times over (about 20 GB with the backward): such tests take turns on a GPU (bench.cuda_suite)."""
    with gpu_memory_lock():
        for dtype in _dtypes(device):
            for n, h, v in _cases(LCE_CASES, device):
                hid = randn(n, h, dtype=dtype, device=device)
                w = randn(v, h, dtype=dtype, device=device, scale=h ** -0.5)
                t = torch.randint(0, v, (n,), device=device)
                t[::5] = -100
                tol = 2e-2 if dtype == torch.bfloat16 else None

                def ref(hh, ww):
                    return linear_cross_entropy_reference(hh, ww, t)

                _check_against_reference(lambda hh, ww: ops.linear_cross_entropy(hh, ww, t), ref, [hid, w], tol,
                                         what=f"linear_cross_entropy {n, h, v} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_chunks_slices_ignore_and_lse(device, monkeypatch):
    """Several forward row chunks and backward vocabulary slices (small byte budgets), int32 targets,
    a custom ignore_index, a gradient reaching lse; all-ignored gives a NaN loss (like torch) and
    zero gradients; strided targets."""
    n, h, v = 150, 16, 70
    monkeypatch.setattr(ce_kernels, "PARTIALS_BYTES", 1)  # one GEMM row tile per chunk (64 rows on the CPU)
    monkeypatch.setattr(ce_kernels, "SLICE_BYTES", n * 4 * 16)  # 16 vocabulary columns per slice
    hid, w = randn(n, h, dtype=torch.float32, device=device), randn(v, h, dtype=torch.float32, device=device)
    t = torch.randint(0, v, (n,), device=device, dtype=torch.int32)
    t[3:9] = 7
    _check_against_reference(lambda a, b: ops.linear_cross_entropy_with_lse(a, b, t, 7),
                             lambda a, b: linear_cross_entropy_with_lse_reference(a, b, t, 7), [hid, w],
                             what="chunked lce with lse")
    all_ignored = torch.full((n,), -100, device=device)
    hl, wl = _leaf(hid), _leaf(w)
    loss = ops.linear_cross_entropy(hl, wl, all_ignored)
    loss.backward()
    assert torch.isnan(loss) and not hl.grad.any() and not wl.grad.any()
    loss = ops.linear_cross_entropy(hid, w, t)
    assert_close(loss, linear_cross_entropy_reference(hid, w, t), what="lce")
    wide = torch.stack([t, torch.zeros_like(t)], dim=1)  # targets as a column: stride 2
    assert_close(ops.linear_cross_entropy(hid, w, wide[:, 0]), loss, what="lce with strided targets")


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_backward_checks_grad_loss_grad_lse_and_lse(device):
    """Called directly, the backward op takes lse and grad_lse as any [N] float tensors (strided
    ones too: the kernel gets them contiguous) and refuses others with an error naming them, where
    a short lse would have been read past its end and a strided one read as if contiguous."""
    n, h, v = 5, 16, 12
    hid, w = randn(n, h, dtype=torch.float32, device=device), randn(v, h, dtype=torch.float32, device=device)
    t = torch.tensor([1, -100, 0, 11, 5], device=device)
    _, lse = ops.linear_cross_entropy_with_lse(hid, w, t, -100)
    one, grad_lse = torch.tensor(1.0, device=device), randn(n, dtype=torch.float32, device=device)
    strided = lambda x: torch.stack([x, torch.full_like(x, 1e4)], dim=1)[:, 0]  # noqa: E731  (stride 2)
    got = ops.linear_cross_entropy_backward(one, strided(grad_lse), hid, w, t, strided(lse), -100, True, True)
    want = qwen_ops.linear_cross_entropy_backward_reference(one, grad_lse, hid, w, t, lse, -100, True, True)
    for g, r, name in zip(got, want, ("dhidden", "dweight")):
        assert_close(g, r, what=f"{name} with strided lse and grad_lse")
    bad = {"lse": (one, None, lse[:3]), "grad_lse": (one, grad_lse[:, None], lse),
           "grad_loss": (torch.ones(2, device=device), None, lse)}
    for name, (gl, gs, ls) in bad.items():
        with pytest.raises(qwen_ops.QwenOpError, match=rf"qwen\.linear_cross_entropy_backward: {name} must"):
            ops.linear_cross_entropy_backward(gl, gs, hid, w, t, ls, -100, True, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "reference"])
def test_linear_cross_entropy_rejects_targets_outside_the_vocabulary_on_cpu(dtype):
    """A target that is neither ignore_index nor in [0, V) raises one error naming targets, on the
    kernel path (fp32 under the interpreter) and the reference path (float64) alike, forward and backward."""
    hid, w = torch.randn(4, 8, dtype=dtype), torch.randn(10, 8, dtype=dtype)
    message = r"qwen\.linear_cross_entropy: targets must lie in \[0, 10\) .* ignore_index=-100, got {} at row 2"
    for bad in (10, -1, -101):
        t = torch.tensor([1, -100, bad, 9])
        with pytest.raises(qwen_ops.QwenOpError, match=message.format(bad)):
            ops.linear_cross_entropy(hid, w, t)
        with pytest.raises(qwen_ops.QwenOpError, match=message.format(bad)):
            ops.linear_cross_entropy_backward(torch.tensor(1.0, dtype=dtype), None, hid, w, t,
                                              torch.zeros(4, dtype=dtype), -100, True, True)
    assert torch.isfinite(ops.linear_cross_entropy(hid, w, torch.tensor([1, -100, 0, 9])))


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_kernels_make_targets_outside_the_vocabulary_nan(device):
    """The launchers (CUDA runs them without a value check: it would cost a host sync) turn the loss
    NaN for a target outside [0, V), and the gradients it reaches: that row of dhidden and all of
    dweight; the reference does the same. A plausible loss averaged over the other rows would hide it."""
    n, h, v = 6, 16, 12
    hid, w = randn(n, h, dtype=torch.float32, device=device), randn(v, h, dtype=torch.float32, device=device)
    for bad in (v, -1, 3 * v):
        t = torch.tensor([1, -100, bad, 0, 11, 5], device=device)
        loss, lse = ce_kernels.linear_cross_entropy(hid, w, t, -100)
        ref_loss, ref_lse = linear_cross_entropy_with_lse_reference(hid, w, t, -100)
        assert torch.isnan(loss) and torch.isnan(ref_loss), f"target {bad}: loss {loss}, reference {ref_loss}"
        assert_close(lse, ref_lse, what=f"lse with target {bad}")
        one = torch.tensor(1.0, device=device)
        dh, dw = ce_kernels.linear_cross_entropy_backward(one, None, hid, w, t, lse, -100, True, True)
        ref_dh, ref_dw = qwen_ops.linear_cross_entropy_backward_reference(one, None, hid, w, t, ref_lse, -100,
                                                                          True, True)
        for name, got, want in (("dhidden", dh, ref_dh), ("dweight", dw, ref_dw)):
            assert torch.equal(got.isnan(), want.isnan()), f"{name} with target {bad}: NaN in other places"
        assert dh[2].isnan().all() and not dh[[0, 1, 3, 4, 5]].isnan().any() and dw.isnan().all()


# ---------------------------------------------------------------------------------------------
# Contract: opcheck with requires_grad inputs, determinism, compile
# ---------------------------------------------------------------------------------------------

def _train_samples(device):
    f32 = dict(dtype=torch.float32, device=device)
    r = lambda *s: randn(*s, **f32).requires_grad_(True)  # noqa: E731
    pos = torch.tensor([[0, 1, 2], [4, 5, 9]], device=device)
    q, k, v = r(2, 3, 4, 16), r(2, 3, 2, 16), r(2, 3, 2, 16)
    t = torch.tensor([1, 5, -100, 2], device=device)
    return {
        "rms_norm": (r(3, 40), r(40), 1e-6, 0.0),
        "add_rms_norm": (r(3, 40), r(3, 40), r(40), 1e-6, 1.0),
        "rope": (q, k, pos, 1e4, 16, r(16), r(16), 1e-6, 0.0),
        "rope_plain": (q, k, pos, 1e4, 8),
        "silu_mul": (r(3, 24),),
        "silu_mul_split": (r(3, 12), r(3, 12)),
        "linear": (r(3, 20), r(12, 20), r(12)),
        "attention": (q, k, v, 0.25, True),
        "attention_with_lse": (q, k, v, 0.25, False),
        "linear_cross_entropy_with_lse": (r(4, 16), r(8, 16), t, -100),
        "linear_cross_entropy_backward": (torch.tensor(0.7, device=device), randn(4, **f32), randn(4, 16, **f32),
                                          randn(8, 16, **f32), t, randn(4, **f32), -100, True, False),
        "rms_norm_backward": (randn(3, 40, **f32), randn(3, 40, **f32), randn(40, **f32), 1e-6, 0.0, randn(3, 40, **f32)),
        "rope_backward": (randn(2, 3, 4, 16, **f32), randn(2, 3, 2, 16, **f32), q.detach(), k.detach(), pos, 1e4, 16,
                          randn(16, **f32), randn(16, **f32), 1e-6, 0.0),
        "silu_mul_backward": (randn(3, 12, **f32), randn(3, 24, **f32)),
        "silu_mul_split_backward": (randn(3, 12, **f32), randn(3, 12, **f32), randn(3, 12, **f32)),
        "linear_backward": (randn(3, 12, **f32), randn(3, 20, **f32), randn(12, 20, **f32), True, True, True),
        "attention_backward": (randn(2, 3, 4, 16, **f32), q.detach(), k.detach(), v.detach(), randn(2, 3, 4, 16, **f32),
                               None, 0.25, True, None),
    }


TRAIN_OPS = list(_train_samples("cpu"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", TRAIN_OPS)
def test_opcheck_training(device, name):
    op = getattr(ops, name.removesuffix("_plain")).default
    torch.library.opcheck(op, _train_samples(device)[name])


@pytest.mark.parametrize("device", DEVICES)
def test_backward_is_deterministic(device):
    """Same inputs, same gradients bit for bit (partial-sum reductions in a fixed order, no atomics)."""
    big = device == "cuda"
    x = randn(4096 if big else 9, 1024 if big else 48, dtype=torch.bfloat16, device=device)
    w = randn(x.shape[-1], dtype=torch.bfloat16, device=device)
    q = randn(2, 512 if big else 20, 16 if big else 4, 64 if big else 16, dtype=torch.bfloat16, device=device)
    k = randn(2, q.shape[1], 2, q.shape[3], dtype=torch.bfloat16, device=device)

    def grads():
        leaves = [_leaf(t) for t in (x, w, q, k)]
        y = ops.rms_norm(leaves[0], leaves[1], 1e-6)
        o = ops.attention(leaves[2], leaves[3], leaves[3], 0.125, True)
        torch.autograd.backward([y, o], [torch.ones_like(y), torch.ones_like(o)])
        return [t.grad for t in leaves]

    for a, b in zip(grads(), grads()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_training_step(device):
    """Every trainable op in one compiled loss function (fullgraph), backward included, same grads as eager."""
    f32 = dict(dtype=torch.float32, device=device)
    d, hq, hk, hidden, inter, vocab = 16, 4, 2, 32, 24, 40
    params = {
        "norm": randn(hidden, **f32), "qkv": randn((hq + 2 * hk) * d, hidden, **f32, scale=0.2),
        "qn": randn(d, **f32), "kn": randn(d, **f32), "o": randn(hidden, hq * d, **f32, scale=0.2),
        "norm2": randn(hidden, **f32), "gu": randn(2 * inter, hidden, **f32, scale=0.2),
        "g2": randn(inter, hidden, **f32, scale=0.2), "down": randn(hidden, inter, **f32, scale=0.2),
        "head": randn(vocab, hidden, **f32, scale=0.2),
    }
    x0 = randn(2, 6, hidden, **f32)
    pos = torch.arange(6, device=device).expand(2, 6)
    targets = torch.randint(0, vocab, (12,), device=device)

    def loss_fn(p, x):
        h = ops.rms_norm(x, p["norm"], 1e-6)
        qkv = ops.linear(h, p["qkv"])
        q = qkv[..., : hq * d].view(2, 6, hq, d)
        k = qkv[..., hq * d:(hq + hk) * d].view(2, 6, hk, d)
        v = qkv[..., (hq + hk) * d:].view(2, 6, hk, d)
        q, k = ops.rope(q, k, pos, 1e4, d, p["qn"], p["kn"], 1e-6)
        a = ops.attention(q, k, v, 0.25, True) + ops.attention_with_lse(q, k, v, 0.25, True)[0]
        h, res = ops.add_rms_norm(ops.linear(a.reshape(2, 6, hq * d), p["o"]), x, p["norm2"], 1e-6)
        m = ops.silu_mul(ops.linear(h, p["gu"])) + ops.silu_mul_split(ops.linear(h, p["g2"]), ops.linear(h, p["g2"]))
        out = res + ops.linear(m, p["down"])
        return ops.linear_cross_entropy(out.reshape(12, hidden), p["head"], targets)

    def run(fn):
        leaves = {k: _leaf(v) for k, v in params.items()}
        x = _leaf(x0)
        loss = fn(leaves, x)
        loss.backward()
        return loss, [x.grad] + [leaves[k].grad for k in params]

    eager_loss, eager_grads = run(loss_fn)
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager" if device == "cpu" else "inductor")
    loss, grads = run(compiled)
    assert_close(loss, eager_loss, what="compiled loss")
    for name, a, b in zip(["x"] + list(params), grads, eager_grads):
        assert_close(a, b, what=f"compiled grad {name}")


def _model_shape_case(name):
    """(op function, bf16 inputs) of one trainable op at Qwen3-0.6B training shapes (4 x 2048 tokens)."""
    bf = dict(dtype=torch.bfloat16, device="cuda")
    b, s, hidden, hq, hk, d, inter, vocab = 4, 2048, 1024, 16, 8, 128, 3072, 151936
    x = randn(b, s, hidden, **bf)
    w = randn(hidden, **bf, scale=0.1) + 1
    if name == "rms_norm":
        return lambda x, w: ops.rms_norm(x, w, 1e-6), [x, w]
    if name == "add_rms_norm":
        return lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6), [x, randn(b, s, hidden, **bf), w]
    if name == "rope":
        pos = torch.arange(s, device="cuda").expand(b, s)
        return (lambda q, k, qn, kn: ops.rope(q, k, pos, 1e6, d, qn, kn, 1e-6),
                [randn(b, s, hq, d, **bf), randn(b, s, hk, d, **bf), randn(d, **bf) + 1, randn(d, **bf) + 1])
    if name == "attention":
        return (lambda q, k, v: ops.attention(q, k, v, d ** -0.5, True),
                [randn(b, s, hq, d, **bf), randn(b, s, hk, d, **bf), randn(b, s, hk, d, **bf)])
    if name == "silu_mul":
        return ops.silu_mul, [randn(b, s, 2 * inter, **bf)]
    if name == "linear":
        return ops.linear, [x, randn(2 * inter, hidden, **bf, scale=hidden ** -0.5)]
    targets = torch.randint(0, vocab, (b * s,), device="cuda")
    targets[::7] = -100
    return (lambda h, w: ops.linear_cross_entropy(h, w, targets),  # 38 vocabulary slices in the backward
            [x.reshape(b * s, hidden), randn(vocab, hidden, **bf, scale=hidden ** -0.5)])


def _patched_layer_case():
    """One layer of a transformers Qwen3 of the 0.6B shape, patched with our ops: the LM loss of
    4 x 2048 tokens as a function of its parameters (the setup `bench.train` compiles)."""
    import transformers

    from modeling import patch_transformers
    from modeling.model.random_checkpoint import QWEN3_0_6B

    fields = {k: v for k, v in QWEN3_0_6B.items() if k != "model_type"}
    config = transformers.Qwen3Config(**{**fields, "num_hidden_layers": 1}, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16)
    patch_transformers(model)
    ids = torch.randint(0, config.vocab_size, (4, 2048), device="cuda")
    names, params = zip(*model.named_parameters())

    def loss(*values):
        return torch.func.functional_call(model, dict(zip(names, values)), (), {"input_ids": ids, "labels": ids}).loss
    return loss, [p.detach() for p in params]


def _compare_compiled_backward(name):
    """Compiled vs eager gradients of sum(op(...) * probe) for one `_model_shape_case` (or of the
    patched layer's loss)."""
    fn, inputs = _patched_layer_case() if name == "patched_qwen3_layer" else _model_shape_case(name)
    leaves = [_leaf(t) for t in inputs]
    out = fn(*leaves)
    out = out if isinstance(out, tuple) else (out,)
    probes = [randn(*o.shape, dtype=o.dtype, device=o.device) for o in out]

    def loss(*args):
        outs = fn(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum((o.float() * p.float()).sum() for o, p in zip(outs, probes))

    eager = torch.autograd.grad(loss(*leaves), leaves)
    compiled = torch.autograd.grad(torch.compile(loss, fullgraph=True)(*leaves), leaves)
    tol = 5e-2 if name == "patched_qwen3_layer" else 2e-2  # a whole layer: Inductor fuses its glue in bf16
    for i, (a, e) in enumerate(zip(compiled, eager)):
        assert_close(a, e, tol, what=f"{name} compiled grad {i}")


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["rms_norm", "add_rms_norm", "rope", "attention", "silu_mul", "linear",
                                  "linear_cross_entropy", "patched_qwen3_layer"])
def test_compiled_backward_at_model_shapes(name):
    """Each trainable op's forward + backward under torch.compile (Inductor launches the traced
    kernels) at the shapes of a Qwen3-0.6B training step, and one patched transformers layer's
    loss, against the same eager: the compiled graphs of the small tests above hold one vocabulary
    slice, one query block per head, and no buffer Inductor pads. In a subprocess: a device fault
    leaves a process's CUDA context unusable."""
    if SANITIZING:
        pytest.skip("model shapes: under compute-sanitizer each op's tests run at their small sizes")
    if name == "patched_qwen3_layer":
        pytest.importorskip("transformers")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with gpu_memory_lock():  # model shapes: one such test at a time on a GPU (bench.cuda_suite)
        proc = subprocess.run([sys.executable, "-c", f"from tests.test_training_ops import _compare_compiled_backward "
                               f"as c; c({name!r})"], cwd=root, capture_output=True, text=True, timeout=600,
                              env={**os.environ,
                                   "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n" + "\n".join(proc.stderr.splitlines()[-25:])


def test_backward_bad_input_raises():
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.linear_cross_entropy: targets must have shape"):
        ops.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(3, dtype=torch.long))
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.linear_cross_entropy: weight is"):
        ops.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.rms_norm_backward: dy"):
        ops.rms_norm_backward(torch.randn(3, 8), torch.randn(2, 8), torch.randn(8), 1e-6)
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.silu_mul_split: gate"):
        ops.silu_mul_split(torch.randn(3, 8), torch.randn(3, 7))


def test_ops_without_a_backward_refuse_inputs_that_need_grad():
    """An op with no backward raises (on either CPU path and under fake tensors) when grad mode is on
    and an input requires grad, instead of letting that input's gradient silently miss it; under
    no_grad it runs, and ops with a backward differentiate. A Qwen3.5 model's loss, which needs
    such ops, says so rather than returning zero gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from modeling import QwenConfig
    from modeling.model.random_checkpoint import random_model

    x, g = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16)
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.sigmoid_mul: has no backward, and an input requires grad"):
        ops.sigmoid_mul(x, g)
    with pytest.raises(qwen_ops.QwenOpError, match="qwen.sigmoid_mul: has no backward"):
        ops.sigmoid_mul(g, x)
    with FakeTensorMode(), pytest.raises(qwen_ops.QwenOpError, match="qwen.sigmoid_mul: has no backward"):
        ops.sigmoid_mul(torch.empty(3, 16, requires_grad=True), torch.empty(3, 16))
    with torch.no_grad():
        torch.testing.assert_close(ops.sigmoid_mul(x, g), x * torch.sigmoid(g))
    ops.rms_norm(x, torch.ones(16), 1e-6).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    config = QwenConfig.from_dict(dict(model_type="qwen3_5_text", vocab_size=64, hidden_size=32, intermediate_size=48,
                                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                       linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]))
    model = random_model(config, dtype=torch.float32).requires_grad_(True)
    ids = torch.randint(0, 64, (1, 8))
    with pytest.raises(qwen_ops.QwenOpError, match="has no backward"):
        model.loss(ids)
    with torch.no_grad():
        assert torch.isfinite(model.loss(ids))
        with pytest.raises(ValueError, match=r"loss takes input_ids \[B, T\] .*got input_ids \(8,\)"):
            model.loss(ids[0])


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
def test_strided_matmul_split_k_and_accumulate(device):
    """The generic GEMM behind linear / fused-CE backward: transposed operands, K split into
    slices reduced in a fixed order, and accumulation into an fp32 output."""
    from csrc_free_ops.common import mm

    m, k, n = (20, 300, 24) if device == "cpu" else (64, 4099, 128) if SANITIZING else (512, 151936, 1024)
    a = randn(k, m, dtype=torch.float32, device=device).t()  # transposed view
    b = randn(n, k, dtype=torch.float32, device=device).t()
    ref = a.double() @ b.double()
    tol = 1e-5 if device == "cpu" else 1e-4  # fp32 sums over K = 152K on the GPU
    for splits in (None, 1, 3, 7):
        out = torch.full((m, n), float("nan"), device=device)
        assert_close(mm(a, b, out, splits=splits), ref.float(), tol, what=f"mm splits={splits}")
    acc = torch.ones(m, n, device=device)
    assert_close(mm(a, b, acc, accumulate=True), (ref + 1).float(), tol, what="mm accumulate")
    for splits in (1, 3):  # into rows [3, 3 + m) of a taller output, the rows around it untouched
        tall = torch.full((m + 5, n), float("nan"), device=device)
        mm(a, b, tall, splits=splits, out_row0=3)
        assert_close(tall[3:3 + m], ref.float(), tol, what=f"mm out_row0 splits={splits}")
        assert tall[:3].isnan().all() and tall[3 + m:].isnan().all(), f"mm out_row0 splits={splits} wrote outside its rows"
