"""qwen::causal_conv1d and qwen::causal_conv1d_update (Qwen3.5 Gated DeltaNet's short conv):
the kernels against the reference, prefill-then-decode continuation, transformers as the oracle
for the reference, opcheck and error messages."""
import inspect

import pytest
import torch

import qwen_ops  # noqa: F401
from qwen_ops import QwenOpError
from qwen_ops.causal_conv1d import causal_conv1d_reference, causal_conv1d_update_reference
from qwen_ops.registry import kernel_calls
from tests.helpers import DEVICES, DTYPES, assert_close, poison_allocator, randn

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
        y, final = torch.ops.qwen.causal_conv1d(x, w, s)
        assert kernel_calls["causal_conv1d"] == calls + 1, "the Triton kernel did not run"
        ref_y, ref_final = causal_conv1d_reference(x, w, s)
        assert_close(y, ref_y, what=f"causal_conv1d y {shape}")
        assert final.dtype == x.dtype and final.is_contiguous()
        assert torch.equal(final, ref_final), f"final state {shape} (a copy of inputs: must be exact)"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 3])
def test_causal_conv1d_update_matches_reference(device, dtype, t, nan_empty):
    b, c = (2, 40) if device == "cpu" else (2, 6144)
    x, w, s = _inputs(b, t, c, dtype, device)
    s_ref = s.clone()
    calls = kernel_calls["causal_conv1d_update"]
    y = torch.ops.qwen.causal_conv1d_update(x, s, w)
    assert kernel_calls["causal_conv1d_update"] == calls + 1, "the Triton kernel did not run"
    ref_y = causal_conv1d_update_reference(x, s_ref, w)
    assert_close(y, ref_y, what=f"causal_conv1d_update y T={t}")
    assert torch.equal(s, s_ref), "conv_state after the update"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix", [0, 1, 2, 5])
def test_prefill_then_updates_equals_whole(device, dtype, prefix):
    """causal_conv1d on the first `prefix` tokens, then causal_conv1d_update token by token (and
    once with 2 tokens) continues exactly: same outputs and state as causal_conv1d on the whole."""
    b, t, c = (2, 9, 24) if device == "cpu" else (2, 9, 6144)
    x, w, s0 = _inputs(b, t, c, dtype, device)
    y_all, s_all = torch.ops.qwen.causal_conv1d(x, w, s0)
    y0, state = torch.ops.qwen.causal_conv1d(x[:, :prefix], w, s0)
    ys, i = [y0], prefix
    while i < t:
        n = 2 if i == prefix + 1 else 1
        ys.append(torch.ops.qwen.causal_conv1d_update(x[:, i:i + n], state, w))
        i += n
    assert_close(torch.cat(ys, 1), y_all, what=f"prefill {prefix} + updates")
    assert torch.equal(state, s_all)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_input(device):
    """x as a channel slice of a wider activation (last dim contiguous, row stride larger)."""
    big = randn(2, 11, 56, dtype=torch.float32, device=device)
    x = big[..., 8:48]
    w = randn(40, K, dtype=torch.float32, device=device)
    s = randn(2, 40, K - 1, dtype=torch.float32, device=device)
    y, final = torch.ops.qwen.causal_conv1d(x, w, s)
    ref_y, ref_final = causal_conv1d_reference(x, w, s)
    assert_close(y, ref_y, what="strided causal_conv1d")
    assert torch.equal(final, ref_final)
    s2 = s.clone()
    assert_close(torch.ops.qwen.causal_conv1d_update(x[:, :2], s, w),
                 causal_conv1d_update_reference(x[:, :2], s2, w), what="strided update")
    assert torch.equal(s, s2)


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
    """transformers' causal_conv1d_fn / causal_conv1d_update (activation silu, [B, C, T] layout)
    are the oracle of the references."""
    conv_fn, conv_update = _transformers()
    torch.manual_seed(0)
    for t in (1, 2, 7):
        x, w, s = _inputs(2, t, 12, dtype, "cpu")
        y, final = causal_conv1d_reference(x, w)
        hf = conv_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
        assert_close(y, hf, what=f"causal_conv1d vs transformers T={t}")
        padded = torch.cat([torch.zeros(2, 12, K - 1, dtype=dtype), x.transpose(1, 2)], -1)
        assert torch.equal(final, padded[..., -(K - 1):])
        s_ours, s_hf = s.clone(), s.clone()
        y = causal_conv1d_update_reference(x, s_ours, w)
        hf = conv_update(x.transpose(1, 2), s_hf, w, None, "silu").transpose(1, 2)
        assert_close(y, hf, what=f"causal_conv1d_update vs transformers T={t}")
        assert torch.equal(s_ours, s_hf)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x, w, s = _inputs(2, 5, 16, torch.float32, device)
    torch.library.opcheck(torch.ops.qwen.causal_conv1d.default, (x, w, s))
    torch.library.opcheck(torch.ops.qwen.causal_conv1d.default, (x, w))
    torch.library.opcheck(torch.ops.qwen.causal_conv1d_update.default, (x[:, :1], s, w))


def test_compile_fullgraph():
    x, w, s = _inputs(2, 5, 16, torch.float32, "cpu")

    def f(x, w, s):
        y, st = torch.ops.qwen.causal_conv1d(x[:, :4], w, None)
        return torch.cat([y, torch.ops.qwen.causal_conv1d_update(x[:, 4:], st, w)], 1), st

    got = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, s)
    want = f(x, w, s)
    assert_close(got[0], want[0], what="compiled")
    assert torch.equal(got[1], want[1])


ERRORS = [
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(7, 4)), "weight has 7 channels"),
    ("causal_conv1d", lambda: (torch.randn(5, 8), torch.randn(8, 4)), "x must have 3 dims"),
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(8, 1)), "kernel size"),
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(8, 4), torch.randn(2, 8, 4)),
     "initial_state must have shape"),
    ("causal_conv1d", lambda: (torch.randn(2, 5, 8), torch.randn(8, 4), torch.randn(2, 8, 3, dtype=torch.float64)),
     "initial_state has dtype"),
    ("causal_conv1d_update", lambda: (torch.randn(2, 1, 8), torch.randn(1, 8, 3), torch.randn(8, 4)),
     "conv_state must have shape"),
    ("causal_conv1d_update", lambda: (torch.randint(0, 3, (2, 1, 8)), torch.randn(2, 8, 3), torch.randn(8, 4)),
     "x must be bfloat16"),
]


@pytest.mark.parametrize("name,make,match", ERRORS)
def test_errors_name_the_argument(name, make, match):
    with pytest.raises(QwenOpError, match=f"qwen.{name}: .*{match}"):
        getattr(torch.ops.qwen, name)(*make())
