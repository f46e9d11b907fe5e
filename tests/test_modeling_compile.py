"""torch.compile(fullgraph=True) of the model (prefill and decode), and the pinned op sequence of
one decoder layer's captured graph."""

import operator

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from modeling import QwenConfig, QwenForCausalLM

B, T, MAX_LEN = 2, 8, 16


def random_model(model_type="qwen3"):
    config = QwenConfig.from_dict(
        dict(model_type=model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    )
    torch.manual_seed(0)
    model = QwenForCausalLM(config).requires_grad_(False)
    for p in model.parameters():
        p.normal_(0.0, 0.2)
    return model


def prefill_then_decode(fn, cache, ids):
    """fn (the model, eager or compiled) on a prefill of ids[:, :T], then a decode step of
    ids[:, T]; returns (prefill logits, decode logits, cache)."""
    prefill = fn(ids[:, :T], torch.arange(T).expand(B, T), cache)
    decode = fn(ids[:, T:], torch.full((B, 1), T), cache, torch.full((B,), T + 1, dtype=torch.int32))
    return prefill, decode, cache


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
@torch.no_grad()
def test_compile_fullgraph_prefill_and_decode(model_type):
    model = random_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (B, T + 1))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    *logits, cache = prefill_then_decode(model, model.new_cache(B, MAX_LEN, torch.float32), ids)
    *c_logits, c_cache = prefill_then_decode(compiled, model.new_cache(B, MAX_LEN, torch.float32), ids)
    torch.testing.assert_close(c_logits, logits, rtol=1e-5, atol=1e-5)
    for c_layer, layer in zip(c_cache.layers, cache.layers, strict=True):  # the cache was written
        torch.testing.assert_close(c_layer.k, layer.k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c_layer.v, layer.v, rtol=1e-5, atol=1e-5)


def captured_ops(fn, *args, skip=()) -> str:
    """The call_function targets of the AOT (functionalized, aten-level) graph of fn, one per
    line, tuple getitems and the targets in `skip` left out; a mutating op shows as
    auto_functionalized(op), a traced Triton kernel (CUDA) as triton(kernel name)."""
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

    lines = []

    def record(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is operator.getitem:
                continue
            name = str(node.target)
            if "auto_functionalized" in name:
                name = f"{name}({node.args[0]})"
            elif "triton_kernel_wrapper" in name:
                name = f"triton({kernel_side_table.get_kernel(node.kwargs['kernel_idx']).fn.__name__})"
            if name not in skip:
                lines.append(name)
        return gm

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=record))(*args)
    return "\n".join(lines) + "\n"


@torch.no_grad()
def test_decoder_layer_op_sequence():
    """Prefill through the first layer (rms_norm, attention), decode through the second
    (add_rms_norm fused with the residual, decode_attention on the cache), and the fused decode
    step of the second: five ops (six kernels: decode_attention has two)."""
    expecttest = pytest.importorskip("expecttest")  # a test extra; the GPU machine lacks it
    model = random_model("qwen3")
    cache = model.new_cache(B, MAX_LEN, torch.float32)
    x = torch.randn(B, T, model.config.hidden_size)
    first, second = model.layers
    prefill_ops = captured_ops(first, x, None, torch.arange(T).expand(B, T), cache.layers[0], None)
    expecttest.assert_expected_inline(prefill_ops, """\
qwen.rms_norm.default
qwen.linear.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
qwen.rope.default
auto_functionalized_v2(qwen.kv_cache_store.default)
qwen.attention.default
aten.view.default
qwen.linear.default
qwen.add_rms_norm.default
qwen.linear.default
qwen.silu_mul.default
qwen.linear.default
""")
    x1 = torch.randn(B, 1, model.config.hidden_size)
    positions, seqlens = torch.full((B, 1), T), torch.full((B,), T + 1, dtype=torch.int32)
    decode_ops = captured_ops(second, x1, torch.randn_like(x1), positions, cache.layers[1], seqlens)
    expecttest.assert_expected_inline(decode_ops, """\
qwen.add_rms_norm.default
qwen.linear.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
qwen.rope.default
auto_functionalized_v2(qwen.kv_cache_store.default)
qwen.decode_attention.default
aten.view.default
qwen.linear.default
qwen.add_rms_norm.default
qwen.linear.default
qwen.silu_mul.default
qwen.linear.default
""")
    fused_ops = captured_ops(second.decode, x1, positions, cache.layers[1], seqlens)
    expecttest.assert_expected_inline(fused_ops, """\
auto_functionalized_v2(qwen.norm_qkv_rope_store.default)
aten.alias.default
qwen.decode_attention.default
aten.view.default
qwen.linear_residual.default
qwen.norm_gate_up_silu.default
qwen.linear_residual.default
""")


@pytest.mark.cuda
@torch.no_grad()
def test_decoder_layer_traced_kernels_cuda():
    """On the GPU (bf16, static shapes) torch.compile traces each op into its Triton kernels: the
    prefill of one decoder layer is this kernel sequence (allocations and views left out), with
    no op left opaque. At 16 rows the projections take the split-K GEMV path."""
    expecttest = pytest.importorskip("expecttest")
    model = random_model("qwen3").to("cuda", torch.bfloat16)
    cache = model.new_cache(B, MAX_LEN)
    x = torch.randn(B, T, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(T, device="cuda").expand(B, T)
    views = ("aten.empty.memory_format", "aten.empty_like.default", "aten.view.default", "aten._unsafe_view.default",
             "aten.slice.Tensor")
    prefill_ops = captured_ops(model.layers[0], x, None, positions, cache.layers[0], None, skip=views)
    assert "qwen." not in prefill_ops
    expecttest.assert_expected_inline(prefill_ops, """\
triton(_rms_norm_kernel)
triton(_splitk_kernel)
aten.clone.default
triton(_rope_kernel)
triton(_kv_cache_store_kernel)
triton(_attention_kernel)
triton(_splitk_kernel)
triton(_rms_norm_kernel)
triton(_splitk_kernel)
triton(_silu_mul_kernel)
triton(_splitk_kernel)
""")
