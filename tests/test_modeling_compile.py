"""torch.compile(fullgraph=True) of the model's forward, and the pinned op sequence of one decoder
layer's captured graph: without a cache, in an engine's mixed step and in its decode step op by op
and fused."""

import operator
from dataclasses import fields, replace

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from modeling import Engine, QwenConfig, QwenForCausalLM, SamplingParams
from modeling.model.context import StepContext

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


def step_contexts(model):
    """The (input_ids, ``StepContext``) of an engine's first mixed step and first decode step of
    B sequences (eager), kept by a wrapper around the model's forward; the batch's tensors copied
    (the runner reuses its buffers for every step)."""
    kept = {}
    forward = model.forward

    def keep(input_ids, context=None):
        if context is not None and context.batch.key[0] not in kept:
            batch = replace(context.batch, **{f.name: getattr(context.batch, f.name).clone()
                                              for f in fields(context.batch)
                                              if isinstance(getattr(context.batch, f.name), torch.Tensor)})
            kept[batch.key[0]] = input_ids.clone(), context._replace(batch=batch)
        return forward(input_ids, context)

    model.forward = keep
    try:
        prompts = torch.randint(0, model.config.vocab_size, (B, T)).tolist()
        Engine(model, max_num_seqs=B, max_model_len=MAX_LEN, enforce_eager=True).generate(prompts, SamplingParams(), 2)
    finally:
        del model.forward
    return kept


@pytest.mark.parametrize("model_type", ["qwen3", "qwen2"])
@torch.no_grad()
def test_compile_fullgraph(model_type):
    """The forward without a cache (training, scoring), and an engine step's forward over the pool."""
    model = random_model(model_type)
    ids = torch.randint(0, model.config.vocab_size, (B, T + 1))
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-5, atol=1e-5)
    input_ids, context = step_contexts(model)["mixed"]
    pool = [t.clone() for entry in context.pool.layers for t in entry]
    eager = model(input_ids, context)
    written = [t.clone() for entry in context.pool.layers for t in entry]
    for t, saved in zip((t for entry in context.pool.layers for t in entry), pool):
        t.copy_(saved)
    torch.testing.assert_close(compiled(input_ids, context), eager, rtol=1e-5, atol=1e-5)
    for t, want in zip((t for entry in context.pool.layers for t in entry), written):  # the pool was written
        torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-5)


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
    """The second layer's ops: without a cache (add_rms_norm fused with the residual, attention),
    in an engine's mixed step (the keys and values stored into the pool, paged attention), and in
    its decode step fused: five ops (norm_qkv_rope_store, paged_attention, linear_residual,
    norm_gate_up_silu, linear_residual)."""
    expecttest = pytest.importorskip("expecttest")  # a test extra; the GPU machine lacks it
    model = random_model("qwen3")
    second = model.layers[1]
    x = torch.randn(B, T, model.config.hidden_size)
    plain_ops = captured_ops(second, x, torch.randn_like(x), torch.arange(T).expand(B, T))
    expecttest.assert_expected_inline(plain_ops, """\
qwen.add_rms_norm.default
qwen.linear.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
qwen.rope.default
qwen.attention.default
aten.view.default
qwen.linear.default
qwen.add_rms_norm.default
qwen.linear_silu_mul.default
qwen.linear.default
""")
    contexts = step_contexts(model)
    input_ids, context = contexts["mixed"]
    h = torch.randn(input_ids.shape[0], model.config.hidden_size)
    mixed_ops = captured_ops(second, h, torch.randn_like(h), context.batch.positions, context.layer(1))
    expecttest.assert_expected_inline(mixed_ops, """\
qwen.add_rms_norm.default
qwen.linear.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
aten.slice.Tensor
aten.view.default
qwen.rope.default
auto_functionalized_v2(qwen.kv_cache_store_slots.default)
qwen.paged_attention.default
aten.view.default
qwen.linear.default
qwen.add_rms_norm.default
qwen.linear_silu_mul.default
qwen.linear.default
""")
    input_ids, context = contexts["decode"]
    fused = StepContext(context.batch, context.pool, "fused")
    h = torch.randn(input_ids.shape[0], model.config.hidden_size)
    fused_ops = captured_ops(second, h, None, context.batch.positions, fused.layer(1))
    expecttest.assert_expected_inline(fused_ops, """\
auto_functionalized_v2(qwen.norm_qkv_rope_store.default)
aten.alias.default
qwen.paged_attention.default
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
    x = torch.randn(B, T, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    positions = torch.arange(T, device="cuda").expand(B, T)
    views = ("aten.empty.memory_format", "aten.empty_like.default", "aten.view.default", "aten._unsafe_view.default",
             "aten.slice.Tensor")
    prefill_ops = captured_ops(model.layers[0], x, None, positions, skip=views)
    assert "qwen." not in prefill_ops
    expecttest.assert_expected_inline(prefill_ops, """\
triton(_rms_norm_kernel)
triton(_splitk_kernel)
aten.clone.default
triton(_rope_kernel)
triton(_attention_kernel)
triton(_splitk_kernel)
triton(_rms_norm_kernel)
triton(_splitk_kernel)
triton(_silu_mul_kernel)
triton(_splitk_kernel)
""")
