"""qwen::causal_conv1d (Qwen3.5 Gated DeltaNet's short conv), fixed-length and packed (cu_seqlens): the
kernels against the reference, a prefill continued by decode tokens (packed sequences of length 1
that continue their state slot), packed sequences (fresh and continuing, length 0 and 1, tile
boundaries, the padding slot untouched), transformers as the oracle for the references, opcheck
and error messages."""
import inspect

import pytest
import torch

import qwen_ops  # noqa: F401
from qwen_ops import QwenOpError
from qwen_ops.causal_conv1d import causal_conv1d_reference
from qwen_ops.registry import kernel_calls
from tests.helpers import DEVICES, DTYPES, assert_close, padded, poison_allocator, randn

K = 4
# (B, T, C): T = 0, T = 1, T < K - 1, T not a multiple of the kernels' T blocks, C not a power of two.
SHAPES = {"cpu": [(1, 0, 8), (2, 1, 24), (1, 2, 40), (2, 37, 48), (1, 130, 16)],
          "cuda": [(1, 2048, 6144), (2, 2048, 6144), (3, 5, 6144)]}


def _inputs(b, t, c, dtype, device, state=True):
    x = randn(b, t, c, dtype=dtype, device=device)
    w = randn(c, K, dtype=dtype, device=device, scale=0.5)
    s = randn(b, c, K - 1, dtype=dtype, device=device) if state else None
    return x, w, s


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_causal_conv1d_matches_reference(device, dtype, with_state, nan_empty):
    for shape in SHAPES[device]:
        x, w, s = _inputs(*shape, dtype, device, with_state)
        poison_allocator(device)
        calls = kernel_calls["causal_conv1d"]
        final, ref_final = (None, None) if s is None else (s.clone(), s.clone())
        y = torch.ops.qwen.causal_conv1d(x, w, final)
        assert kernel_calls["causal_conv1d"] == calls + 1, "the Triton kernel did not run"
        ref_y = causal_conv1d_reference(x, w, ref_final)
        assert_close(y, ref_y, what=f"causal_conv1d y {shape}")
        if s is not None:
            assert torch.equal(final, ref_final), f"final state {shape} (a copy of inputs: must be exact)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [0, 1, 2, 5])
def test_prefill_then_decode_tokens_equals_whole(device, dtype, prefix):
    """causal_conv1d on the first `prefix` tokens, then on the B sequences packed (cu_seqlens),
    continuing their state slots (the prefill's final state as the pool), token by token (and once
    with 2 tokens each), continues exactly: same outputs and state as causal_conv1d on the whole."""
    b, t, c = (2, 9, 24) if device == "cpu" else (2, 9, 6144)
    x, w, s0 = _inputs(b, t, c, dtype, device)
    s_all, pool = s0.clone(), s0.clone()
    y_all = torch.ops.qwen.causal_conv1d(x, w, s_all)
    y0 = torch.ops.qwen.causal_conv1d(x[:, :prefix], w, pool)
    slots = torch.arange(b, device=device)
    cont = torch.ones(b, dtype=torch.bool, device=device)
    ys, i = [y0], prefix
    while i < t:
        n = 2 if i == prefix + 1 else 1
        cu = torch.arange(0, b * n + 1, n, dtype=torch.int32, device=device)
        y = torch.ops.qwen.causal_conv1d(x[:, i:i + n].flatten(0, 1), w, pool, cu, slots, cont)
        ys.append(y.view(b, n, c))
        i += n
    assert_close(torch.cat(ys, 1), y_all, what=f"prefill {prefix} + decode tokens")
    assert torch.equal(pool, s_all)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input(device):
    """x as a channel slice of a wider activation (last dim contiguous, row stride larger)."""
    big = randn(2, 11, 56, dtype=torch.float32, device=device)
    x = big[..., 8:48]
    w = randn(40, K, dtype=torch.float32, device=device)
    s = randn(2, 40, K - 1, dtype=torch.float32, device=device)
    final, ref_final = s.clone(), s.clone()
    y = torch.ops.qwen.causal_conv1d(x, w, final)
    ref_y = causal_conv1d_reference(x, w, ref_final)
    assert_close(y, ref_y, what="strided causal_conv1d")
    assert torch.equal(final, ref_final)


# Packed sequence lengths: empty ones (graph padding), decode tokens (1), fewer than K - 1, the
# packed kernel's tile edges (64 rows), a sequence over three tiles; at full size a few thousand rows.
VARLEN = {"cpu": (24, [0, 1, 2, 63, 64, 65, 130, 0, 1]),
          "cuda": (6144, [1, 1, 2048, 0, 65, 1, 700, 3, 130, 1, 0])}


def _packed(lens, c, dtype, device, seed=0):
    """x (a channel slice of a wider activation, as the model's), weight, a pool of states with one
    slot per sequence in random order and a padding slot (length-0 sequences point at it), the
    continues flags (mixed; decode tokens continue)."""
    torch.manual_seed(seed)
    n, s = sum(lens), len(lens)
    x = randn(n, c + 8, dtype=dtype, device=device)[:, 8:]
    w = randn(c, K, dtype=dtype, device=device, scale=0.5)
    pool = randn(s + 1, c, K - 1, dtype=dtype, device=device)
    slots = torch.randperm(s, device=device)
    slots[torch.tensor(lens, device=device) == 0] = s  # the padding slot
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cont = (torch.arange(s, device=device) % 2 == 0) | (torch.tensor(lens, device=device) == 1)
    return x, w, pool, cu, slots, cont


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_sequences_match_reference(device, dtype, nan_empty):
    c, lens = VARLEN[device]
    x, w, pool, cu, slots, cont = _packed(lens, c, dtype, device)
    pool_ref, before = pool.clone(), pool.clone()
    poison_allocator(device)
    calls = kernel_calls["causal_conv1d"]
    y = torch.ops.qwen.causal_conv1d(x, w, pool, cu, slots, cont)
    assert kernel_calls["causal_conv1d"] == calls + 1, "the Triton kernel did not run"
    ref = causal_conv1d_reference(x, w, pool_ref, cu, slots, cont)
    assert y.shape == x.shape and y.is_contiguous()
    assert_close(y, ref, what=f"causal_conv1d packed y, lengths {lens}")
    assert torch.equal(pool, pool_ref), "the pool after the call (copies of inputs: must be exact)"
    assert torch.equal(pool[-1], before[-1]), "the padding slot (length-0 sequences only) was written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens", [[1, 1, 0, 1], [0, 0, 6, 0, 0, 0, 0, 1]], ids=["decode", "sparse"])
def test_packed_sequences_in_one_row_blocks(device, lens):
    """Steps of at most one row a sequence on average walk their tiles in blocks of one row: a
    decode step, and one sequence of 6 rows (through its state reads and past them) among empty ones."""
    c = VARLEN[device][0]
    x, w, pool, cu, slots, cont = _packed(lens, c, torch.float32, device, seed=2)
    pool_ref = pool.clone()
    y = torch.ops.qwen.causal_conv1d(x, w, pool, cu, slots, cont)
    assert_close(y, causal_conv1d_reference(x, w, pool_ref, cu, slots, cont), what=f"lengths {lens}")
    assert torch.equal(pool, pool_ref), "the pool after the call"


@pytest.mark.parametrize("device", DEVICES)
def test_packed_sequences_equal_fixed_length_ones(device):
    """Each packed sequence gives what the fixed-length form (fresh or from its slot's state) gives
    it alone; the padding slot (length-0 sequences) is untouched."""
    c, lens = VARLEN[device]
    x, w, pool, cu, slots, cont = _packed(lens, c, torch.float32, device, seed=1)
    before = pool.clone()
    y = torch.ops.qwen.causal_conv1d(x, w, pool, cu, slots, cont)
    for i, n in enumerate(lens):
        lo, slot = int(cu[i]), int(slots[i])
        xi = x[None, lo:lo + n]
        if n == 0:
            continue
        state = before[slot:slot + 1].clone() if cont[i] else torch.zeros_like(before[slot:slot + 1])
        want = torch.ops.qwen.causal_conv1d(xi, w, state)
        assert_close(y[lo:lo + n], want[0], 1e-6, what=f"sequence {i} (length {n}, continues {bool(cont[i])})")
        assert torch.equal(pool[slot], state[0]), f"sequence {i}'s state"
    assert torch.equal(pool[-1], before[-1]), "the padding slot was written"


def test_float64_runs_the_reference():
    x, w, s = _inputs(1, 5, 8, torch.float64, "cpu")
    calls = kernel_calls["causal_conv1d"]
    torch.ops.qwen.causal_conv1d(x, w, s)
    assert kernel_calls["causal_conv1d"] == calls


def _transformers():
    m = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    # The module's names may be bound to a hub / causal-conv1d kernel; unwrap to the PyTorch code.
    return inspect.unwrap(m.causal_conv1d_fn), inspect.unwrap(m.causal_conv1d_update)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_matches_transformers(dtype):
    """transformers' causal_conv1d_fn (activation silu, [B, C, T] layout) is the oracle of
    causal_conv1d's fixed-length reference, its causal_conv1d_update (the decode step) that of the
    packed reference's sequences that continue their state slot."""
    conv_fn, conv_update = _transformers()
    torch.manual_seed(0)
    for t in (1, 2, 7):
        x, w, s = _inputs(2, t, 12, dtype, "cpu")
        final = torch.zeros(2, 12, K - 1, dtype=dtype)
        y = causal_conv1d_reference(x, w, final)
        hf = conv_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
        assert_close(y, hf, what=f"causal_conv1d vs transformers T={t}")
        padded = torch.cat([torch.zeros(2, 12, K - 1, dtype=dtype), x.transpose(1, 2)], -1)
        assert torch.equal(final, padded[..., -(K - 1):])
        pool, s_hf = s.clone(), s.clone()
        cu = torch.tensor([0, t, 2 * t], dtype=torch.int32)
        y = causal_conv1d_reference(x.flatten(0, 1), w, pool, cu, torch.arange(2), torch.ones(2, dtype=torch.bool))
        hf = conv_update(x.transpose(1, 2), s_hf, w, None, "silu").transpose(1, 2)
        assert_close(y.view(2, t, 12), hf, what=f"causal_conv1d packed (continuing) vs transformers T={t}")
        assert torch.equal(pool, s_hf)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, w, s = _inputs(2, 5, 16, torch.float32, device)
    torch.library.opcheck(torch.ops.qwen.causal_conv1d.default, (x, w, s))
    torch.library.opcheck(torch.ops.qwen.causal_conv1d.default, (x, w))
    x, w, pool, cu, slots, cont = _packed([3, 0, 1, 5], 16, torch.float32, device)
    torch.library.opcheck(torch.ops.qwen.causal_conv1d.default, (x, w, pool, cu, slots, cont))


def test_compile_fullgraph():
    """A prefill, then a decode token per sequence continuing the prefill's final state in place."""
    x, w, _ = _inputs(2, 5, 16, torch.float32, "cpu")
    cu, slots, cont = torch.tensor([0, 1, 2], dtype=torch.int32), torch.arange(2), torch.ones(2, dtype=torch.bool)

    def f(x, w):
        st = x.new_zeros(2, 16, K - 1)
        y = torch.ops.qwen.causal_conv1d(x[:, :4], w, st)
        y_new = torch.ops.qwen.causal_conv1d(x[:, 4], w, st, cu, slots, cont)
        return torch.cat([y, y_new[:, None]], 1), st

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    want = f(x, w)
    assert_close(got[0], want[0], what="compiled")
    assert torch.equal(got[1], want[1])


ERRORS = [
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(7, 4)), "weight has 7 channels"),
    ("causal_conv1d", lambda: (torch.randn(5, 8), torch.randn(8, 4)), "x must have 3 dims"),
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(8, 1)), "kernel size"),
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(8, 4), torch.randn(2, 8, 4)),
     r"conv_states must have shape \[B, C, K-1\] = \(2, 8, 3\) without cu_seqlens"),
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(8, 4), torch.randn(2, 8, 3, dtype=torch.float64)),
     "conv_states has dtype"),
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(8, 4), None, None, torch.tensor([0, 1])),
     "state_slots is for packed sequences: pass cu_seqlens with it"),
    ("causal_conv1d", lambda: _bad_packed(pool=None), r"packed sequences \(cu_seqlens\) need conv_states"),
    ("causal_conv1d", lambda: _bad_packed(slots=None), r"packed sequences \(cu_seqlens\) need state_slots"),
    ("causal_conv1d", lambda: _bad_packed(cont=None), r"packed sequences \(cu_seqlens\) need continues"),
    ("causal_conv1d", lambda: _bad_packed(x=torch.randint(0, 3, (5, 8))), "x must be bfloat16"),
    ("causal_conv1d", lambda: _bad_packed(pool=torch.randn(3, 8, 4)), r"conv_states must have shape \[P, C, K-1\]"),
    ("causal_conv1d", lambda: _bad_packed(cu=torch.tensor([0, 2, 5])), "cu_seqlens must be int32"),
    ("causal_conv1d", lambda: _bad_packed(cu=torch.tensor([0, 5], dtype=torch.int32)),
     r"cu_seqlens must have shape \(3,\)"),
    ("causal_conv1d", lambda: _bad_packed(cu=torch.tensor([0, 4, 3], dtype=torch.int32)),
     "cu_seqlens must rise from 0 to the 5 rows"),
    ("causal_conv1d", lambda: _bad_packed(cu=torch.tensor([0, 2, 4], dtype=torch.int32)),
     r"cu_seqlens must rise from 0 to the 5 rows, got \[0, 2, 4\]"),
    ("causal_conv1d", lambda: _bad_packed(cu=torch.tensor([0, 4, 2, 5], dtype=torch.int32),
                                                 slots=torch.tensor([0, 1, 2]), cont=torch.tensor([True, False, True])),
     r"cu_seqlens must rise from 0 to the 5 rows, got \[0, 4, 2, 5\]"),
    ("causal_conv1d", lambda: _bad_packed(slots=torch.tensor([0, 1], dtype=torch.int32)),
     "state_slots must be a 1-d int64"),
    ("causal_conv1d", lambda: _bad_packed(slots=torch.tensor([0, 3])), r"state_slots must lie in \[0, 3\)"),
    ("causal_conv1d", lambda: _bad_packed(slots=torch.tensor([-1, 0])), r"state_slots must lie in \[0, 3\)"),
    ("causal_conv1d", lambda: _bad_packed(cont=torch.ones(2, dtype=torch.int32)), "continues must be a bool"),
]


def _bad_packed(**over):
    args = dict(x=padded(5, 8), w=torch.randn(8, 4), pool=padded(3, 8, 3),
                cu=torch.tensor([0, 2, 5], dtype=torch.int32), slots=torch.tensor([0, 1]),
                cont=torch.tensor([True, False]))
    args.update(over)
    return tuple(args.values())


@pytest.mark.parametrize("name,make,match", ERRORS)
def test_errors_name_the_argument(name, make, match):
    with pytest.raises(QwenOpError, match=f"qwen.{name}: .*{match}"):
        getattr(torch.ops.qwen, name)(*make())
