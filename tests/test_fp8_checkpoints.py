"""FP8 checkpoints in Qwen's format (``quantization_config`` fp8, e4m3 weights in blocks of 128 with
``weight_scale_inv``), built here from random transformers checkpoints, and ``quantization="fp8"``
at load.

- The PyTorch reference path dequantises: greedy tokens equal transformers' on the dequantised
  weights, exactly (fp32, in a process without the interpreter).
- The FP8 kernels (under the interpreter): the logits of a full pass are within 2e-2 of an fp32
  oracle, transformers with each quantised linear replaced by ``fp8_block_linear_reference``
  (activations quantised per token and group of 128 as the kernel does); argmaxes equal except at
  near-ties.
- Mixture-of-experts checkpoints (the experts one by one or fused): the experts stay FP8 where the
  kernels run, within the same 2e-2 of that oracle (its experts dequantised: their math is
  weight-only) on both of fused_moe's paths; the reference path (float64) dequantises them and is
  transformers on the dequantised weights.
- The engine's fused decode step on FP8 weights: the op-by-op FP8 step's greedy tokens and logits.
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3Config, Qwen3ForCausalLM

import qwen_ops
from modeling import LLM, Engine, QwenForCausalLM, SamplingParams
from modeling.model import fp8
from modeling.model.config import ConfigError
from modeling.model.loader import CheckpointError
from modeling.model.moe import SparseMoeBlock
from qwen_ops import dequantize_weight_fp8_block, fp8_block_linear_reference, quantize_weight_fp8_block
from tests.helpers import (DEVICES, ROOT, add_word_tokenizer, assert_same_greedy_but_near_ties, greedy_logits,
                           hf_greedy, prompt, randomize_, rel_err)
from tests.test_moe import PathSpy, random_hf_model

# q 4 x 64 = 256 rows, k and v 2 x 64 = 128 each: whole blocks, so the fused QKV stays FP8
QWEN3 = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, rope_theta=10000.0, tie_word_embeddings=False)
# Gated DeltaNet: in_proj_qkv 2 * 128 + 256 = 512 rows and in_proj_z 256 (FP8), in_proj_b / a 4 rows (bf16 tail);
# gated attention: q (with its gate) 256 rows, k and v 128 each
QWEN3_5 = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=64, linear_value_head_dim=64, layer_types=["linear_attention", "full_attention"],
               tie_word_embeddings=False)
UNQUANTISED = ("embed_tokens", "lm_head", "norm", "in_proj_a", "in_proj_b", "conv1d", "A_log", "dt_bias", "mlp.gate.",
               "shared_expert_gate")
"""Tensors Qwen's FP8 checkpoints keep in bf16 (the others ending in ``.weight`` and 2-D are quantised,
and fused experts: ``FUSED_EXPERTS``)."""
FUSED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")
"""Fused experts [E, N, K], quantised expert by expert: scales [E, cdiv(N, 128), cdiv(K, 128)] beside them."""
EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
"""An expert's projection in a checkpoint of experts one by one: (the experts' module, expert, projection)."""


def random_hf(family: str, seed: int = 0, **sizes):
    """A random transformers model of ``family`` (QWEN3 or QWEN3_5, with ``sizes`` changed)."""
    torch.manual_seed(seed)
    if family == "qwen3":
        model = Qwen3ForCausalLM._from_config(Qwen3Config(**QWEN3 | sizes), attn_implementation="eager",
                                              dtype=torch.float32)
    else:
        model = Qwen3_5ForCausalLM._from_config(Qwen3_5TextConfig(**QWEN3_5 | sizes), attn_implementation="eager",
                                                dtype=torch.float32)
    return randomize_(model.eval())


def write_fp8_checkpoint(hf, path, scale_dtype=torch.float32, **save_args) -> dict:
    """Save ``hf`` in Qwen's FP8 format at ``path`` (``save_args`` for ``save_pretrained``); return the
    quantised weights {name: (fp8, scale)}."""
    hf.save_pretrained(path, **save_args)
    tensors = load_file(path / "model.safetensors")
    quantised = {}
    for name, t in list(tensors.items()):
        dense = name.endswith(".weight") and t.dim() == 2 and not any(u in name for u in UNQUANTISED)
        if dense or name.endswith(FUSED_EXPERTS):
            parts = [quantize_weight_fp8_block(w) for w in t.view(-1, *t.shape[-2:])]
            w8, s = (torch.stack([p[i] for p in parts]).view(*t.shape[:-2], *parts[0][i].shape) for i in (0, 1))
            tensors[name], tensors[name + "_scale_inv"] = w8, s.to(scale_dtype)
            quantised[name] = (w8, s)
    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    (path / "config.json").write_text(json.dumps(config))
    return quantised


def held(hf, name: str) -> torch.Tensor:
    """The tensor of ``hf`` that checkpoint tensor ``name`` holds: a parameter, or for an expert's
    projection (experts one by one) its slice of the experts' fused parameter."""
    match = EXPERT.fullmatch(name)
    if match is None:
        return hf.get_parameter(name)
    experts, e = hf.get_submodule(match[1]), int(match[2])
    if match[3] == "down":
        return experts.down_proj[e]
    return experts.gate_up_proj[e].chunk(2)[match[3] == "up"]


@torch.no_grad()
def dequantised_(hf, quantised: dict, activations: bool = False):
    """``hf`` with every quantised weight replaced by its dequantised value; with ``activations``,
    each such linear (not the experts, whose FP8 math is weight-only) also computes
    ``fp8_block_linear_reference`` (activations quantised as the kernel quantises them)."""
    modules = dict(hf.named_modules())
    for name, (w8, s) in quantised.items():
        held(hf, name).copy_(fp8.dequantize(w8, s, torch.float32))
        linear = modules.get(name.removesuffix(".weight"))
        if activations and isinstance(linear, torch.nn.Linear):
            linear.forward = lambda x, w8=w8, s=s, b=linear.bias: fp8_block_linear_reference(x, w8, s, b)
    return hf


REFERENCE_GREEDY = """
import json, sys, torch
from modeling import QwenForCausalLM
model = QwenForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
ids = torch.tensor(json.loads(sys.argv[2]))
with torch.no_grad():
    for _ in range(8):
        ids = torch.cat([ids, model(ids)[:, -1:].argmax(-1)], 1)
print(json.dumps({"holds_fp8": model.holds_fp8, "tokens": ids.tolist()}))
"""
"""Greedy tokens of the checkpoint at argv[1] on the PyTorch reference path (no interpreter)."""


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_reference_path_dequantises_and_matches_transformers_exactly(tmp_path, family):
    hf = random_hf(family)
    quantised = write_fp8_checkpoint(hf, tmp_path)
    ids = prompt(2, 6, 256)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", REFERENCE_GREEDY, str(tmp_path), json.dumps(ids.tolist())], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert not out["holds_fp8"]
    assert torch.equal(torch.tensor(out["tokens"])[:, 6:], hf_greedy(dequantised_(hf, quantised), ids, 8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_fp8_kernels_match_the_quantised_oracle(tmp_path, family, device):
    """fp32 activations, so the kernel and the oracle quantise the same values up to the order of
    fp32 sums, which differs between the oracle's BLAS and the interpreter (and between CPUs): a
    value on an e4m3 rounding boundary moves a whole step, so on the CPU the logits differ by about
    1e-2 (relative) and an argmax flipped at a gap of 0.4% of the largest logit on one machine
    (bounds 2e-2 and 1%). On the GPU the FP8 tensor cores sum each block's products with fewer bits
    than fp32 (the op alone is ~1e-4 from its reference, tests/test_ops_fp8.py), and each layer
    quantises its activations again: a value moved across an e4m3 rounding boundary moves a whole
    step (1/16 to 1/8). Perturbing every FP8 linear's output of the oracle by 1e-4 (relative,
    random) moves these models' logits 4.9e-2 (Qwen3) and 4.5e-2 (Qwen3.5) and flips argmaxes at
    gaps up to 1.8% of the largest logit, which is what the GPU measured (4.9e-2, 4.5e-2): there the
    bounds are 0.1 and 5%, still far below a wrong weight or scale's (about 1)."""
    bound, tie = (2e-2, 1e-2) if device == "cpu" else (0.1, 5e-2)
    hf = random_hf(family)
    quantised = write_fp8_checkpoint(hf, tmp_path, scale_dtype=torch.bfloat16)
    model = QwenForCausalLM.from_pretrained(tmp_path, device=device, dtype=torch.float32)
    assert model.holds_fp8 and model.supports_fused_decode
    first = model.layers[0]
    weight = "qkv_weight" if family == "qwen3" else "in_proj_weight"
    assert getattr(first, weight).dtype == torch.float8_e4m3fn and first.down_weight.dtype == torch.float8_e4m3fn
    assert (getattr(first, weight + "_tail") is not None) == (family == "qwen3_5")  # in_proj_b, in_proj_a
    ids = prompt(1, 40, 256)
    before = qwen_ops.kernel_calls["fp8_block_linear"]
    with torch.no_grad():
        logits = model(ids.to(device)).cpu()
    assert qwen_ops.kernel_calls["fp8_block_linear"] > before, "the FP8 kernel did not run"
    stored = {name: (w8, s.to(torch.bfloat16).float()) for name, (w8, s) in quantised.items()}  # as saved
    with torch.no_grad():
        ref = dequantised_(hf, stored, activations=True)(ids).logits
    assert rel_err(logits, ref) <= bound
    top2 = ref[0].topk(2, dim=-1).values
    differ = logits[0].argmax(-1) != ref[0].argmax(-1)
    gaps = (top2[:, 0] - top2[:, 1])[differ]
    assert (gaps <= tie * ref[0].abs().max()).all(), f"an argmax differs without a near-tie (gaps {gaps.tolist()})"


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_fp8_model_stays_near_the_fp32_one(tmp_path, device):
    """bf16 activations round differently before they are quantised, and each value that lands on
    another e4m3 step moves by up to 1/8: two layers of this random model put the logits about 1e-1
    from the fp32 FP8 model's (the dequantised bf16 model is 2e-2 from fp32); a wrong weight or
    scale would put them about 1 away."""
    hf = random_hf("qwen3_5")
    write_fp8_checkpoint(hf, tmp_path, scale_dtype=torch.bfloat16)
    ids = prompt(1, 40, 256).to(device)
    with torch.no_grad():
        bf16 = QwenForCausalLM.from_pretrained(tmp_path, device=device, dtype=torch.bfloat16)
        fp32 = QwenForCausalLM.from_pretrained(tmp_path, device=device, dtype=torch.float32)
        assert bf16.holds_fp8 and bf16.layers[1].qkv_weight.dtype == torch.float8_e4m3fn
        assert rel_err(bf16(ids).float(), fp32(ids)) <= 0.2


FUSED_DECODE_OPS = ("norm_qkv_rope_store", "linear_residual", "norm_gate_up_silu", "norm_linear")
# The interpreter's cheapest models whose projections all stay FP8 (the parts of a fused weight but
# its last a whole number of 128-row blocks: q and k; gate; in_proj_qkv and in_proj_z), K of 64 (one
# partial block); Qwen3 with one layer, Qwen3.5 with one of each kind.
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
             head_dim=128)
FUSED_SIZES = {"qwen3": SMALL | dict(num_hidden_layers=1), "qwen3_5": SMALL | dict(linear_num_key_heads=1,
                                                                                   linear_num_value_heads=2)}


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_fused_decode_on_fp8_weights(tmp_path, family):
    """An FP8 model's decode steps of one sequence take the fused decode ops over its FP8 weights
    (Qwen3.5: the Gated DeltaNet in_proj's unquantised b and a rows through a second norm_linear)
    by default; asked for, Qwen3's take the persistent kernel's FP8 tiles, and Qwen3.5's hybrid
    kernel is refused. Greedy tokens equal to the op-by-op FP8 step's except after a near-tie (the
    two tokens' op-by-op logits within 1e-4 of the row's largest), the logits within 1e-5 (fp32) up
    to there."""
    write_fp8_checkpoint(random_hf(family, **FUSED_SIZES[family]), tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert model.holds_fp8 and model.supports_fused_decode
    assert model.supports_persistent_decode == (family == "qwen3")
    assert all(getattr(layer, name).dtype == torch.float8_e4m3fn for layer in model.layers
               for name in layer.linear_weights(False))
    if family == "qwen3_5":
        with pytest.raises(ValueError, match="decode_kernels='persistent' needs .*FP8 weights in Qwen3 and Qwen2 only"):
            Engine(model, max_num_seqs=1, max_model_len=8, decode_kernels="persistent")
    engine = Engine(model, max_num_seqs=1, max_model_len=8)
    assert engine.runner.decode_kernels(1) == "fused"
    ids = prompt(1, 3, 128)[0].tolist()
    before = {op: qwen_ops.kernel_calls[op] for op in FUSED_DECODE_OPS}
    fused = greedy_logits(engine, ids, 3)
    assert all(qwen_ops.kernel_calls[op] > before[op] for op in FUSED_DECODE_OPS), "a fused decode op did not run"
    ops = greedy_logits(Engine(model, max_num_seqs=1, max_model_len=8, decode_kernels="ops"), ids, 3)
    assert_same_greedy_but_near_ties(fused, ops, rel_tol=1e-5, tie=1e-4)
    if family == "qwen3":
        calls = qwen_ops.kernel_calls["decode_layers"]
        persistent = greedy_logits(Engine(model, max_num_seqs=1, max_model_len=8, decode_kernels="persistent"), ids, 3)
        assert qwen_ops.kernel_calls["decode_layers"] > calls, "the persistent kernel did not run"
        assert_same_greedy_but_near_ties(persistent, ops, rel_tol=1e-5, tie=1e-4)


def test_quantization_fp8_at_load(tmp_path):
    """A bf16 checkpoint quantised as it loads: each linear weight in the checkpoint format, and the
    same model as loading that format."""
    hf = random_hf("qwen3")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = QwenForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16, quantization="fp8")
    plain = QwenForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.bfloat16)
    assert model.holds_fp8 and not plain.holds_fp8
    for layer, ref in zip(model.layers, plain.layers):
        for name in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"):
            w8, s = quantize_weight_fp8_block(getattr(ref, name))
            assert torch.equal(getattr(layer, name).view(torch.uint8), w8.view(torch.uint8)), name
            assert torch.equal(getattr(layer, name + "_scale_inv"), s), name
    assert torch.equal(model.lm_head, plain.lm_head) and model.lm_head.dtype == torch.bfloat16


# one layer of hidden 128, q 4 x 64 = 256 rows, k and v 128 each: whole blocks, so the attention's
# projections stay FP8 (as QWEN3's)
MOE_LAYER = dict(num_hidden_layers=1, hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
MOE_LAYOUTS = {
    "one_by_one": ("qwen2_moe", MOE_LAYER | dict(decoder_sparse_step=1, moe_intermediate_size=128,
                                                 shared_expert_intermediate_size=128), 20),
    "fused": ("qwen3_moe", MOE_LAYER | dict(mlp_only_layers=[]), 3),
}
"""The MoE checkpoints (family, sizes, prompt length): Qwen2-MoE's experts one by one (I = 128, so
that an expert's gate and up stack into one block grid) with a shared expert (FP8 as a dense MLP),
run on 20 tokens (fused_moe's sorted grouped GEMMs, the dense projections' quantised activations);
Qwen3-MoE's fused (I = 40: w13's rows and w2's columns end in partial blocks), on 3 tokens (the
per-pair GEMV, the dense projections weight-only)."""


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
@torch.no_grad()
def test_fp8_moe_keeps_experts_fp8(tmp_path, monkeypatch, layout, device):
    """fp32 activations: the logits of a pass within 2e-2 of the quantised oracle (MOE_LAYOUTS: each
    layout on one of fused_moe's paths); the router stays fp32."""
    family, sizes, length = MOE_LAYOUTS[layout]
    hf = random_hf_model(family, **sizes)
    quantised = write_fp8_checkpoint(hf, tmp_path, save_original_format=layout == "one_by_one")
    model = QwenForCausalLM.from_pretrained(tmp_path, device=device, dtype=torch.float32)
    c = model.config
    mlp = model.layers[c.moe_layers[0]].mlp
    for name, (n, k) in zip(SparseMoeBlock.EXPERT_WEIGHTS, [(2 * c.moe_intermediate_size, c.hidden_size),
                                                             (c.hidden_size, c.moe_intermediate_size)]):
        assert getattr(mlp, name).dtype == torch.float8_e4m3fn, name
        assert getattr(mlp, name + "_scale_inv").shape == (c.num_experts, -(-n // 128), -(-k // 128)), name
    assert mlp.router_weight.dtype == torch.float32
    shared_fp8 = getattr(mlp, "shared_gate_up_scale_inv", None) is not None
    assert (mlp.shared_gate_up is not None) == shared_fp8 == (layout == "one_by_one")
    oracle = dequantised_(hf, quantised, activations=True)
    spy = PathSpy(monkeypatch)
    before = qwen_ops.kernel_calls["fused_moe"]
    ids = prompt(1, length, 256)
    assert rel_err(model(ids.to(device)).cpu(), oracle(ids).logits) <= 2e-2
    assert qwen_ops.kernel_calls["fused_moe"] > before and (spy.sorted, spy.gemv) == ((1, 0) if length > 4 else (0, 2))


@torch.no_grad()
def test_fp8_moe_reference_path_dequantises(tmp_path):
    """Where the kernels do not run (float64 here, whose ops take their references as the CPU's do
    without the interpreter), the experts and the shared expert are dequantised as they load: the
    model is transformers' (fp32: its grouped experts take no float64) on the dequantised weights."""
    family, sizes, _ = MOE_LAYOUTS["one_by_one"]
    hf = random_hf_model(family, **sizes)
    quantised = write_fp8_checkpoint(hf, tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    mlp = model.layers[0].mlp
    assert not model.holds_fp8 and mlp.experts_gate_up.dtype == mlp.shared_gate_up.dtype == torch.float64
    ids = prompt(2, 8, 256)
    assert rel_err(model(ids), dequantised_(hf, quantised)(ids).logits) < 1e-5


def test_quantization_fp8_at_load_of_a_moe_checkpoint(tmp_path):
    """A bf16 Qwen2-MoE checkpoint quantised as it loads: each expert in the checkpoint format (its
    scales a slice of the experts' [E, cdiv(N, 128), cdiv(K, 128)]), the shared expert as a dense
    MLP, the router and the shared expert's gate (the router's last row) left in bf16."""
    random_hf_model("qwen2_moe").to(torch.bfloat16).save_pretrained(tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization="fp8")
    plain = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    mlp, ref = model.layers[1].mlp, plain.layers[1].mlp
    for name in SparseMoeBlock.EXPERT_WEIGHTS:
        for e, expert in enumerate(getattr(ref, name)):
            w8, s = quantize_weight_fp8_block(expert)
            assert torch.equal(getattr(mlp, name)[e].view(torch.uint8), w8.view(torch.uint8)), f"{name}[{e}]"
            assert torch.equal(getattr(mlp, name + "_scale_inv")[e], s), f"{name}[{e}]"
    for name in SparseMoeBlock.LINEAR_WEIGHTS:
        w8, s = quantize_weight_fp8_block(getattr(ref, name))
        assert torch.equal(getattr(mlp, name).view(torch.uint8), w8.view(torch.uint8)), name
        assert torch.equal(getattr(mlp, name + "_scale_inv"), s), name
    assert torch.equal(mlp.router_weight, ref.router_weight) and mlp.router_weight.dtype == torch.bfloat16


@torch.no_grad()
def test_random_model_quantised_as_at_load(tmp_path):
    """``random_model(..., quantization="fp8")`` (the benchmarks' FP8 models, made in memory): the
    parameters a checkpoint quantised at load holds (names, dtypes, shapes; experts, the shared
    expert and the attention's projections FP8, the router bf16), each FP8 one the quantisation of
    the same seed's bf16 ``random_model`` parameter and the others equal to it."""
    from modeling.model.config import QwenConfig
    from modeling.model.random_checkpoint import random_model

    random_hf_model("qwen2_moe").to(torch.bfloat16).save_pretrained(tmp_path)
    config = QwenConfig.from_pretrained(tmp_path)
    loaded = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, quantization="fp8")
    model = random_model(config, dtype=torch.bfloat16, quantization="fp8", seed=3)
    plain = dict(random_model(config, dtype=torch.bfloat16, seed=3).named_parameters())

    def layout(m):
        return {name: (p.dtype, tuple(p.shape)) for name, p in m.named_parameters()}

    assert layout(model) == layout(loaded)
    params = dict(model.named_parameters())
    quantised = [name for name, p in params.items() if p.dtype == torch.float8_e4m3fn]
    assert any(".experts_" in name for name in quantised) and any("shared" in name for name in quantised)
    for name, p in params.items():
        if name.endswith("_scale_inv"):
            continue
        if name in quantised:
            w8, s = fp8.quantize(plain[name])
            assert torch.equal(p.view(torch.uint8), w8.view(torch.uint8)), name
            assert torch.equal(params[name + "_scale_inv"], s), name
        else:
            assert torch.equal(p, plain[name]), name
    with pytest.raises(ValueError, match="quantization must be None or 'fp8'"):
        random_model(config, quantization="int8")


def test_llm_generates_from_an_fp8_checkpoint(tmp_path):
    hf = random_hf("qwen3_5")
    write_fp8_checkpoint(hf, tmp_path)
    add_word_tokenizer(tmp_path, 256)
    llm = LLM(str(tmp_path), dtype="bfloat16", max_model_len=64, max_num_seqs=2)
    assert llm.model.holds_fp8
    before = qwen_ops.kernel_calls["fp8_block_linear"]
    out = llm.generate([{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": list(range(20, 40))}],
                       SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    assert qwen_ops.kernel_calls["fp8_block_linear"] > before


def test_unaligned_quantised_parts_are_dequantised(tmp_path):
    """k_proj of 64 rows is not a whole number of blocks, so q, k and v cannot stack into one FP8
    weight: the fused QKV is dequantised into bf16 as it loads; the MLP stays FP8."""
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM._from_config(Qwen3Config(**(QWEN3 | dict(num_key_value_heads=1))), dtype=torch.float32)
    quantised = write_fp8_checkpoint(hf, tmp_path)
    model = QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    layer = model.layers[0]
    assert layer.qkv_weight.dtype == torch.bfloat16 and layer.qkv_weight_scale_inv is None
    assert layer.gate_up_weight.dtype == torch.float8_e4m3fn
    q = quantised["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(layer.qkv_weight[:256], dequantize_weight_fp8_block(*q).to(torch.bfloat16))


def test_fp8_errors(tmp_path):
    hf = random_hf("qwen3")
    write_fp8_checkpoint(hf, tmp_path)
    with pytest.raises(ValueError, match="quantization='fp8' needs the FP8 kernels.*got float64 on cpu"):
        QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be None or 'fp8', got 'int4'"):
        QwenForCausalLM.from_pretrained(tmp_path, quantization="int4")
    config = json.loads((tmp_path / "config.json").read_text())
    for field, value in (("quant_method", "awq"), ("weight_block_size", [64, 64]), ("activation_scheme", "static")):
        bad = config | {"quantization_config": config["quantization_config"] | {field: value}}
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=f"unsupported quantization_config {field}"):
            QwenForCausalLM.from_pretrained(tmp_path)
    plain = tmp_path / "plain"  # one FP8 weight in a checkpoint whose config.json says nothing of FP8
    hf.save_pretrained(plain)
    tensors = load_file(plain / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name], tensors[name + "_scale_inv"] = quantize_weight_fp8_block(tensors[name])
    save_file(tensors, plain / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj.weight_scale_inv' is an FP8 weight's scales, but config.json "
                                              "has no quantization_config"):
        QwenForCausalLM.from_pretrained(plain)
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="down_proj.weight' has dtype F8_E4M3.*needs its .*weight_scale_inv"):
        QwenForCausalLM.from_pretrained(tmp_path)


def test_command_line_quantization_flag(tmp_path, capsys):
    """``--quantization fp8`` quantises a bf16 checkpoint as the command line loads it (the FP8
    kernel runs); any other value is refused by the parser (exit status 2, no traceback)."""
    from modeling.cli.generate import main

    random_hf("qwen3").to(torch.bfloat16).save_pretrained(tmp_path)
    add_word_tokenizer(tmp_path, 256)
    before = qwen_ops.kernel_calls["fp8_block_linear"]
    code = main(["--model", str(tmp_path), "--prompt", "w1 w2 w3", "--max-tokens", "3", "--ignore-eos", "--device",
                 "cpu", "--dtype", "bf16", "--quantization", "fp8", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(json.loads(out.splitlines()[0])["token_ids"]) == 3
    assert qwen_ops.kernel_calls["fp8_block_linear"] > before
    code = main(["--model", str(tmp_path), "--prompt", "w1", "--quantization", "int4"])
    err = capsys.readouterr().err
    assert code == 2 and "argument --quantization: invalid choice: 'int4'" in err and "Traceback" not in err


def test_scales_beside_a_weight_that_is_not_fp8_are_refused(tmp_path):
    """A ``weight_scale_inv`` beside a weight stored in bf16 (a checkpoint dequantised without
    dropping its scales) is refused naming both: the loader would otherwise multiply the bf16
    values by the scales, or cast them to e4m3, and load a wrong model without a word."""
    hf = random_hf("qwen3")
    write_fp8_checkpoint(hf, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = fp8.dequantize(tensors[name], tensors[name + "_scale_inv"], torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has dtype BF16, but {name}_scale_inv beside it makes "
                                              "it an FP8 weight: it must be F8_E4M3"):
        QwenForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
