"""The op contract: opcheck, torch.compile(fullgraph=True), clear errors."""
import pytest
import torch

import qwen_ops
from tests.helpers import DEVICES, assert_close, randn


def _samples(device):
    """One small argument tuple per op (fresh random data)."""
    f32 = dict(dtype=torch.float32, device=device)
    b, t, hq, hk, d, n = 2, 3, 4, 2, 16, 48
    qkv = randn(b, t, (hq + 2 * hk) * d, **f32)
    q = qkv[..., : hq * d].view(b, t, hq, d)
    k = qkv[..., hq * d : (hq + hk) * d].view(b, t, hk, d)
    v = qkv[..., (hq + hk) * d :].view(b, t, hk, d)
    cache = lambda: randn(4, 16, hk, d, **f32)  # noqa: E731  (paged: 4 blocks of 16)
    positions = torch.tensor([[0, 1, 2], [4, 5, 6]], device=device)
    table = torch.tensor([[0], [2]], dtype=torch.int32, device=device)  # sequence i's block
    slots = (table * 16 + positions).flatten()  # the tokens' KV slots
    i32 = dict(dtype=torch.int32, device=device)
    return {
        "rms_norm": (randn(b, n, **f32), randn(n, **f32), 1e-6),
        "add_rms_norm": (randn(b, n, **f32), randn(b, n, **f32), randn(n, **f32), 1e-6, 1.0),
        "rope": (q, k, positions, 1e4, d, randn(d, **f32), randn(d, **f32)),
        "linear": (randn(b, n, **f32), randn(24, n, **f32), randn(24, **f32)),
        "silu_mul": (randn(b, 2 * n, **f32),),
        "attention": (q, k, v, 0.25, True),
        "kv_cache_store_slots": (k.flatten(0, 1), v.flatten(0, 1), cache(), cache(), slots),
        "paged_attention": (q[:, -1], cache(), cache(), torch.tensor([0, 1, 2], **i32), torch.tensor([3, 7], **i32),
                            table, 0.25, 1),
        "norm_linear": (randn(b, n, **f32), randn(n, **f32), randn(24, n, **f32), randn(24, **f32), 1e-6, 1.0),
        "linear_residual": (randn(b, n, **f32), randn(24, n, **f32), randn(b, 24, **f32)),
        "norm_gate_up_silu": (randn(b, n, **f32), randn(n, **f32), randn(24, n, **f32), 1e-6, 0.0),
        "norm_qkv_rope_store": (randn(b, n, **f32), randn(n, **f32), randn((hq + 2 * hk) * d, n, **f32), None,
                                randn(d, **f32), randn(d, **f32), cache(), cache(), positions[:, 0], slots[::t], 1e-6,
                                0.0, 1e4, d, hq, False),
        "decode_layers": _decode_layers_sample(device),
    }


def _decode_layers_sample(device):
    """Two layers of hidden 32 (2 q heads, 1 kv head of 16, I 24), two sequences in blocks of 16."""
    f32 = dict(dtype=torch.float32, device=device)
    layers, h, d, inter = 2, 32, 16, 24
    table = torch.tensor([[2], [0]], dtype=torch.int32, device=device)
    cache = lambda: randn(layers, 3, 16, 1, d, **f32)  # noqa: E731
    return (randn(2, h, **f32), torch.tensor([4, 9], device=device), torch.tensor([5, 10], dtype=torch.int32,
            device=device), table, randn(layers, h, **f32), randn(layers, 4 * d, h, **f32), None,
            randn(layers, d, **f32), randn(layers, d, **f32), randn(layers, h, 2 * d, **f32), randn(layers, h, **f32),
            randn(layers, 2 * inter, h, **f32), randn(layers, h, inter, **f32), cache(), cache(), 1e-6, 0.0, 1e4, d,
            2, 2)


OPS = list(_samples("cpu"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", OPS)
def test_opcheck(device, name):
    torch.library.opcheck(getattr(torch.ops.qwen, name).default, _samples(device)[name])


def test_every_op_is_registered_with_a_fake_kernel():
    for name in OPS:
        op = getattr(torch.ops.qwen, name).default
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta") or \
            torch._library.simple_registry.singleton.find(op.name()).fake_impl.kernel is not None, name


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_whole_chain(device):
    """Every op in one compiled function, no graph break, same result as eager."""
    s = _samples(device)

    _, _, _, cu, _, table, _, _ = s["paged_attention"]
    slots = s["kv_cache_store_slots"][4]

    def chain(x, res, w, q, k, positions, k_cache, v_cache, lw, gu):
        h, res2 = torch.ops.qwen.add_rms_norm(x, res, w, 1e-6)
        h = torch.ops.qwen.rms_norm(h, w, 1e-6)
        qr, kr = torch.ops.qwen.rope(q, k, positions, 1e4, q.shape[-1])
        torch.ops.qwen.kv_cache_store_slots(kr.flatten(0, 1), kr.flatten(0, 1), k_cache, v_cache, slots)
        a = torch.ops.qwen.attention(qr, kr, kr, 0.25)
        lens = (positions[:, -1] + 1).to(torch.int32)
        dq = torch.ops.qwen.paged_attention(qr[:, -1], k_cache, v_cache, cu, lens, table, 0.25, 1)
        y = torch.ops.qwen.linear(h, lw) + torch.ops.qwen.silu_mul(gu)
        return res2, y, a, dq

    x, res, w = s["add_rms_norm"][:3]
    q, k, positions = s["rope"][0], s["rope"][1], s["rope"][2]
    caches = [s["kv_cache_store_slots"][2], s["kv_cache_store_slots"][3]]
    lw, gu = randn(24, 48, dtype=torch.float32, device=device), randn(2, 48, dtype=torch.float32, device=device)
    eager_caches = [c.clone() for c in caches]
    expected = chain(x, res, w, q, k, positions, *eager_caches, lw, gu)
    backend = "aot_eager" if device == "cpu" else "inductor"
    compiled = torch.compile(chain, fullgraph=True, backend=backend)
    got = compiled(x, res, w, q, k, positions, *caches, lw, gu)
    for g, e in zip(got, expected):
        assert_close(g, e, what="compiled vs eager")
    assert_close(caches[0], eager_caches[0], what="compiled cache store")


ERRORS = [
    ("rms_norm", lambda: (torch.randn(2, 8), torch.randn(7), 1e-6), "weight has 7 elements"),
    ("rms_norm", lambda: (torch.randint(0, 3, (2, 8)), torch.randn(8), 1e-6), "x must be bfloat16"),
    ("add_rms_norm", lambda: (torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6), "residual has shape"),
    ("rope", lambda: (torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.zeros(3, dtype=torch.long), 1e4, 16), "positions must have shape"),
    ("rope", lambda: (torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.zeros(2, dtype=torch.long), 1e4, 15), "rotary_dim must be even"),
    ("rope", lambda: (torch.randn(2, 4, 16), torch.randn(2, 2, 16), torch.zeros(2), 1e4, 16), "positions must be int32 or int64"),
    ("linear", lambda: (torch.randn(2, 8), torch.randn(4, 9)), "x's last dim is 8"),
    ("linear", lambda: (torch.randn(2, 8), torch.randn(4, 8).half()), "weight has dtype torch.float16"),
    ("linear", lambda: (torch.randn(2, 8), torch.randn(4, 8), torch.randn(5)), "bias has 5 elements"),
    ("silu_mul", lambda: (torch.randn(2, 7),), "must be even"),
    ("attention", lambda: (torch.randn(1, 4, 2, 40), torch.randn(1, 4, 1, 40), torch.randn(1, 4, 1, 40), 0.1), "head_dim 40 is not supported"),
    ("attention", lambda: (torch.randn(1, 4, 3, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16), 0.1), "multiple of kv heads"),
    ("attention", lambda: (torch.randn(1, 5, 2, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16), 0.1), "Sk >= Sq"),
    ("rope_backward", lambda: (torch.randn(2, 4, 16, 2)[..., 0], torch.randn(2, 2, 16), torch.randn(2, 4, 16),
                               torch.randn(2, 2, 16), torch.zeros(2, dtype=torch.long), 1e4, 16),
     "dq must be contiguous in its last dim"),
    ("rope_backward", lambda: (torch.randn(2, 4, 16), torch.randn(2, 2, 16).double(), torch.randn(2, 4, 16),
                               torch.randn(2, 2, 16), torch.zeros(2, dtype=torch.long), 1e4, 16),
     "dk has dtype torch.float64 but q has torch.float32"),
    ("attention_backward", lambda: (torch.randn(1, 4, 2, 16).bfloat16(), *(torch.randn(1, 4, 2, 16) for _ in range(4)),
                                    None, 0.25), "do has dtype torch.bfloat16 but q has torch.float32"),
    ("rms_norm_backward", lambda: (torch.randn(2, 8), torch.randn(2, 8), torch.randn(8), 1e-6, 0.0,
                                   torch.randn(2, 8, 2)[..., 0]), "dsum must be contiguous in its last dim"),
    ("silu_mul_split_backward", lambda: (torch.randn(2, 8, 2)[..., 0], torch.randn(2, 8), torch.randn(2, 8)),
     "dy must be contiguous in its last dim"),
]


@pytest.mark.parametrize("name,make_args,message", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_input_raises_clear_error(name, make_args, message):
    with pytest.raises(qwen_ops.QwenOpError, match=f"qwen.{name}: .*" + message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        getattr(torch.ops.qwen, name)(*make_args())


@pytest.mark.cuda
def test_device_mismatch_names_the_argument():
    with pytest.raises(qwen_ops.QwenOpError, match="weight is on cpu but x is on cuda"):
        torch.ops.qwen.rms_norm(torch.randn(2, 8, device="cuda"), torch.randn(8), 1e-6)
    with pytest.raises(qwen_ops.QwenOpError, match="weight is on cpu but x is on cuda"):
        torch.ops.qwen.linear(torch.randn(2, 8, device="cuda"), torch.randn(4, 8))


def test_register_autograd_refuses_mutating_ops():
    """The lean autograd kernel neither marks inputs dirty nor bumps version counters: refused."""
    from qwen_ops.registry import register_autograd

    with pytest.raises(ValueError, match="mutates an input"):
        register_autograd(torch.ops.qwen.kv_cache_store_slots.default, lambda ctx, *g: g, lambda ctx, i, o: None)


_probe_libs: dict = {}


@pytest.mark.parametrize("device", DEVICES)
def test_autograd_kernel_skips_the_dispatcher_only_for_plain_tensors(device):
    """Without grad, an op's Autograd kernel calls the backend kernel directly when the call's key
    set is `registry.PLAIN_KEYSETS[device]`: a probe op records the key sets such a kernel sees, so
    the constant must equal what a plain tensor carries on this device (else the direct path is
    never taken), and a fake tensor's (which must redispatch) must differ."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from qwen_ops.registry import PLAIN_KEYSETS

    seen = []
    name = f"qwen_keyset_probe_{device}"
    if name not in _probe_libs:
        lib = _probe_libs[name] = torch.library.Library(name, "FRAGMENT")
        lib.define("f(Tensor x) -> Tensor")
        lib.impl("f", lambda x: x.clone(), "CompositeExplicitAutograd")
        lib.impl("f", lambda keyset, x: seen.append(keyset.raw_repr()) or x.clone(), "Autograd", with_keyset=True)
        _probe_libs[name + "_seen"] = seen
    seen = _probe_libs[name + "_seen"]
    seen.clear()
    probe = getattr(torch.ops, name).f
    x = torch.randn(3, device=device)
    probe(x)
    with torch.no_grad():
        probe(x)
    with FakeTensorMode() as mode:
        probe(mode.from_tensor(x))
    plain = PLAIN_KEYSETS[device.upper()].raw_repr()
    assert seen[:2] == [plain, plain], "a plain tensor's key set is not registry.PLAIN_KEYSETS: no direct path"
    assert seen[2] != plain, "a fake tensor would skip its mode"
    w = torch.randn(3, device=device)
    with torch.no_grad():
        direct = torch.ops.qwen.rms_norm(x[None], w, 1e-6)
    with torch.inference_mode():
        assert torch.equal(direct, torch.ops.qwen.rms_norm(x[None], w, 1e-6))


def _transposed(*shape):
    """A float64 tensor of `shape` that is dense but not contiguous (its first two dims swapped in memory)."""
    return torch.randn(shape[1], shape[0], *shape[2:], dtype=torch.float64).transpose(0, 1)


REFERENCE_PATH = {  # float64 always takes the reference (as every CPU call does without the interpreter)
    "add_rms_norm": lambda: (_transposed(4, 3, 8), _transposed(4, 3, 8), torch.randn(8, dtype=torch.float64), 1e-6),
    "silu_mul": lambda: (_transposed(4, 3, 8),),
    "silu_mul_split": lambda: (_transposed(4, 3, 8), _transposed(4, 3, 8)),
    "silu_mul_split_backward": lambda: tuple(_transposed(4, 3, 8) for _ in range(3)),
    "sigmoid_mul": lambda: (_transposed(4, 3, 8), _transposed(4, 3, 8)),
    "gated_rms_norm": lambda: (_transposed(4, 3, 8), _transposed(4, 3, 8), torch.randn(8, dtype=torch.float64), 1e-6),
}


@pytest.mark.parametrize("name", REFERENCE_PATH)
def test_reference_path_outputs_are_contiguous_as_the_fake_kernel_says(name):
    """Outputs are new contiguous tensors on every path: an elementwise reference on a dense
    transposed input would otherwise return the input's strides, which the fake kernel does not
    (torch.compile's generated code asserts the fake strides and fails)."""
    args = REFERENCE_PATH[name]()
    outs = getattr(torch.ops.qwen, name)(*args)
    for i, t in enumerate(outs if isinstance(outs, tuple) else (outs,)):
        assert t.is_contiguous(), f"{name} output {i}: strides {t.stride()} for shape {tuple(t.shape)}"
    torch.library.opcheck(getattr(torch.ops.qwen, name).default, args, test_utils="test_faketensor")
