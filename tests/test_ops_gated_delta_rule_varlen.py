"""qwen::chunk_gated_delta_rule with cu_seqlens and qwen::recurrent_gated_delta_rule_varlen: Gated DeltaNet
over packed sequences with a state pool (an engine step's prefill chunks and decode tokens in one
call). Sequence lengths 0 (graph padding: its padding slot untouched), 1, 63, 64, 65, 130 (chunk
edges, a sequence over three chunks), fresh and continuing states, grouped value heads, Dk != Dv
and head dims that are not powers of two, with and without the q/k l2 norm, against a float64
token-by-token recurrence per sequence, the ops' references and the fixed-length chunked op;
opcheck, errors, CUDA graph replay with new lengths."""
import pytest
import torch

import qwen_ops  # noqa: F401
from csrc_free_ops import gated_delta_rule as gdr_kernels
from qwen_ops import QwenOpError
from qwen_ops.gated_delta_rule import (chunk_gated_delta_rule_reference, gated_delta_gates_reference,
                                       recurrent_gated_delta_rule_varlen_reference)
from qwen_ops.registry import kernel_calls
from tests.helpers import DEVICES, DTYPES, SANITIZING, assert_close, padded, poison_allocator, randn
from tests.test_ops_gated_delta_rule import CHUNK_TOL, recurrence_fp64

# (lengths, Hk, Hv, Dk, Dv)
CHUNK_CASES = {
    "cpu": [([0, 1, 63, 64, 65, 130, 0, 2], 1, 2, 16, 32), ([5, 0, 70], 2, 2, 48, 16)],
    "cuda": [([2048, 1, 1, 700, 0, 65, 130, 1, 3], 16, 32, 128, 128), ([64, 1, 1000, 63, 0], 16, 16, 128, 128),
             ([300, 0, 65], 2, 4, 64, 32)],  # the last: value heads of 32 columns
}


def _packed(lens, hk, hv, dk, dv, dtype, device, seed=0, normalized_keys=True):
    """Inputs of S packed sequences as the model makes them (q, k, v slices of one activation), the
    gates, a pool of S + 1 states (the last one the padding slot, where the length-0 sequences
    point), slots in random order and continues flags (every other sequence, and every length-1 one:
    decode tokens). Keys of norm about 1 without `normalized_keys` (for use_qk_l2norm=False)."""
    torch.manual_seed(seed)
    n, s = sum(lens), len(lens)
    qkv = randn(n, 2 * hk * dk + hv * dv, dtype=dtype, device=device)
    if not normalized_keys:
        qkv[:, hk * dk:2 * hk * dk] *= dk ** -0.5
    q = qkv[:, :hk * dk].view(n, hk, dk)
    k = qkv[:, hk * dk:2 * hk * dk].view(n, hk, dk)
    v = qkv[:, 2 * hk * dk:].view(n, hv, dv)
    a, braw = randn(n, hv, dtype=dtype, device=device), randn(n, hv, dtype=dtype, device=device)
    a_log = torch.empty(hv, device=device).uniform_(0.02, 0.5).log()
    dt_bias = randn(hv, dtype=torch.float32, device=device, scale=0.5)
    pool = randn(s + 1, hv, dk, dv, dtype=torch.float32, device=device, scale=0.3)
    lens_t = torch.tensor(lens, device=device)
    slots = torch.randperm(s, device=device)
    slots[lens_t == 0] = s
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cont = (torch.arange(s, device=device) % 2 == 0) | (lens_t == 1)
    return q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont


def _per_sequence_fp64(q, k, v, g, beta, scale, pool, cu, slots, cont, use_qk_l2norm=True):
    """(o [N, Hv, Dv], final states {slot: state}) in float64, sequence by sequence."""
    outs, finals = [], {}
    for i in range(slots.shape[0]):
        lo, hi, slot = int(cu[i]), int(cu[i + 1]), int(slots[i])
        if hi == lo:
            continue
        h0 = pool[slot:slot + 1] if cont[i] else None
        o, s = recurrence_fp64(q[None, lo:hi], k[None, lo:hi], v[None, lo:hi], g[None, lo:hi], beta[None, lo:hi],
                               scale, h0, use_qk_l2norm)
        outs.append(o[0])
        finals[slot] = s[0]
    return torch.cat(outs), finals


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunk_varlen_matches_fp64_recurrence(device, dtype, nan_empty):
    tol = CHUNK_TOL[device][dtype]
    for lens, hk, hv, dk, dv in CHUNK_CASES[device]:
        q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont = _packed(lens, hk, hv, dk, dv, dtype, device)
        g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
        before = pool.clone()
        scale = dk ** -0.5
        poison_allocator(device)
        calls = kernel_calls["chunk_gated_delta_rule"]
        o = torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, scale, pool, cu, slots, cont, True)
        assert kernel_calls["chunk_gated_delta_rule"] == calls + 1, "the Triton kernel did not run"
        assert o.shape == v.shape and o.dtype == dtype and o.is_contiguous()
        what = f"lengths {lens}, heads {hk}/{hv}, dims {dk}/{dv}"
        assert torch.equal(pool[-1], before[-1]), f"{what}: the padding slot was written"
        if SANITIZING:
            assert torch.isfinite(o).all() and torch.isfinite(pool).all()
            continue
        ref_o, finals = _per_sequence_fp64(q, k, v, g, beta, scale, before, cu, slots, cont)
        assert_close(o, ref_o, tol, what=f"o, {what}")
        for slot, s in finals.items():
            assert_close(pool[slot], s, tol, what=f"final state of slot {slot}, {what}")
        if device == "cpu":
            ref_pool = before.clone()
            op_ref = chunk_gated_delta_rule_reference(q, k, v, g, beta, scale, ref_pool, cu, slots, cont, True)
            assert_close(o, op_ref.double(), tol, what=f"o vs the op reference, {what}")
            assert_close(pool, ref_pool, tol, what=f"pool vs the op reference, {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_varlen_equals_the_fixed_length_op(device):
    """Each packed sequence gives what chunk_gated_delta_rule on fixed lengths gives it alone (same
    chunks, same kernels: equal to rounding), from its slot's state or from zeros."""
    lens, hk, hv, dk, dv = CHUNK_CASES[device][0]
    q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont = _packed(lens, hk, hv, dk, dv, torch.float32, device, 1)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    before = pool.clone()
    o = torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, 0.3, pool, cu, slots, cont, True)
    for i, n in enumerate(lens):
        lo, slot = int(cu[i]), int(slots[i])
        if n == 0:
            continue
        rows = slice(lo, lo + n)
        state = before[slot:slot + 1].clone() if cont[i] else torch.zeros_like(before[slot:slot + 1])
        want = torch.ops.qwen.chunk_gated_delta_rule(q[None, rows], k[None, rows], v[None, rows], g[None, rows],
                                                     beta[None, rows], 0.3, state, use_qk_l2norm=True)
        assert_close(o[rows], want[0], 1e-6, what=f"sequence {i} (length {n})")
        assert_close(pool[slot], state[0], 1e-6, what=f"sequence {i}'s state")


@pytest.mark.parametrize("device", DEVICES)
def test_chunk_varlen_several_value_blocks(device, monkeypatch, nan_empty):
    """Value columns over four programs of 16 in the state and output kernels."""
    monkeypatch.setattr(gdr_kernels, "_value_block", lambda dk, dv, programs, target: 16)
    monkeypatch.setattr(gdr_kernels, "_output_value_block", lambda dv: 16)
    lens = [66, 0, 3]
    q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont = _packed(lens, 1, 2, 16, 64, torch.float32, device, 2)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    before = pool.clone()
    o = torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, 0.25, pool, cu, slots, cont, True)
    ref_o, finals = _per_sequence_fp64(q, k, v, g, beta, 0.25, before, cu, slots, cont)
    tol = CHUNK_TOL[device][torch.float32]
    assert_close(o, ref_o, tol, what="o over four value blocks")
    for slot, s in finals.items():
        assert_close(pool[slot], s, tol, what=f"state of slot {slot} over four value blocks")


# Decode steps (one token per sequence) with a padding sequence, and a few tokens per sequence.
RECURRENT_CASES = {"cpu": [([1, 1, 0, 1, 3], 1, 2, 16, 32), ([1, 0, 2], 2, 2, 48, 16)],
                   "cuda": [([1] * 8, 16, 32, 128, 128), ([1, 0, 1, 1, 2, 0, 1], 16, 16, 128, 128),
                            ([3, 3], 16, 16, 128, 128), ([1, 1, 0, 1, 3], 1, 2, 32, 32), ([1, 2], 2, 2, 64, 16)]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_recurrent_varlen_matches_reference(device, dtype, use_qk_l2norm, nan_empty):
    for lens, hk, hv, dk, dv in RECURRENT_CASES[device]:
        q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont = _packed(lens, hk, hv, dk, dv, dtype, device, 3,
                                                                          normalized_keys=use_qk_l2norm)
        before, ref_pool = pool.clone(), pool.clone()
        calls = kernel_calls["recurrent_gated_delta_rule_varlen"]
        o = torch.ops.qwen.recurrent_gated_delta_rule_varlen(q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont,
                                                             dk ** -0.5, use_qk_l2norm)
        assert kernel_calls["recurrent_gated_delta_rule_varlen"] == calls + 1, "the Triton kernel did not run"
        ref = recurrent_gated_delta_rule_varlen_reference(q, k, v, a, braw, a_log, dt_bias, ref_pool, cu, slots, cont,
                                                          dk ** -0.5, use_qk_l2norm)
        what = f"lengths {lens}, heads {hk}/{hv}, dims {dk}/{dv}, l2norm {use_qk_l2norm}"
        assert o.dtype == dtype and o.shape == v.shape
        # The gates and the recurrence are fp32 in both; bf16 beta and o roundings differ on CPU
        # (the interpreter truncates), so bf16 gets its usual tolerance there.
        assert_close(o, ref, what=f"recurrent varlen o, {what}")
        assert_close(pool, ref_pool, 2e-3 if dtype == torch.bfloat16 else 2e-5, what=f"recurrent varlen pool, {what}")
        assert torch.equal(pool[-1], before[-1]), f"{what}: the padding slot was written"
        g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
        ref_o, finals = _per_sequence_fp64(q, k, v, g, beta, dk ** -0.5, before, cu, slots, cont, use_qk_l2norm)
        assert_close(o, ref_o, CHUNK_TOL[device][dtype], what=f"recurrent varlen o vs fp64, {what}")
        for slot, state in finals.items():
            assert_close(pool[slot], state, CHUNK_TOL[device][dtype], what=f"state of slot {slot} vs fp64, {what}")


@pytest.mark.parametrize("device", DEVICES)
def test_decode_tokens_agree_through_either_op(device):
    """A step of decode tokens (and one fresh 1-token prompt) gives the same outputs and states through
    the recurrent op (decode-only steps) as through the chunked one (mixed steps)."""
    lens = [1, 1, 1, 0, 1] if device == "cpu" else [1] * 16
    shape = (1, 2, 16, 32) if device == "cpu" else (16, 32, 128, 128)
    q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont = _packed(lens, *shape, torch.float32, device, 4)
    cont[-1] = False
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    pool2 = pool.clone()
    o1 = torch.ops.qwen.recurrent_gated_delta_rule_varlen(q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont,
                                                          0.25, True)
    o2 = torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, 0.25, pool2, cu, slots, cont, True)
    assert_close(o1, o2, 1e-5, what="decode tokens: recurrent vs chunked")
    assert_close(pool, pool2, 1e-5, what="decode tokens' states: recurrent vs chunked")


def _samples(device):
    q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont = _packed([3, 0, 1, 2], 1, 2, 16, 16, torch.float32,
                                                                      device, 5)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)
    return {
        "chunk_gated_delta_rule": [(q, k, v, g, beta, 0.25, pool, cu, slots, cont, True),
                                   (q, k, v, g, beta, 0.25, pool, cu, slots, cont)],
        "recurrent_gated_delta_rule_varlen": [(q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont, 0.25)],
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "recurrent_gated_delta_rule_varlen"])
def test_opcheck(device, name):
    for args in _samples(device)[name]:
        torch.library.opcheck(getattr(torch.ops.qwen, name).default, args)


def test_compile_fullgraph():
    s = _samples("cpu")
    q, k, v, g, beta, _, pool, cu, slots, cont = s["chunk_gated_delta_rule"][0][:10]
    a, braw, a_log, dt_bias = s["recurrent_gated_delta_rule_varlen"][0][3:7]

    def f(q, k, v, g, beta, pool):
        o = torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, 0.25, pool, cu, slots, cont, True)
        return o + torch.ops.qwen.recurrent_gated_delta_rule_varlen(q, k, v, a, braw, a_log, dt_bias, pool, cu, slots,
                                                                    cont, 0.25)

    p1, p2 = pool.clone(), pool.clone()
    want = f(q, k, v, g, beta, p1)
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(q, k, v, g, beta, p2)
    assert_close(got, want, what="compiled output")
    assert_close(p2, p1, what="compiled pool")


def _bad(name, **over):
    n, s = 5, 2
    args = dict(q=padded(n, 1, 16), k=padded(n, 1, 16), v=padded(n, 2, 16))
    if name == "chunk_gated_delta_rule":
        args.update(g=-torch.rand(n, 2), beta=torch.rand(n, 2))
    else:
        args.update(a=torch.randn(n, 2), b=torch.randn(n, 2), A_log=torch.randn(2), dt_bias=torch.randn(2))
    args.update(state_pool=padded(3, 2, 16, 16), cu=torch.tensor([0, 2, n], dtype=torch.int32),
                slots=torch.tensor([0, 1]), cont=torch.tensor([True, False]), scale=0.25)
    args.update(over)
    if name == "chunk_gated_delta_rule":  # scale before the state and the packed arguments
        return tuple(args[n] for n in ("q", "k", "v", "g", "beta", "scale", "state_pool", "cu", "slots", "cont"))
    return tuple(args.values())


THREE_SEQS_DECREASING = dict(cu=torch.tensor([0, 4, 2, 5], dtype=torch.int32), slots=torch.tensor([0, 1, 2]),
                             cont=torch.tensor([True, False, True]))
"""Sequences whose rows go back (each within the N = 5 rows, so a kernel given them stays in bounds)."""

ERRORS = [
    ("chunk_gated_delta_rule", dict(q=torch.randn(1, 5, 1, 16)), "q must have 3 dims"),
    ("chunk_gated_delta_rule", dict(q=torch.randn(5, 2, 16), k=torch.randn(5, 2, 16), v=torch.randn(5, 3, 16)),
     "multiple of k's 2"),
    ("chunk_gated_delta_rule", dict(g=torch.randn(5, 3)), "g must have shape"),
    ("chunk_gated_delta_rule", dict(state_pool=torch.zeros(3, 2, 16, 32)), r"state must have shape \[P, Hv, Dk, Dv\]"),
    ("chunk_gated_delta_rule", dict(state_pool=torch.zeros(3, 2, 16, 16, dtype=torch.bfloat16)),
     "state must be torch.float32"),
    ("chunk_gated_delta_rule", dict(state_pool=torch.zeros(2, 3, 16, 16).transpose(0, 1)),
     "state must be contiguous"),
    ("chunk_gated_delta_rule", dict(state_pool=None), r"packed sequences \(cu_seqlens\) need state"),
    ("chunk_gated_delta_rule", dict(slots=None), r"packed sequences \(cu_seqlens\) need state_slots"),
    ("chunk_gated_delta_rule", dict(cu=torch.tensor([0, 2, 4], dtype=torch.int32)), "cu_seqlens must rise"),
    ("chunk_gated_delta_rule", dict(slots=torch.tensor([0, 3])), r"state_slots must lie in \[0, 3\)"),
    ("chunk_gated_delta_rule", dict(slots=torch.tensor([-1, 0])), r"state_slots must lie in \[0, 3\)"),
    ("chunk_gated_delta_rule", THREE_SEQS_DECREASING, r"cu_seqlens must rise .*\[0, 4, 2, 5\]"),
    ("recurrent_gated_delta_rule_varlen", dict(slots=torch.tensor([0, 3])), r"state_slots must lie in \[0, 3\)"),
    ("recurrent_gated_delta_rule_varlen", dict(cu=torch.tensor([0, 2, 4], dtype=torch.int32)), "cu_seqlens must rise"),
    ("recurrent_gated_delta_rule_varlen", THREE_SEQS_DECREASING, r"cu_seqlens must rise .*\[0, 4, 2, 5\]"),
    ("chunk_gated_delta_rule", dict(cont=torch.tensor([True])), r"continues must be a bool tensor of shape"),
    ("recurrent_gated_delta_rule_varlen", dict(A_log=torch.randn(3)), "A_log must have shape"),
    ("recurrent_gated_delta_rule_varlen", dict(b=torch.randn(4, 2)), "b must have shape"),
    ("recurrent_gated_delta_rule_varlen", dict(state_pool=torch.zeros(3, 2, 16, 8)), "state_pool must have shape"),
    ("recurrent_gated_delta_rule_varlen", dict(state_pool=torch.zeros(3, 2, 16, 16, dtype=torch.bfloat16)),
     "state_pool must be torch.float32"),
    ("recurrent_gated_delta_rule_varlen", dict(cu=torch.tensor([0, 2, 5])), "cu_seqlens must be int32"),
]


@pytest.mark.parametrize("name,over,match", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_argument(name, over, match):
    with pytest.raises(QwenOpError, match=f"qwen.{name}: .*{match}"):
        getattr(torch.ops.qwen, name)(*_bad(name, **over))


@pytest.mark.cuda
def test_varlen_step_replays_in_cuda_graph():
    """The packed ops captured once on static buffers (N rows, S sequences), replayed with other
    sequence lengths, slots and flags (the same N and S): equal to eager on the same inputs, as the
    engine's padded step graphs need."""
    dev, bf = "cuda", torch.bfloat16
    hk, hv, d, n, s = 16, 32, 128, 512, 6
    q, k, v, a, braw, a_log, dt_bias, pool, cu, slots, cont = _packed([n - 5, 1, 1, 1, 2, 0], hk, hv, d, d, bf, dev, 6)
    g, beta = gated_delta_gates_reference(a, braw, a_log, dt_bias)

    def step():
        o1 = torch.ops.qwen.chunk_gated_delta_rule(q, k, v, g, beta, d ** -0.5, pool, cu, slots, cont, True)
        o2 = torch.ops.qwen.recurrent_gated_delta_rule_varlen(q, k, v, a, braw, a_log, dt_bias, pool, cu, slots,
                                                              cont, d ** -0.5, True)
        return o1, o2

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for lens in ([1, 200, 0, 64, 65, 182], [n, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, n], [100] * 5 + [12]):
        cu.copy_(torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32))
        slots.copy_(torch.randperm(s, device=dev))
        cont.copy_(torch.rand(s, device=dev) > 0.5)
        for t in (q, k, v, g, beta):
            t.copy_(torch.randn_like(t) if t is not g else -torch.rand_like(t))
        pool.copy_(torch.randn_like(pool) * 0.3)
        saved = pool.clone()
        graph.replay()
        replayed, pool_after = [o.clone() for o in out], pool.clone()
        pool.copy_(saved)
        eager = step()
        assert torch.equal(replayed[0], eager[0]) and torch.equal(replayed[1], eager[1]), f"lengths {lens}"
        assert torch.equal(pool_after, pool), f"lengths {lens}: the pool"
