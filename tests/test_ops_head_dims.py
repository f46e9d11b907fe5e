"""Head dims that are not powers of two (48, 80, 96, 160; every multiple of 16 up to 256 is taken):
each kernel that takes a head dim lays a power-of-two block over it (csrc_free_ops.common.head_block)
and masks the rest. Every such op against its reference, with two traps for the masks:

- inputs are views into storage whose elements past each head's D are NaN, so a load that reads past
  D, or a padded element that reaches a sum (a norm, q.k), makes the output NaN;
- outputs and scratch buffers start as NaN (`nan_outputs`), so an element left unwritten fails;
  the in-place outputs (the paged KV caches, the recurrent state pool: contiguous, so not views of
  padding) are checked in the slots between those written, where a store past the last head's D
  lands: NaN there stays NaN, and finite values there never take the inputs' NaN padding.

CPU: small shapes under the interpreter. `cuda`: full-size shapes at head dims 80, 96 and 160."""
import pytest
import torch

import qwen_ops
from csrc_free_ops import attention as attention_kernels
from csrc_free_ops import gated_delta_rule as gdr_kernels
from qwen_ops import (attention_backward_reference, attention_with_lse_reference, gated_delta_gates_reference,
                      gated_rms_norm_reference, kv_cache_store_slots_reference, paged_attention_reference,
                      recurrent_gated_delta_rule_varlen_reference, rope_backward_reference, rope_reference)
from qwen_ops.gated_delta_rule import gated_delta_recurrence
from tests.helpers import DEVICES, REL_TOL, assert_close, randn
from tests.test_ops_fused_decode import check_qkv, qkv_args
from tests.test_ops_gated_delta_rule import decode_step
from tests.test_ops_paged_attention import paged_batch

ops = torch.ops.qwen
PAD = 16
"""NaN elements after each head's D in the padded inputs."""


@pytest.fixture
def nan_outputs(nan_empty, monkeypatch):
    """nan_empty, extended to torch.empty_like and Tensor.new_empty (the launchers allocate their
    outputs with all three): every float tensor they allocate during the test starts as NaN."""
    for owner, name in ((torch, "empty_like"), (torch.Tensor, "new_empty")):
        def poisoned(*args, _allocate=getattr(owner, name), **kwargs):
            t = _allocate(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t

        monkeypatch.setattr(owner, name, poisoned)


def padded(t: torch.Tensor, dims: int = 1) -> torch.Tensor:
    """t as a view into NaN-filled storage PAD elements longer in each of its last `dims` dims."""
    storage = torch.full((*t.shape[:-dims], *(n + PAD for n in t.shape[-dims:])), float("nan"), dtype=t.dtype,
                         device=t.device)
    view = storage[(..., *(slice(0, n) for n in t.shape[-dims:]))]
    view.copy_(t)
    return view


def prand(*shape, dtype, device, scale=1.0):
    return padded(randn(*shape, dtype=dtype, device=device, scale=scale))


DTYPES = {"cpu": [torch.float32, torch.bfloat16], "cuda": [torch.bfloat16, torch.float16, torch.float32]}
BACKWARD_DTYPES = {"cpu": [torch.float32], "cuda": [torch.bfloat16, torch.float32]}
"""attention_backward's, as tests/test_training_ops.py's."""
# (batch, Sq, Sk, q heads, kv heads, head_dim)
ATTENTION = {"cpu": [(1, 37, 53, 4, 2, 48), (2, 20, 20, 2, 1, 80), (1, 9, 17, 2, 2, 96), (1, 5, 7, 2, 1, 160)],
             "cuda": [(2, 1000, 1000, 16, 8, 80), (1, 2048, 2048, 16, 8, 96), (2, 300, 700, 8, 2, 160),
                      (4, 255, 255, 14, 2, 80)]}


def _attention_inputs(b, sq, sk, hq, hk, d, dtype, device):
    return (prand(b, sq, hq, d, dtype=dtype, device=device), prand(b, sk, hk, d, dtype=dtype, device=device),
            prand(b, sk, hk, d, dtype=dtype, device=device))


@pytest.mark.parametrize("device,dtype", [
    pytest.param(device, dtype, id=f"{str(dtype)[6:]}-{device}", marks=[pytest.mark.cuda] if device == "cuda" else [])
    for device, dtypes in DTYPES.items() for dtype in dtypes])
def test_attention_forward_and_backward(device, dtype, nan_outputs):
    """attention, attention_with_lse and attention_backward (with the forward's lse and a gradient
    reaching it, and with lse recomputed)."""
    torch.manual_seed(0)
    for b, sq, sk, hq, hk, d in ATTENTION[device]:
        q, k, v = _attention_inputs(b, sq, sk, hq, hk, d, dtype, device)
        scale = d ** -0.5
        for causal in (True, False):
            what = f"{dtype} b{b} sq{sq} sk{sk} hq{hq} hk{hk} d{d} causal={causal}"
            ref_o, ref_lse = attention_with_lse_reference(q, k, v, scale, causal)
            o, lse = ops.attention_with_lse(q, k, v, scale, causal)
            assert_close(o, ref_o, what="attention_with_lse o " + what)
            assert_close(lse, ref_lse, what="attention_with_lse lse " + what)
            assert_close(ops.attention(q, k, v, scale, causal), ref_o, what="attention " + what)
            if dtype not in BACKWARD_DTYPES[device]:
                continue
            do = prand(b, sq, hq, d, dtype=dtype, device=device)
            dlse = randn(b, hq, sq, dtype=torch.float32, device=device)
            o = padded(o)
            ref = attention_backward_reference(do, q, k, v, o, lse, scale, causal, dlse)
            recomputed = attention_backward_reference(do, q, k, v, o, None, scale, causal)
            for how, lse_in, dlse_in, want in (("saved", lse, dlse, ref), ("recomputed", None, None, recomputed)):
                got = ops.attention_backward(do, q, k, v, o, lse_in, scale, causal, dlse_in)
                for name, a, r in zip(("dq", "dk", "dv"), got, want):
                    assert_close(a, r, what=f"attention_backward {name} (lse {how}) {what}")


@pytest.mark.launcher
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [48, 80])
def test_attention_unmasked_steps(device, d, nan_outputs):
    """Tiles small enough that the forward and both backward kernels walk key and query blocks that
    need no sequence or causal mask, where the head dim's mask is the only one."""
    Tiles = attention_kernels.Tiles
    b, sq, sk, hq, hk = (1, 40, 70, 2, 1) if device == "cpu" else (2, 700, 900, 16, 8)
    q, k, v = _attention_inputs(b, sq, sk, hq, hk, d, torch.float32, device)
    do = prand(b, sq, hq, d, dtype=torch.float32, device=device)
    blocks = attention_kernels.BwdBlocks(Tiles(16, 32, 4, 1), Tiles(16, 16, 4, 1))
    for causal in (True, False):
        ref_o, lse = attention_with_lse_reference(q, k, v, 0.25, causal)
        o = attention_kernels.attention(q, k, v, 0.25, causal, tiles=Tiles(16, 16, 4, 1))
        assert_close(o, ref_o, what=f"forward d{d} causal={causal}")
        ref = attention_backward_reference(do, q, k, v, padded(o), lse, 0.25, causal)
        got = attention_kernels.attention_backward(do, q, k, v, padded(o), lse, 0.25, causal, blocks=blocks)
        for name, a, r in zip(("dq", "dk", "dv"), got, ref):
            assert_close(a, r, what=f"backward {name} d{d} causal={causal}")


# (q heads, kv heads, head_dim, new tokens per sequence, cached lengths): decode rows (one tile per
# sequence) over a block table reaching two or more KV splits, so the combine runs
DECODE = {"cpu": [(4, 2, 48, [2, 2, 2], [70, 2, 33]), (2, 1, 80, [1, 1], [70, 41]), (2, 2, 96, [1], [70]),
                  (2, 1, 160, [3], [40])],
          "cuda": [(16, 8, 80, [1] * 4, [4096, 1000, 17, 3000]), (16, 8, 96, [4, 4], [777, 500]),
                   (8, 2, 160, [1, 1], [2048, 1500])]}


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_decode(device, nan_outputs):
    """Decode rows of q in padded storage over paged caches whose slots outside the sequences are NaN."""
    torch.manual_seed(1)
    for dtype in DTYPES[device]:
        for hq, hk, d, qlens, lens in DECODE[device]:
            q, *rest = paged_batch(16, hq, hk, d, qlens, lens, dtype, device)
            q = padded(q)
            out = ops.paged_attention(q, *rest, d ** -0.5, max(qlens))
            assert_close(out, paged_attention_reference(q, *rest, d ** -0.5, max(qlens)),
                         what=f"paged_attention {dtype} heads {hq}/{hk} d{d} qlens {qlens} lens {lens}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("d", [48, 80])
def test_kv_cache_store_slots(device, d, nan_outputs):
    """Keys and values in NaN-padded storage into finite caches at every other slot, a padding row
    (slot -1) among them: a store past the last head's D (of the NaN padding or anything else)
    shows in the slot after a written one."""
    n, num_blocks, hk = (5, 1, 2) if device == "cpu" else (1024, 256, 8)
    k, v = (prand(n, hk, d, dtype=torch.bfloat16, device=device) for _ in range(2))
    slots = 2 * torch.randperm(num_blocks * 8, device=device)[:n]
    slots[1] = -1
    k_cache, v_cache = (randn(num_blocks, 16, hk, d, dtype=torch.bfloat16, device=device) for _ in range(2))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ops.kv_cache_store_slots(k, v, k_cache, v_cache, slots)
    kv_cache_store_slots_reference(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# (batch, tokens, q heads, kv heads, head_dim, rotary_dim): Qwen3.5's partial rotary is a quarter
ROPE = {"cpu": [(1, 3, 2, 1, 48, 48), (1, 3, 2, 2, 48, 12), (2, 2, 2, 1, 80, 20), (1, 2, 2, 1, 80, 80),
                (1, 2, 2, 1, 96, 96), (1, 2, 1, 1, 160, 40)],
        "cuda": [(4, 255, 16, 8, 80, 20), (2, 256, 14, 2, 96, 96), (1, 1000, 8, 2, 160, 40), (2, 300, 16, 8, 80, 80)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qk_norm"])
def test_rope_forward_and_backward(device, qk_norm, nan_outputs):
    """The fused per-head norm divides by the real D; RoPE pairs dim i with i + R/2 inside R."""
    torch.manual_seed(2)
    for dtype in DTYPES[device]:
        for b, t, hq, hk, d, rot in ROPE[device]:
            q, k = prand(b, t, hq, d, dtype=dtype, device=device), prand(b, t, hk, d, dtype=dtype, device=device)
            positions = torch.randint(0, 4096, (b, t), device=device)
            norm = (randn(d, dtype=dtype, device=device), randn(d, dtype=dtype, device=device)) if qk_norm \
                else (None, None)
            what = f"{dtype} b{b} t{t} hq{hq} hk{hk} d{d} rot{rot}"
            tol = 3e-4 if dtype == torch.float32 else None  # angles to 4096 rad: see test_ops_rope
            out = ops.rope(q, k, positions, 1e6, rot, *norm, norm_eps=1e-6)
            ref = rope_reference(q, k, positions, 1e6, rot, *norm, norm_eps=1e-6)
            for name, got, want in zip(("q", "k"), out, ref):
                assert_close(got, want, tol, what=f"rope {name} {what}")
            dq, dk = prand(b, t, hq, d, dtype=dtype, device=device), prand(b, t, hk, d, dtype=dtype, device=device)
            grads = ops.rope_backward(dq, dk, q, k, positions, 1e6, rot, *norm, 1e-6, 0.0)
            ref_grads = rope_backward_reference(dq, dk, q, k, positions, 1e6, rot, *norm, 1e-6, 0.0)
            names = ("dq", "dk", "d q_norm_weight", "d k_norm_weight")[:4 if qk_norm else 2]
            for name, got, want in zip(names, grads, ref_grads):
                # the weight gradients sum over every (token, head): looser in 16 bits
                assert_close(got, want, tol if name in ("dq", "dk") or dtype == torch.float32 else 2e-2,
                             what=f"rope_backward {name} {what}")


# (N, K, Hq, Hk, D, rotary_dim, gated, bias, qk_norm)
QKV = {"cpu": [(2, 72, 2, 1, 48, 48, False, True, True), (2, 32, 2, 1, 80, 20, True, False, True),
               (1, 48, 2, 2, 96, 96, False, True, False), (1, 130, 2, 1, 160, 40, True, False, True)],
       "cuda": [(1, 1024, 16, 8, 80, 80, False, False, True), (8, 896, 14, 2, 96, 96, False, True, False),
                (2, 1024, 8, 2, 160, 40, True, False, True), (32, 1024, 16, 8, 80, 20, True, False, True)]}


@pytest.mark.parametrize("device", DEVICES)
def test_norm_qkv_rope_store(device, nan_outputs):
    """The fused decode QKV: a tile of head_block(D) rows per head, those past D neither read nor
    stored; q (and the gate) and the cache rows it writes match the references, nothing else of the
    NaN caches (the slot after each written one included) changes. On CPU K = 72 and 130 split K in
    two, and the 160-dim heads (a 256-row tile) take the pipelined loop instead of the weight
    prefetch."""
    torch.manual_seed(3)
    for dtype in DTYPES[device]:
        tol = REL_TOL[dtype] * (3 if dtype == torch.bfloat16 and device == "cpu" else 1)  # as test_ops_fused_decode
        for spec in QKV[device]:
            args = qkv_args(*spec, dtype, device)
            check_qkv(ops.norm_qkv_rope_store(*args), args, tol, f"norm_qkv_rope_store {spec} {dtype}")


# (B, T, Hk, Hv, Dk, Dv): two chunks and a partial one, grouped value heads, Dk != Dv
GDN_CHUNK = {"cpu": [(1, 70, 1, 2, 48, 80), (1, 65, 1, 1, 80, 48), (1, 20, 1, 1, 96, 160)],
             "cuda": [(1, 2048, 16, 16, 80, 80), (2, 1000, 16, 32, 96, 160), (1, 700, 4, 8, 48, 80)]}
GDN_RECURRENT = {"cpu": [(2, 1, 1, 2, 48, 48), (2, 1, 1, 2, 48, 80), (1, 3, 2, 2, 80, 48), (1, 1, 1, 1, 160, 96)],
                 "cuda": [(8, 1, 16, 32, 80, 80), (2, 3, 16, 16, 96, 160), (4, 1, 16, 16, 160, 96)]}
"""The packed recurrent op's: B sequences of T tokens."""
GDN_TOL = {torch.bfloat16: 3e-2, torch.float16: 4e-3, torch.float32: 2e-5}
"""As test_ops_gated_delta_rule's CHUNK_TOL on CPU (bf16 products and intermediates)."""


def _gdn_inputs(b, t, hk, hv, dk, dv, dtype, device):
    """Padded q, k, v, the raw gate projections a, b, A_log, dt_bias (Qwen3.5-like ranges), and
    (g, beta) from them."""
    q, k = prand(b, t, hk, dk, dtype=dtype, device=device), prand(b, t, hk, dk, dtype=dtype, device=device)
    v = prand(b, t, hv, dv, dtype=dtype, device=device)
    a, braw = randn(b, t, hv, dtype=dtype, device=device), randn(b, t, hv, dtype=dtype, device=device)
    a_log = torch.empty(hv, device=device).uniform_(0.02, 0.5).log()
    dt_bias = randn(hv, dtype=torch.float32, device=device, scale=0.5)
    return q, k, v, a, braw, a_log, dt_bias, gated_delta_gates_reference(a, braw, a_log, dt_bias)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value_block", [None, 32], ids=["default-blocks", "value-blocks-of-32"])
def test_chunk_gated_delta_rule(device, value_block, monkeypatch, nan_outputs):
    """Against the token recurrence in float64, with an initial state. value_block 32: the value
    columns split over programs of 32 (the interpreter otherwise gives one program all of them), so
    Dv = 80 and 48 end in a block half of padding (the first two shapes)."""
    if value_block:
        monkeypatch.setattr(gdr_kernels, "_value_block", lambda dk, dv, programs, target: value_block)
        monkeypatch.setattr(gdr_kernels, "_output_value_block", lambda dv: value_block)
    torch.manual_seed(4)
    for dtype in DTYPES[device]:
        for shape in GDN_CHUNK[device][:2] if value_block else GDN_CHUNK[device]:
            b, t, hk, hv, dk, dv = shape
            q, k, v, a, braw, a_log, dt_bias, (g, beta) = _gdn_inputs(*shape, dtype, device)
            h0 = padded(randn(b, hv, dk, dv, dtype=torch.float32, device=device), 2)
            ref_o, ref_s = gated_delta_recurrence(q, k, v, g, beta, dk ** -0.5, h0, True, dtype=torch.float64)
            final = h0  # a strided view: the state is updated in place all the same
            o = ops.chunk_gated_delta_rule(q, k, v, g, beta, dk ** -0.5, final, use_qk_l2norm=True)
            tol = GDN_TOL[dtype] if device == "cpu" else {torch.bfloat16: 1.2e-2}.get(dtype, GDN_TOL[dtype])
            assert_close(o, ref_o, tol, what=f"chunk o {shape} {dtype}")
            assert_close(final, ref_s, tol, what=f"chunk final state {shape} {dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value_block", [None, 32], ids=["default-blocks", "value-blocks-of-32"])
def test_recurrent_gated_delta_rule_varlen(device, value_block, monkeypatch, nan_outputs):
    """The packed decode step updates its pool slots in place. The pool is contiguous, so between
    the slots it uses lie slots of NaN, which a read or a store past the last head's Dk or Dv
    reaches."""
    if value_block:
        monkeypatch.setattr(gdr_kernels, "_value_block", lambda dk, dv, programs, target: value_block)
    torch.manual_seed(5)
    for dtype in DTYPES[device]:
        for shape in GDN_RECURRENT[device]:
            b, t, hk, hv, dk, dv = shape
            q, k, v, a, braw, a_log, dt_bias, _ = _gdn_inputs(*shape, dtype, device)
            q, k, v, a, braw = (x.flatten(0, 1) for x in (q, k, v, a, braw))
            pool = torch.full((2 * b + 1, hv, dk, dv), float("nan"), device=device)
            pool[1::2] = randn(b, hv, dk, dv, dtype=torch.float32, device=device)
            cu, _, cont = decode_step(b, t, device)
            slots = 2 * torch.arange(b, device=device) + 1
            pool_ref = pool.clone()
            o = ops.recurrent_gated_delta_rule_varlen(q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont,
                                                      dk ** -0.5, True)
            ref = recurrent_gated_delta_rule_varlen_reference(q, k, v, a, braw, a_log, dt_bias, pool_ref, cu, slots,
                                                              cont, dk ** -0.5, True)
            assert_close(o, ref, what=f"recurrent o {shape} {dtype}")
            assert_close(pool[1::2], pool_ref[1::2], 2e-3 if dtype == torch.bfloat16 else 2e-5,
                         what=f"recurrent state {shape}")
            assert pool[0::2].isnan().all(), f"the recurrent step stored past Dk or Dv {shape}"


@pytest.mark.parametrize("device", DEVICES)
def test_gated_rms_norm(device, nan_outputs):
    """The gated norm over a Gated DeltaNet value head divides by the real Dv."""
    torch.manual_seed(6)
    for dtype in DTYPES[device]:
        tol = REL_TOL[dtype] * (3 if dtype == torch.bfloat16 and device == "cpu" else 1)  # as test_ops_gated_delta_rule
        for shape in ([(3, 2, 48), (5, 80), (2, 160)] if device == "cpu" else [(2048, 16, 80), (7, 3, 160)]):
            x, z = prand(*shape, dtype=dtype, device=device, scale=3.0), prand(*shape, dtype=dtype, device=device)
            w = randn(shape[-1], dtype=dtype, device=device)
            assert_close(ops.gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_reference(x, z, w, 1e-6), tol,
                         what=f"gated_rms_norm {shape} {dtype}")


@pytest.mark.parametrize("d, ok", [(16, True), (48, True), (80, True), (160, True), (256, True), (0, False),
                                   (8, False), (40, False), (272, False), (512, False)])
def test_head_dim_rule(d, ok):
    """The one rule (qwen_ops.checks.HEAD_DIMS): multiples of 16 up to 256; other head dims are one
    line naming the op and the head dim."""
    q = torch.randn(1, 2, 2, d)
    if ok:
        assert_close(ops.attention(q, q[:, :, :1], q[:, :, :1], 0.5), attention_with_lse_reference(
            q, q[:, :, :1], q[:, :, :1], 0.5)[0], what=f"head_dim {d}")
    else:
        with pytest.raises(qwen_ops.QwenOpError, match=rf"^qwen\.attention: head_dim {d} is not supported "
                                                        r"\(supported: multiples of 16 up to 256\)$"):
            ops.attention(q, q[:, :, :1], q[:, :, :1], 0.5)
