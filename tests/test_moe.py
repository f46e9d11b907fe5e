"""Mixture-of-experts models against Hugging Face transformers: tiny random Qwen3-MoE, Qwen2-MoE and
Qwen3.5-MoE checkpoints saved with ``save_pretrained`` (the experts one by one, the Hub's layout,
and fused, transformers 5's ``save_original_format=False``), loaded with modeling; fp32 logits of a
pass without a cache and greedy tokens through ``LLM`` (the engine: a prefill step of 16 tokens
takes the sorted grouped GEMMs, the decode steps of two tokens the per-pair GEMV) with the MoE
kernels running under the interpreter; the command line and the server; the configs; the memory the
experts take.

The `cuda` cases: one full-size layer of each family (Qwen3-30B-A3B, Qwen1.5-MoE-A2.7B,
Qwen3.5-35B-A3B shapes, random bf16 weights) against transformers in fp32.
"""

import json

import pytest
import torch
from safetensors import safe_open
from transformers import (Qwen2MoeConfig, Qwen2MoeForCausalLM, Qwen3_5MoeConfig, Qwen3_5MoeForCausalLM,
                          Qwen3_5MoeForConditionalGeneration, Qwen3_5MoeTextConfig, Qwen3MoeConfig,
                          Qwen3MoeForCausalLM)

import qwen_ops
from csrc_free_ops import moe as moe_kernels
from modeling import LLM, Engine, QwenConfig, QwenForCausalLM
from modeling.api.tokenizer import QwenTokenizer
from modeling.cli.generate import main
from modeling.model.config import ConfigError
from modeling.model.device import weight_bytes
from modeling.model.loader import parameter_count
from modeling.model.moe import SparseMoeBlock
from tests.helpers import add_word_tokenizer, forced_logits, hf_greedy, llm_greedy, prompt, randomize_, rel_err

ATTENTION = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 num_experts=6, num_experts_per_tok=2, moe_intermediate_size=40)
# Qwen3-MoE: two layers, the second dense (mlp_only_layers), renormalised top 2 of 6
QWEN3_MOE = dict(ATTENTION, num_hidden_layers=2, intermediate_size=96, mlp_only_layers=[1], norm_topk_prob=True)
# Qwen2-MoE: qkv bias, a shared expert of 48, every second layer sparse (decoder_sparse_step 2), no renormalisation
QWEN2_MOE = dict(ATTENTION, num_hidden_layers=2, intermediate_size=96, decoder_sparse_step=2,
                 shared_expert_intermediate_size=48)
# Qwen3.5-MoE: Gated DeltaNet then gated attention, both with experts and a shared expert
QWEN3_5_MOE = dict(ATTENTION, num_hidden_layers=2, shared_expert_intermediate_size=48, linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=32,
                   layer_types=["linear_attention", "full_attention"])
FAMILIES = {
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig, QWEN3_MOE),
    "qwen2_moe": (Qwen2MoeForCausalLM, Qwen2MoeConfig, QWEN2_MOE),
    "qwen3_5_moe_text": (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, QWEN3_5_MOE),
}


def random_hf_model(family, dtype=torch.float32, device="cpu", std=0.2, seed=0, **sizes):
    model_class, config_class, tiny = FAMILIES[family]
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class._from_config(config_class(**(tiny | sizes)), attn_implementation="eager", dtype=dtype)
    return randomize_(model.eval(), std)


class PathSpy:
    """Counts fused_moe's two paths: the sort (grouped GEMMs) and the per-pair GEMV."""

    def __init__(self, monkeypatch):
        self.sorted = self.gemv = 0
        sort, gemv = moe_kernels.moe_align_block_size, moe_kernels._gemv

        def counted_sort(*args):
            self.sorted += 1
            return sort(*args)

        def counted_gemv(*args):
            self.gemv += 1
            return gemv(*args)

        monkeypatch.setattr(moe_kernels, "moe_align_block_size", counted_sort)
        monkeypatch.setattr(moe_kernels, "_gemv", counted_gemv)


# --------------------------------------------------------------------------------------------- config


def test_config_of_each_family():
    c = QwenConfig.from_dict(Qwen3MoeConfig(**QWEN3_MOE).to_dict())  # transformers writes num_local_experts
    assert (c.model_type, c.moe_layers, c.num_experts, c.num_experts_per_tok) == ("qwen3_moe", (0,), 6, 2)
    assert (c.moe_intermediate_size, c.shared_expert_intermediate_size, c.intermediate_size) == (40, 0, 96)
    assert c.norm_topk_prob and c.qk_norm and not c.qkv_bias
    c = QwenConfig.from_dict(Qwen2MoeConfig(**QWEN2_MOE).to_dict())
    assert (c.moe_layers, c.shared_expert_intermediate_size, c.norm_topk_prob, c.qkv_bias, c.qk_norm) == \
        ((1,), 48, False, True, False)
    assert not QwenConfig.from_dict(Qwen2MoeConfig(**QWEN2_MOE, qkv_bias=False).to_dict()).qkv_bias
    c = QwenConfig.from_dict(Qwen3_5MoeTextConfig(**QWEN3_5_MOE).to_dict())
    assert (c.moe_layers, c.norm_topk_prob, c.intermediate_size, c.norm_offset) == ((0, 1), True, 0, 1.0)
    wrapper = Qwen3_5MoeConfig(text_config=Qwen3_5MoeTextConfig(**QWEN3_5_MOE).to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)).to_dict()
    c = QwenConfig.from_dict(wrapper)
    assert (c.model_type, c.weights_prefix, c.num_experts) == ("qwen3_5_moe", "model.language_model.", 6)


def test_config_of_the_hub_checkpoints():
    """Qwen3-30B-A3B's config.json fields (num_experts, norm_topk_prob true though the class
    default is false) and the memory its weights take: 30.5 B parameters, 61 GB in bf16, 31 GB in
    FP8 (the attention's projections and the experts one byte each; the router, norms and
    embeddings bf16)."""
    d = dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
             moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
             head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
             mlp_only_layers=[], rope_theta=1e6, tie_word_embeddings=False)
    c = QwenConfig.from_dict(d)
    assert c.moe_layers == tuple(range(48)) and c.norm_topk_prob
    per_layer = ((4096 + 512 + 512) * 2048 + 2048 * 4096  # q, k, v, o
                 + 128 * 2048 + 128 * 3 * 768 * 2048  # router, experts
                 + 2 * 2048 + 2 * 128)  # norms, q/k norms
    total = 2 * 151936 * 2048 + 48 * per_layer + 2048  # embedding and lm_head, layers, final norm
    assert parameter_count(c) == total == weight_bytes(c, torch.bfloat16) // 2
    assert 61.0e9 < weight_bytes(c, torch.bfloat16) < 61.1e9
    fp8_per_layer = (4096 + 512 + 512) * 2048 + 2048 * 4096 + 128 * 3 * 768 * 2048
    assert weight_bytes(c, torch.bfloat16, fp8=True) == 2 * total - 48 * fp8_per_layer
    assert 31.1e9 < weight_bytes(c, torch.bfloat16, fp8=True) < 31.2e9


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=7), "num_experts_per_tok=7 is more than num_experts=6"),
    (dict(num_experts=2000), "num_experts 2000 is above 1024"),
    (dict(mlp_only_layers=[2]), "mlp_only_layers must be a list of layer indices below num_hidden_layers=2"),
    (dict(num_experts=None, num_local_experts=None), "num_experts is missing"),
    (dict(num_experts=6, num_local_experts=5), "num_experts=6 and num_local_experts=5 differ"),
    (dict(attention_bias=True), "unsupported attention_bias=true for qwen3_moe"),
    (dict(intermediate_size=None), "intermediate_size is missing"),
])
def test_config_errors(change, message):
    d = dict(QWEN3_MOE, model_type="qwen3_moe") | change
    with pytest.raises(ConfigError, match=message):
        QwenConfig.from_dict(d)


def test_qwen3_5_moe_router_always_renormalises():
    text = dict(QWEN3_5_MOE, model_type="qwen3_5_moe_text", norm_topk_prob=False)
    with pytest.raises(ConfigError, match="unsupported norm_topk_prob=false for qwen3_5_moe_text"):
        QwenConfig.from_dict(text)


# ---------------------------------------------------------------------------------- vs transformers


@pytest.mark.parametrize("family, fused", [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", False),
                                           ("qwen3_5_moe_text", True)])
@torch.no_grad()
def test_logits_and_greedy_match_transformers(tmp_path, monkeypatch, family, fused):
    """fp32: the logits of a pass without a cache and 5 greedy tokens of two prompts through ``LLM``,
    as transformers gives them; the router and experts ran as Triton kernels, the prefill step on
    the sorted grouped GEMMs and the decode steps on the per-pair GEMV."""
    hf = random_hf_model(family)
    hf.save_pretrained(tmp_path, save_original_format=not fused)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert ("model.layers.0.mlp.experts.gate_up_proj" in f.keys()) == fused
    llm = LLM(add_word_tokenizer(tmp_path, hf.config.vocab_size), device="cpu", dtype=torch.float32)
    sparse = [i for i, layer in enumerate(llm.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]
    assert tuple(sparse) == llm.model.config.moe_layers and sparse
    ids = prompt(2, 8, hf.config.vocab_size)
    assert rel_err(llm.model(ids), hf(ids).logits) < 1e-5

    spy = PathSpy(monkeypatch)
    before = dict(qwen_ops.kernel_calls)
    tokens = llm_greedy(llm, ids, 5)
    assert torch.equal(tokens, hf_greedy(hf, ids, 5))
    assert len(tokens.unique()) > 2  # not one token repeated
    for op in ("moe_topk_softmax", "fused_moe"):
        assert qwen_ops.kernel_calls[op] > before.get(op, 0), op
    assert spy.sorted and spy.gemv


@torch.no_grad()
def test_both_layouts_load_the_same_weights(tmp_path):
    hf = random_hf_model("qwen2_moe")
    models = []
    for fused in (False, True):
        hf.save_pretrained(tmp_path / str(fused), save_original_format=not fused)
        models.append(QwenForCausalLM.from_pretrained(tmp_path / str(fused), dtype=torch.float32))
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        assert torch.equal(a, b), name
    mlp, block = models[0].layers[1].mlp, hf.model.layers[1].mlp
    assert torch.equal(mlp.experts_gate_up, block.experts.gate_up_proj)
    assert torch.equal(mlp.router_weight, torch.cat([block.gate.weight, block.shared_expert_gate.weight]))


@torch.no_grad()
def test_multimodal_wrapper_layout(tmp_path):
    """Qwen3_5MoeForConditionalGeneration's checkpoint: the text model under model.language_model.,
    the vision tower skipped."""
    config = Qwen3_5MoeConfig(text_config=Qwen3_5MoeTextConfig(**QWEN3_5_MOE).to_dict(), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16))
    torch.manual_seed(0)
    hf = randomize_(Qwen3_5MoeForConditionalGeneration._from_config(config, attn_implementation="eager",
                                                                     dtype=torch.float32).eval())
    hf.save_pretrained(tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = prompt(1, 10, 256)
    assert rel_err(model(ids), hf(input_ids=ids).logits) < 1e-5


@torch.no_grad()
def test_command_line_generates_the_greedy_tokens(tmp_path, capsys):
    hf = random_hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    add_word_tokenizer(tmp_path, hf.config.vocab_size)
    text = "w1 w2 w3 w4 w5"
    ids = torch.tensor([QwenTokenizer.from_pretrained(tmp_path).encode(text)])
    code = main(["--model", str(tmp_path), "--prompt", text, "--max-tokens", "4", "--device", "cpu", "--dtype",
                 "fp32", "--json", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out.splitlines()[0])["token_ids"] == hf_greedy(hf, ids, 4)[0].tolist()


@torch.no_grad()
def test_server_generates_the_greedy_tokens(tmp_path):
    """python -m modeling.serve on a Qwen2-MoE checkpoint (the reference path, as test_serve's
    servers run): a completion of token ids gives transformers' greedy tokens."""
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from tests.test_serve import Server

    hf = random_hf_model("qwen2_moe")
    hf.save_pretrained(tmp_path / "model")
    add_word_tokenizer(tmp_path / "model", hf.config.vocab_size)
    server = Server(tmp_path, "moe", "--model", str(tmp_path / "model"), "--served-model-name", "moe", "--device",
                    "cpu", "--dtype", "fp32", "--max-num-seqs", "2")
    try:
        ids = prompt(1, 8, hf.config.vocab_size)
        out = server.wait_ready().client().completions.create(
            model="moe", prompt=ids[0].tolist(), max_tokens=4, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == hf_greedy(hf, ids, 4)[0].tolist()
    finally:
        server.stop()


@torch.no_grad()
def test_engine_decodes_moe_op_by_op(tmp_path):
    hf = random_hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert not model.supports_fused_decode and not model.supports_persistent_decode
    with pytest.raises(ValueError, match="decode_kernels='fused' needs dense MLPs"):
        Engine(model, max_num_seqs=1, max_model_len=32, decode_kernels="fused")


# -------------------------------------------------------------------------------------- full size


MOE_BF16_CAP = 0.1
"""The ceiling on a full-size MoE layer's bf16 error against fp32, above the dense tests' 2.5e-2:
with routing near uniform, bf16 rounding flips near-tied top-k choices, so transformers' own bf16
logits are 4.3e-2 (Qwen3-MoE) and 6.7e-2 (Qwen3.5-MoE) off its fp32 ones (measured on an H100)."""

FULL = {  # one layer of each (two for Qwen3.5-MoE: a Gated DeltaNet and a gated attention layer)
    "qwen3_moe": dict(vocab_size=4096, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                      num_hidden_layers=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, mlp_only_layers=[]),
    "qwen2_moe": dict(vocab_size=4096, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, num_hidden_layers=1, num_attention_heads=16,
                      num_key_value_heads=16, head_dim=128, num_experts=60, num_experts_per_tok=4,
                      decoder_sparse_step=1),
    "qwen3_5_moe_text": dict(vocab_size=4096, hidden_size=2048, moe_intermediate_size=512,
                             shared_expert_intermediate_size=512, num_hidden_layers=2, num_attention_heads=16,
                             num_key_value_heads=2, head_dim=256, num_experts=256, num_experts_per_tok=8,
                             linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                             linear_value_head_dim=128, layer_types=["linear_attention", "full_attention"]),
}


@pytest.mark.cuda
@pytest.mark.parametrize("family", list(FULL))
@torch.no_grad()
def test_full_size_layer_matches_transformers_cuda(tmp_path, family):
    """bf16 weights ~ N(0, 0.02^2) (routing near uniform): the logits of a 300-token pass and of the
    engine's decode step of token 301 within min(MOE_BF16_CAP, 1.25x transformers' own bf16 error)
    of transformers in fp32."""
    hf = random_hf_model(family, dtype=torch.bfloat16, device="cuda", std=0.02, **FULL[family])
    hf.save_pretrained(tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, device="cuda", dtype=torch.bfloat16)
    ids = prompt(1, 301, 4096).cuda()
    logits = model(ids[:, :300])
    engine = Engine(model, max_num_seqs=1, max_model_len=302)
    step = forced_logits(engine, ids[0, :300].tolist(), ids[0, 300:].tolist() + [0])[1:]
    hf_bf16, ref = hf(ids).logits, hf.float()(ids).logits
    for out, ref_rows, hf_rows in ((logits, ref[:, :300], hf_bf16[:, :300]), (step, ref[:, 300], hf_bf16[:, 300])):
        assert rel_err(out, ref_rows) < min(MOE_BF16_CAP, 1.25 * rel_err(hf_rows, ref_rows))
