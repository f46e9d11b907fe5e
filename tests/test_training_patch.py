"""modeling.patch_transformers on transformers Qwen3 / Qwen2 models: same loss, logits and gradients
as the unpatched model, our ops actually on the autograd graph, undo restores the model, compiled
training step, and the fallbacks (padding mask) and refusals (unsupported configs).
Also: our own modeling decoder trains, with gradients equal to transformers'."""
import pytest
import torch

from modeling import patch_transformers
from tests.helpers import assert_close

transformers = pytest.importorskip("transformers")

TINY = dict(vocab_size=70, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)


def _model(kind: str, device: str, **over):
    torch.manual_seed(0)
    if kind == "qwen3":
        cfg = transformers.Qwen3Config(**{**TINY, **over})
        return transformers.Qwen3ForCausalLM(cfg).to(device)
    cfg = transformers.Qwen2Config(**{**TINY, **over})
    return transformers.Qwen2ForCausalLM(cfg).to(device)


def _loss_and_grads(model, ids, **kw):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=ids, **kw)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


def _graph_node_names(t):
    seen, names, stack = set(), set(), [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(node.name())
        stack.extend(f for f, _ in node.next_functions)
    return names


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_patch_matches_transformers_and_undoes(device, kind):
    model = _model(kind, device)
    ids = torch.randint(0, TINY["vocab_size"], (2, 24), device=device)
    ref_out, ref_grads = _loss_and_grads(model, ids)
    ref_logits = model(ids).logits

    handle = patch_transformers(model)
    n_layers = TINY["num_hidden_layers"]
    norms = n_layers * (4 if kind == "qwen3" else 2) + 1
    assert handle.counts == {"rms_norm": norms, "mlp": n_layers, "attention": n_layers, "causal_mask": 1, "loss": 1}
    out, grads = _loss_and_grads(model, ids)
    assert out.logits is None  # the fused loss never builds the logits
    names = " ".join(_graph_node_names(out.loss))
    for op in ("rms_norm", "rope", "attention_with_lse", "silu_mul_split", "linear_cross_entropy_with_lse"):
        assert f"qwen_{op}_default" in names, f"{op} not on the autograd graph"
    assert_close(out.loss, ref_out.loss, 1e-5, what="patched loss")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], 1e-4, what=f"patched grad {name}")
    assert_close(model(ids).logits, ref_logits, 1e-5, what="patched logits (no labels)")

    handle.undo()
    assert not handle.active
    for module in model.modules():
        assert "forward" not in module.__dict__ and "_qwen_rope_theta" not in module.__dict__
    again, _ = _loss_and_grads(model, ids)
    assert_close(again.loss, ref_out.loss, 1e-6, what="loss after undo")


def test_patch_context_manager_and_base_model():
    model = _model("qwen3", "cpu")
    with patch_transformers(model.model) as handle:  # the bare Qwen3Model: no loss patch
        assert "loss" not in handle.counts and handle.counts["attention"] == 2
        assert "forward" in model.model.layers[0].self_attn.__dict__
    assert "forward" not in model.model.layers[0].self_attn.__dict__


def test_patch_padding_mask_falls_back_to_transformers_attention():
    """A padding mask reaches the layer as a 4-D mask: our RoPE, transformers' attention; the
    non-padded positions agree with the unpatched model, as do the loss and its gradients."""
    model = _model("qwen3", "cpu")
    ids = torch.randint(0, TINY["vocab_size"], (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    labels = ids.masked_fill(mask == 0, -100)
    ref_logits = model(ids, attention_mask=mask).logits
    model.zero_grad(set_to_none=True)
    ref_loss = model(ids, attention_mask=mask, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with patch_transformers(model):
        logits = model(ids, attention_mask=mask).logits
        model.zero_grad(set_to_none=True)
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
    keep = mask.bool()
    assert_close(logits[keep], ref_logits[keep], 1e-5, what="padded logits")
    assert_close(loss, ref_loss, 1e-5, what="padded loss")
    for name, p in model.named_parameters():
        assert_close(p.grad, ref_grads[name], 1e-4, what=f"padded grad {name}")


def test_patch_keeps_our_attention_where_transformers_would_build_a_causal_mask(monkeypatch):
    """Under torch.compile, transformers 5.17 cannot prove a mask purely causal and builds a 4-D
    one, which would send the patched layers to the masked fallback. Simulated in eager mode by
    refusing transformers' own skip: the patched decoder stack still hands its layers no mask, so
    our attention runs, with the unpatched model's loss; a padding mask still reaches the layers."""
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "_ignore_causal_mask_sdpa", lambda *args, **kwargs: False)
    model = _model("qwen3", "cpu")
    ids = torch.randint(0, TINY["vocab_size"], (2, 12))
    ref_out, ref_grads = _loss_and_grads(model, ids)
    with patch_transformers(model):
        out, grads = _loss_and_grads(model, ids)
        assert "qwen_attention_with_lse_default" in " ".join(_graph_node_names(out.loss))
        padded = model(ids, attention_mask=torch.ones(2, 12, dtype=torch.long), labels=ids).loss
        assert "qwen_attention_with_lse_default" not in " ".join(_graph_node_names(padded))
    assert_close(out.loss, ref_out.loss, 1e-5, what="loss")
    for name, g in grads.items():
        assert_close(g, ref_grads[name], 1e-4, what=f"grad {name}")


def test_patch_num_items_in_batch_and_generation():
    model = _model("qwen3", "cpu")
    ids = torch.randint(0, TINY["vocab_size"], (2, 10))
    ref = model(ids, labels=ids, num_items_in_batch=torch.tensor(40)).loss
    prompt = ids[:1, :4]
    ref_gen = model.generate(prompt, max_new_tokens=4, do_sample=False)
    with patch_transformers(model):
        assert_close(model(ids, labels=ids, num_items_in_batch=torch.tensor(40)).loss, ref, 1e-5, what="sum / items")
        assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False), ref_gen)  # KV cache path


def test_patch_once_at_a_time_and_return_dict_false():
    """A patched model refuses a second patch until the first is undone (undoing two in creation
    order left it patched); return_dict=False gives a tuple, as transformers does."""
    model = _model("qwen3", "cpu")
    ids = torch.randint(0, TINY["vocab_size"], (2, 10))
    ref = model(ids, labels=ids).loss
    handle = patch_transformers(model)
    with pytest.raises(ValueError, match="patched already: undo\\(\\) that patch first"):
        patch_transformers(model)
    out = model(ids, labels=ids, return_dict=False)
    assert isinstance(out, tuple)
    assert_close(out[0], ref, 1e-5, what="the tuple's loss")
    assert isinstance(model(ids, return_dict=False)[0], torch.Tensor)  # the logits
    handle.undo()
    assert not any("forward" in m.__dict__ for m in model.modules())
    patch_transformers(model).undo()  # a fresh patch once the first is undone
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_patch_rejects_unsupported_configs():
    with pytest.raises(ValueError, match="rope_type 'linear'"):
        patch_transformers(_model("qwen3", "cpu", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 1e4}))
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        patch_transformers(_model("qwen3", "cpu", hidden_act="gelu"))
    with pytest.raises(ValueError, match="model_type 'llama'"):
        patch_transformers(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=10, hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_patched_training_step_compiles_fullgraph(device):
    model = _model("qwen3", device, use_cache=False)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16), device=device)
    handle = patch_transformers(model)
    _, eager_grads = _loss_and_grads(model, ids)

    def loss_fn(x):
        return model(x, labels=x).loss

    graphs = []

    def backend(gm, example_inputs):  # records the graph Dynamo captured, then compiles it
        graphs.append(gm.code)
        if device == "cpu":
            return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx
        return compile_fx(gm, example_inputs)

    compiled = torch.compile(loss_fn, fullgraph=True, backend=backend)
    model.zero_grad(set_to_none=True)
    compiled(ids).backward()
    for name, p in model.named_parameters():
        assert_close(p.grad, eager_grads[name], 1e-4, what=f"compiled grad {name}")
    # our attention, not transformers' masked fallback (under tracing transformers may build a mask)
    assert "qwen.attention_with_lse" in graphs[0] and "scaled_dot_product_attention" not in graphs[0]
    handle.undo()


def test_own_decoder_trains_like_transformers(tmp_path):
    """modeling.QwenForCausalLM (torch.ops.qwen only) with requires_grad_(True): its fused loss and
    the gradients equal transformers' for the same weights (the logits path's loss too)."""
    from modeling.model.causal_lm import QwenForCausalLM

    hf = _model("qwen3", "cpu", use_cache=False)
    hf.save_pretrained(tmp_path)
    ours = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).requires_grad_(True)
    ids = torch.randint(0, TINY["vocab_size"], (2, 16))
    ref_out, ref_grads = _loss_and_grads(hf, ids)
    logits = ours(ids)
    unfused = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert_close(unfused, ref_out.loss, 1e-5, what="own decoder loss from logits")
    loss = ours.loss(ids)  # fused lm_head + loss
    loss.backward()
    assert_close(loss, ref_out.loss, 1e-5, what="own decoder fused loss")
    pairs = {"embed_tokens": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight",
             "layers.1.down_weight": "model.layers.1.mlp.down_proj.weight",
             "layers.0.input_norm": "model.layers.0.input_layernorm.weight",
             "layers.0.q_norm": "model.layers.0.self_attn.q_norm.weight",
             "layers.0.o_weight": "model.layers.0.self_attn.o_proj.weight"}
    params = dict(ours.named_parameters())
    for mine, theirs in pairs.items():
        assert_close(params[mine].grad, ref_grads[theirs], 1e-4, what=f"own decoder grad {mine}")
