"""Property-based tests: every forward op against its reference over drawn shapes, dtypes,
strides, eps, positions and lengths (hypothesis).

Strided inputs are taken as views into wider storage: an op either reads them correctly or
rejects them with a QwenOpError naming the argument; it never returns a wrong answer. CPU runs
the kernels under the Triton interpreter with a small example budget (CI); set
QWEN_HYPOTHESIS_EXAMPLES for a larger one (the GPU run uses 100).
"""
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qwen_ops
from csrc_free_ops.common import cdiv
from qwen_ops import (add_rms_norm_reference, attention_reference, kv_cache_store_slots_reference, linear_reference,
                      linear_residual_reference, norm_gate_up_silu_reference, norm_linear_reference,
                      norm_qkv_rope_store_reference, paged_attention_reference, rms_norm_reference, rope_reference,
                      silu_mul_reference)
from tests.helpers import REL_TOL, assert_close

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
EXAMPLES = int(os.environ.get("QWEN_HYPOTHESIS_EXAMPLES", 100 if ON_GPU else 8))
PROPERTY = settings(max_examples=EXAMPLES, deadline=None, derandomize=not ON_GPU,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

dtypes = st.sampled_from([torch.float32, torch.bfloat16, torch.float16])
eps = st.sampled_from([1e-6, 1e-5, 1e-2])
small = st.integers(1, 3)


def tensor(data, shape, dtype, strided):
    """Random [shape] in dtype; `strided` makes it a view with padded rows (last dim stays contiguous)."""
    if not strided:
        return torch.randn(shape, device=DEVICE).to(dtype)
    pad = data.draw(st.integers(1, 5), label="row padding")
    wide = torch.randn(*shape[:-1], shape[-1] + pad, device=DEVICE).to(dtype)
    return wide[..., pad:]


def tol(dtype):
    # The interpreter truncates on its way to bf16, and the properties reach larger shapes than
    # the fixed cases: one bf16 step wider than helpers.REL_TOL.
    return REL_TOL[dtype] * (2 if dtype == torch.bfloat16 else 1)


@PROPERTY
@given(data=st.data(), rows=small, n=st.integers(1, 300), dtype=dtypes, eps=eps, offset=st.sampled_from([0.0, 1.0]),
       strided=st.booleans())
def test_rms_norm_property(data, rows, n, dtype, eps, offset, strided):
    x = tensor(data, (rows, n), dtype, strided)
    w = torch.randn(n, device=DEVICE).to(dtype)
    assert_close(torch.ops.qwen.rms_norm(x, w, eps, offset), rms_norm_reference(x, w, eps, offset), tol(dtype))
    r = tensor(data, (rows, n), dtype, strided)
    normed, summed = torch.ops.qwen.add_rms_norm(x, r, w, eps, offset)
    ref_normed, ref_summed = add_rms_norm_reference(x, r, w, eps, offset)
    assert_close(summed, ref_summed, tol(dtype))
    assert_close(normed, ref_normed, tol(dtype))


@PROPERTY
@given(data=st.data(), m=st.integers(1, 40), k=st.integers(1, 200), n=st.integers(1, 100), dtype=dtypes,
       bias=st.booleans(), strided=st.booleans())
def test_linear_property(data, m, k, n, dtype, bias, strided):
    x = tensor(data, (m, k), dtype, strided)
    w = tensor(data, (n, k), dtype, strided)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    assert_close(torch.ops.qwen.linear(x, w, b), linear_reference(x, w, b), tol(dtype))


def fused_tol(dtype):
    """The fused decode ops round two or three times in a row (norm, projection, epilogue)."""
    return tol(dtype) * (1.5 if dtype == torch.bfloat16 else 1)


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def assert_within(out, ref, bound, what):
    """|out - ref| <= bound, elementwise (bound: the rounding error each element may carry)."""
    err = (out.float() - ref.float()).abs()
    worst = (err - bound).argmax()
    assert bool((err <= bound).all()), (f"{what}: |out - ref| = {err.flatten()[worst]:.3e} > bound "
                                        f"{bound.flatten()[worst]:.3e} at flat index {worst}")


def projection_error(x_abs, w, out_ref, dtype):
    """What rounding may put into one output of a projection in `dtype`: its operand rounded at
    another point than the reference's (the fused ops round x * (w + offset) before the norm's
    scale, the reference the normed x) costs up to u * |x| @ |W|^T, as does the reference's own
    operand rounding, and each side rounds its output: twice that, for margin. Relative to
    |x| @ |W|^T, not to the output, so a sum that cancels to near zero cannot fail a correct
    kernel (a relative-norm check did, on the GPU, for a 2 x 2 output)."""
    u = UNIT_ROUNDOFF[dtype]
    return 2 * (2 * u * (x_abs @ w.float().abs().t()) + 2 * u * out_ref.float().abs())


@PROPERTY
@given(data=st.data(), m=st.integers(1, 20), k=st.integers(1, 160), n=st.integers(1, 80), dtype=dtypes,
       eps=eps, offset=st.sampled_from([0.0, 1.0]), bias=st.booleans(), strided=st.booleans())
def test_fused_decode_gemv_property(data, m, k, n, dtype, eps, offset, bias, strided):
    torch.manual_seed(data.draw(st.integers(0, 2**31 - 1), label="seed"))
    x = tensor(data, (m, k), dtype, strided)
    nw = torch.randn(k, device=DEVICE).to(dtype)
    w = tensor(data, (2 * n, k), dtype, strided)
    b = torch.randn(2 * n, device=DEVICE).to(dtype) if bias else None
    xn = rms_norm_reference(x.float(), nw.float(), eps, offset).abs()  # the normed operand, unrounded
    y = norm_linear_reference(x, nw, w, b, eps, offset)
    assert_within(torch.ops.qwen.norm_linear(x, nw, w, b, eps, offset), y, projection_error(xn, w, y, dtype),
                  "norm_linear")
    gate_up = norm_linear_reference(x, nw, w, None, eps, offset).float()
    gate, up = gate_up.chunk(2, dim=-1)
    e_gate, e_up = projection_error(xn, w, gate_up, dtype).chunk(2, dim=-1)
    out = norm_gate_up_silu_reference(x, nw, w, eps, offset)
    # silu(g) * u moved by the errors of g and u: |silu'| <= 1.1 and |silu(g)| <= |g| + 0.28
    bound = (1.1 * up.abs() * e_gate + (gate.abs() + 0.28) * e_up + e_gate * e_up
             + 4 * UNIT_ROUNDOFF[dtype] * out.float().abs())
    assert_within(torch.ops.qwen.norm_gate_up_silu(x, nw, w, eps, offset), out, bound, "norm_gate_up_silu")
    r = tensor(data, (m, 2 * n), dtype, strided)
    out = linear_residual_reference(x, w, r)
    assert_within(torch.ops.qwen.linear_residual(x, w, r), out, projection_error(x.float().abs(), w, out, dtype)
                  + 4 * UNIT_ROUNDOFF[dtype] * r.float().abs(), "linear_residual")


@PROPERTY
@given(data=st.data(), n=st.integers(1, 9), hk=st.integers(1, 2), group=st.integers(1, 3),
       d=st.sampled_from([16, 32]), k=st.integers(1, 96), dtype=dtypes, gated=st.booleans(), bias=st.booleans(),
       norm=st.booleans(), offset=st.sampled_from([0.0, 1.0]))
def test_norm_qkv_rope_store_property(data, n, hk, group, d, k, dtype, gated, bias, norm, offset):
    """n rows at drawn positions, stored at drawn distinct slots of a paged cache (padding rows: -1)."""
    hq = hk * group
    rows = (hq * (2 if gated else 1) + 2 * hk) * d
    rot = data.draw(st.sampled_from([r for r in range(2, d + 1, 2)]), label="rotary_dim")
    num_blocks = data.draw(st.integers(1, 2), label="num_blocks")
    slots = data.draw(st.lists(st.integers(0, num_blocks * 16 - 1), min_size=n, max_size=n, unique=True), label="slots")
    padding = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="padding rows")
    slots = torch.tensor([-1 if pad else slot for slot, pad in zip(slots, padding)], device=DEVICE)
    positions = torch.tensor(data.draw(st.lists(st.integers(0, 63), min_size=n, max_size=n), label="positions"),
                             device=DEVICE)
    r = lambda *shape: torch.randn(*shape, device=DEVICE).to(dtype)  # noqa: E731
    args = [r(n, k), r(k), r(rows, k), r(rows) if bias else None, r(d) if norm else None, r(d) if norm else None,
            r(num_blocks, 16, hk, d), r(num_blocks, 16, hk, d), positions, slots, 1e-6, offset, 1e4, rot, hq, gated]
    ref_args = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    assert_close(torch.ops.qwen.norm_qkv_rope_store(*args), norm_qkv_rope_store_reference(*ref_args),
                 fused_tol(dtype))
    assert_close(args[6], ref_args[6], fused_tol(dtype))
    assert_close(args[7], ref_args[7], fused_tol(dtype))


@PROPERTY
@given(data=st.data(), rows=small, inter=st.integers(1, 300), dtype=dtypes, strided=st.booleans())
def test_silu_mul_property(data, rows, inter, dtype, strided):
    gate_up = tensor(data, (rows, 2 * inter), dtype, strided)
    assert_close(torch.ops.qwen.silu_mul(gate_up), silu_mul_reference(gate_up), tol(dtype))


@PROPERTY
@given(data=st.data(), b=small, t=st.integers(1, 5), hk=st.integers(1, 2), group=st.integers(1, 3),
       d=st.sampled_from([16, 32, 64]), dtype=dtypes, norm=st.booleans(), theta=st.sampled_from([1e4, 1e6]),
       offset=st.sampled_from([0.0, 1.0]))
def test_rope_property(data, b, t, hk, group, d, dtype, norm, theta, offset):
    rot = data.draw(st.sampled_from([r for r in (8, 16, 32, 64) if r <= d]), label="rotary_dim")
    hq = hk * group
    qkv = torch.randn(b, t, (hq + 2 * hk) * d, device=DEVICE).to(dtype)  # q and k: views into a fused output
    q, k = qkv[..., : hq * d].view(b, t, hq, d), qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d)
    positions = torch.randint(0, 2048, (b, t), device=DEVICE)
    w = (torch.randn(d, device=DEVICE).to(dtype), torch.randn(d, device=DEVICE).to(dtype)) if norm else (None, None)
    out = torch.ops.qwen.rope(q, k, positions, theta, rot, *w, 1e-6, offset)
    ref = rope_reference(q, k, positions, theta, rot, *w, 1e-6, offset)
    rel = max(tol(dtype), 2e-4)  # angles up to 2048 rad: fp32 agrees to ~1e-4 (see test_ops_rope)
    assert_close(out[0], ref[0], rel)
    assert_close(out[1], ref[1], rel)


@PROPERTY
@given(b=small, sq=st.integers(1, 40), extra=st.integers(0, 30), hk=st.integers(1, 2), group=st.integers(1, 3),
       d=st.sampled_from([16, 32, 64]), dtype=dtypes, causal=st.booleans())
def test_attention_property(b, sq, extra, hk, group, d, dtype, causal):
    sk = sq + extra
    q = torch.randn(b, sq, hk * group, d, device=DEVICE).to(dtype)
    k, v = (torch.randn(b, sk, hk, d, device=DEVICE).to(dtype) for _ in range(2))
    scale = d ** -0.5
    assert_close(torch.ops.qwen.attention(q, k, v, scale, causal), attention_reference(q, k, v, scale, causal),
                 tol(dtype))


@PROPERTY
@given(data=st.data(), b=small, hk=st.integers(1, 2), group=st.integers(1, 3), d=st.sampled_from([16, 32]),
       dtype=dtypes)
def test_paged_cache_store_and_attention_property(data, b, hk, group, d, dtype):
    """A decode step: a few new tokens per sequence (none for some), stored at their slots in
    drawn, shuffled blocks of 16, then attention over the cache; both against their references."""
    qlens = data.draw(st.lists(st.integers(0, 3), min_size=b, max_size=b), label="new tokens")
    lengths = [data.draw(st.integers(max(q, 1), 150), label="seq_len") for q in qlens]
    blocks = [cdiv(n, 16) for n in lengths]
    num_blocks = sum(blocks) + data.draw(st.integers(0, 3), label="spare blocks")
    ids = data.draw(st.permutations(range(num_blocks)), label="block ids")
    table = torch.zeros(b, max(blocks), dtype=torch.int32)
    for i, count in enumerate(blocks):
        table[i, :count] = torch.tensor(ids[sum(blocks[:i]):sum(blocks[:i + 1])])
    seq = torch.repeat_interleave(torch.arange(b), torch.tensor(qlens))
    pos = torch.cat([torch.arange(n - q, n) for q, n in zip(qlens, lengths)])
    slots = (table[seq, pos // 16].long() * 16 + pos % 16).to(DEVICE)
    k_cache, v_cache = (torch.randn(num_blocks, 16, hk, d, device=DEVICE).to(dtype) for _ in range(2))
    k_new, v_new = (torch.randn(len(pos), hk, d, device=DEVICE).to(dtype) for _ in range(2))
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch.ops.qwen.kv_cache_store_slots(k_new, v_new, k_cache, v_cache, slots)
    kv_cache_store_slots_reference(k_new, v_new, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    q = torch.randn(len(pos), hk * group, d, device=DEVICE).to(dtype)
    cu = torch.tensor([0] + torch.tensor(qlens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    args = (q, k_cache, v_cache, cu, torch.tensor(lengths, dtype=torch.int32, device=DEVICE), table.to(DEVICE), 0.3,
            max(qlens))
    assert_close(torch.ops.qwen.paged_attention(*args), paged_attention_reference(*args), tol(dtype))


@pytest.mark.parametrize("op,make", [
    ("rms_norm", lambda: (torch.randn(4, 8, device=DEVICE)[:, ::2], torch.randn(4, device=DEVICE), 1e-6)),
    ("linear", lambda: (torch.randn(3, 8, device=DEVICE).t(), torch.randn(5, 3, device=DEVICE))),
    ("silu_mul", lambda: (torch.randn(3, 8, device=DEVICE)[:, ::2],)),
])
def test_non_unit_last_stride_is_rejected(op, make):
    """A last dim with stride != 1 is rejected with a message naming the argument, never misread."""
    with pytest.raises(qwen_ops.QwenOpError, match="must be contiguous in its last dim"):
        getattr(torch.ops.qwen, op)(*make())
