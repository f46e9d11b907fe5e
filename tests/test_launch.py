"""csrc_free_ops.launch: the launch-key rules (CPU) and, on a GPU, the cached launch path and
torch.compile tracing into the kernels."""
import pytest
import torch
import triton

import qwen_ops
from csrc_free_ops import linear, norm
from csrc_free_ops.launch import _arg_key, _through_triton, spec_function
from tests.helpers import require_tma


def test_arg_key_separates_what_triton_specializes_on():
    base = torch.zeros(64, dtype=torch.float32)
    assert _arg_key(base) != _arg_key(base[1:])  # 16-byte aligned vs not
    assert _arg_key(base) != _arg_key(base.to(torch.bfloat16))
    assert _arg_key(base[4:]) == _arg_key(base)  # 16 bytes further: still aligned
    assert len({_arg_key(v) for v in (1, 16, 17, 2 ** 31, 2 ** 31 + 1, 2 ** 63)}) == 6  # i32 / i64 / u64
    assert _arg_key(33) == _arg_key(35) and _arg_key(32) == _arg_key(48)
    assert _arg_key(True) != _arg_key(False) and _arg_key(None) is None
    assert _arg_key(0.5) == _arg_key(2.0)


def test_generated_spec_is_the_arg_key_rule():
    """The generated key function (tensor and i32 cases inlined) gives, argument by argument, what
    `_arg_key` gives, and the value itself at constexpr positions."""
    base = torch.zeros(64, dtype=torch.float32)
    ints = [0, 1, -1, 15, 16, 17, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, -2 ** 31, -2 ** 31 - 16, 2 ** 63 - 1, 2 ** 63]
    others = [base, base[1:], base[2:], base[4:], base.to(torch.bfloat16), torch.nn.Parameter(base), 0.5, True, False,
              None, torch.float16]
    args = tuple(ints + others)
    constexpr_at = {3, len(ints) + 7}
    expected = tuple(a if i in constexpr_at else _arg_key(a) for i, a in enumerate(args))
    assert spec_function(len(args), constexpr_at)(*args) == expected
    assert spec_function(len(ints))(*ints) == tuple(map(_arg_key, ints))
    assert spec_function(0)() == ()


def test_arg_key_of_tensor_descriptors():
    """A host TMA descriptor is keyed by dtype, block shape and its shape/stride ints, not by its tensor."""
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    a, b = torch.zeros(64, 32, dtype=torch.bfloat16), torch.ones(64, 32, dtype=torch.bfloat16)
    assert _arg_key(TD.from_tensor(a, [16, 16])) == _arg_key(TD.from_tensor(b, [16, 16]))
    assert _arg_key(TD.from_tensor(a, [16, 16])) != _arg_key(TD.from_tensor(a, [32, 16]))
    assert _arg_key(TD.from_tensor(a, [16, 16])) != _arg_key(TD.from_tensor(a.float(), [16, 16]))
    assert _arg_key(TD.from_tensor(a, [16, 16])) != _arg_key(TD.from_tensor(a[:33], [16, 16]))  # M % 16


def test_grid_must_be_a_tuple():
    with pytest.raises(TypeError, match="tuple"):
        norm._rms_norm_kernel[lambda meta: (1,)]


def test_a_launch_hook_sends_launches_through_triton():
    """A profiler's hook must see every launch, cached or not (checked per launch)."""
    runtime = triton.knobs.runtime
    before = runtime.launch_enter_hook
    hook = lambda *args, **kwargs: None  # noqa: E731
    assert not _through_triton()
    if hasattr(before, "add"):  # Triton keeps hooks in a chain
        before.add(hook)
    else:  # an older Triton keeps one hook
        runtime.launch_enter_hook = hook
    try:
        assert _through_triton()
    finally:
        if hasattr(before, "remove"):
            before.remove(hook)
        else:
            runtime.launch_enter_hook = before
    assert not _through_triton()


@pytest.mark.cuda
def test_runtime_argument_by_keyword_is_refused():
    k = norm._rms_norm_kernel
    with pytest.raises(TypeError, match="positionally"):
        k._launch_through_triton(None, (1,), (), {"N": 4})


@pytest.mark.cuda
def test_cached_launch_matches_and_separates_specializations():
    k = norm._rms_norm_kernel
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16)
    buf = torch.randn(3, 1001, device="cuda", dtype=torch.bfloat16)
    for x in (buf[:, :1000], buf[:, :1000].contiguous(), buf.view(-1)[1:3001].view(3, 1000)):
        for _ in range(3):  # the first launch compiles or finds Triton's kernel, the rest take the cache
            y = torch.ops.qwen.rms_norm(x, w, 1e-6)
            torch.testing.assert_close(y, qwen_ops.rms_norm_reference(x, w, 1e-6), rtol=2e-2, atol=2e-2)
    keys = list(k.compiled)
    assert len(keys) == len(set(keys)) >= 2  # aligned and misaligned x are different entries
    assert any(not spec[0][1] for _, spec, _ in keys)  # the misaligned pointer has its own kernel


@pytest.mark.cuda
def test_compile_traces_into_the_kernels():
    """Under torch.compile the op becomes its Triton kernel in the graph (Inductor launches it);
    with dynamic shapes it stays the op; both give the eager result."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    seen = []

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            if "triton_kernel_wrapper" in str(node.target):
                seen.append(kernel_side_table.get_kernel(node.kwargs["kernel_idx"]).fn.__name__)
            elif str(node.target).startswith("qwen."):
                seen.append(str(node.target))
        return gm

    def f(x, w):
        return torch.ops.qwen.rms_norm(x, w, 1e-6) * 2

    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=record))(x, w)
    assert seen == ["_rms_norm_kernel"]
    seen.clear()
    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, dynamic=True, backend=aot_autograd(fw_compiler=record))(x, w)
    assert seen == ["qwen.rms_norm.default"]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, w), f(x, w), rtol=0, atol=0)


@pytest.mark.cuda
def test_tma_gemm_cached_and_traced():
    """The prefill GEMM takes host TMA descriptors: cached launches (tensor maps of new tensors
    each time) give cuBLAS's result; torch.compile traces the op into `_tma_gemm_kernel` in its
    pointer form, with Inductor's launch equal to eager."""
    require_tma("cuda")
    from torch._dynamo.backends.common import aot_autograd
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    for m in (300, 300, 301, 64):  # 301: M % 16 != 0 is its own specialization
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16) * 0.03
        torch.testing.assert_close(torch.ops.qwen.linear(x, w), torch.nn.functional.linear(x, w), rtol=2e-2, atol=2e-2)
    assert linear._tma_gemm_kernel.compiled
    seen = []

    def record(gm, example_inputs):
        seen.extend(kernel_side_table.get_kernel(n.kwargs["kernel_idx"]).fn.__name__
                    for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target))
        return gm

    def f(x, w):
        return torch.ops.qwen.linear(x, w) + 1

    torch._dynamo.reset()
    torch.compile(f, fullgraph=True, dynamic=False, backend=aot_autograd(fw_compiler=record))(x, w)
    assert seen == ["_tma_gemm_kernel"]
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, fullgraph=True)(x, w), f(x, w), rtol=0, atol=0)
