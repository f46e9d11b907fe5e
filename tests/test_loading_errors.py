"""Checkpoint loading errors: each names the offending tensor, file or model_type."""

import json

import pytest
import torch
from safetensors.torch import save_file

from modeling import CheckpointError, ConfigError, QwenConfig, QwenForCausalLM
from modeling.loader import load_plan

CONFIG = dict(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
)


def hf_tensors(config: dict) -> dict:
    """Random tensors under the Hugging Face names and shapes the config calls for."""
    plan = load_plan(QwenConfig.from_dict(config))
    return {name: torch.randn(shape) for sources in plan.values() for name, shape in sources}


def write_checkpoint(path, config: dict, tensors: dict):
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_valid_checkpoint_loads(tmp_path):
    tensors = hf_tensors(CONFIG)
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors), dtype=torch.float32)
    assert torch.equal(model.lm_head, tensors["lm_head.weight"])
    assert torch.equal(model.layers[0].o_weight, tensors["model.layers.0.self_attn.o_proj.weight"])


def test_tied_checkpoint_with_lm_head_is_accepted(tmp_path):
    config = CONFIG | {"tie_word_embeddings": True}
    tensors = hf_tensors(config) | {"lm_head.weight": torch.randn(64, 32)}
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, tensors), dtype=torch.float32)
    assert model.lm_head is None


@pytest.mark.parametrize("name", ["model.layers.1.mlp.up_proj.weight", "model.layers.0.self_attn.v_proj.bias", "lm_head.weight"])
def test_missing_tensor(tmp_path, name):
    tensors = hf_tensors(CONFIG)
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_qwen3_norms_missing_from_qwen2_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.0\.self_attn\.k_norm\.weight"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG | {"model_type": "qwen3"}, hf_tensors(CONFIG)))


def test_unexpected_tensor(tmp_path):
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    tensors = hf_tensors(CONFIG) | {name: torch.randn(8)}
    with pytest.raises(CheckpointError, match=f"unexpected tensor.*{name}"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_wrong_shape(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    tensors = hf_tensors(CONFIG) | {name: torch.randn(64, 32)}
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \[64, 32\], the config expects \[32, 32\]"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_missing_shard(tmp_path):
    tensors = hf_tensors(CONFIG)
    write_checkpoint(tmp_path, CONFIG, tensors)
    weight_map = {name: "model.safetensors" for name in tensors} | {"lm_head.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        QwenForCausalLM.from_pretrained(tmp_path)


def test_unsupported_model_type(tmp_path):
    config = CONFIG | {"model_type": "llama"}
    with pytest.raises(ConfigError, match="unsupported model_type 'llama': supported are qwen3, qwen2, qwen3_5_text"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, config, {}))


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/model.safetensors"])
def test_index_shards_must_lie_inside_the_checkpoint(tmp_path, shard):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    tensors = hf_tensors(CONFIG)
    write_checkpoint(ckpt, CONFIG, tensors)
    save_file(tensors, str(tmp_path / "outside.safetensors"))  # a readable file the index points at
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in tensors}}))
    with pytest.raises(CheckpointError, match="shards must be file names inside the checkpoint directory"):
        QwenForCausalLM.from_pretrained(ckpt)


def test_malformed_index_is_named(tmp_path):
    write_checkpoint(tmp_path, CONFIG, hf_tensors(CONFIG))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is malformed"):
        QwenForCausalLM.from_pretrained(tmp_path)


def test_fifo_weights_file_is_refused_without_blocking(tmp_path):
    import os

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="is not a regular file"):
        QwenForCausalLM.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------- dtypes and values


@pytest.mark.parametrize("dtype, code", [(torch.int8, "I8"), (torch.bool, "BOOL"), (torch.int64, "I64")])
def test_non_float_tensor_is_refused_before_loading(tmp_path, dtype, code):
    name = "model.layers.1.mlp.down_proj.weight"
    tensors = hf_tensors(CONFIG)
    tensors[name] = tensors[name].to(dtype)
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has dtype {code}: weights must be floating point"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors))


def test_float64_and_half_tensors_are_converted(tmp_path):
    """F64 is converted down to the target dtype like F32 (no warning); checkpoints may mix dtypes."""
    tensors = hf_tensors(CONFIG)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].double()
    tensors["model.norm.weight"] = tensors["model.norm.weight"].bfloat16()
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors), dtype=torch.float32)
    assert torch.equal(model.embed_tokens, tensors["model.embed_tokens.weight"].float())
    assert torch.equal(model.norm, tensors["model.norm.weight"].float())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weight_is_named(tmp_path, bad):
    name = "model.layers.0.self_attn.k_proj.bias"
    tensors = hf_tensors(CONFIG)
    tensors[name][3] = bad
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has non-finite values \(NaN or inf\)"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, CONFIG, tensors), dtype=torch.float32)


def test_weight_that_overflows_the_target_dtype_is_named(tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors = hf_tensors(CONFIG)
    tensors[name][0, 0] = 1e6  # fine in fp32, inf in fp16
    path = write_checkpoint(tmp_path, CONFIG, tensors)
    assert QwenForCausalLM.from_pretrained(path, dtype=torch.float32).layers[1].o_weight[0, 0] == 1e6
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' overflows float16 \(max \|value\| 1e\+06\)"):
        QwenForCausalLM.from_pretrained(path, dtype=torch.float16)


# ------------------------------------------------------------------------------------- Qwen3.5

QWEN3_5 = dict(CONFIG, model_type="qwen3_5_text", num_hidden_layers=2, full_attention_interval=2,
               linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)


def test_qwen3_5_plan_and_skipped_tensors(tmp_path):
    tensors = hf_tensors(QWEN3_5)
    assert tensors["model.layers.0.linear_attn.conv1d.weight"].shape == (64, 1, 4)  # C = 2*16 + 2*16
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (2 * 4 * 16, 32)  # query and gate
    extra = {"mtp.fc.weight": torch.randn(4, 4), "model.visual.blocks.0.attn.qkv.weight": torch.randn(4, 4)}
    model = QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, QWEN3_5, tensors | extra),
                                            dtype=torch.float32)
    la = "model.layers.0.linear_attn."
    fused = torch.cat([tensors[la + f"in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")])
    assert torch.equal(model.layers[0].in_proj_weight, fused)
    assert torch.equal(model.layers[0].A_log, tensors[la + "A_log"])


@pytest.mark.parametrize("name", ["model.layers.0.linear_attn.in_proj_b.weight", "model.layers.0.linear_attn.dt_bias",
                                  "model.layers.1.self_attn.q_norm.weight"])
def test_qwen3_5_missing_tensor(tmp_path, name):
    tensors = hf_tensors(QWEN3_5)
    del tensors[name]
    with pytest.raises(CheckpointError, match=f"missing tensor.*{name}"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, QWEN3_5, tensors))


def test_qwen3_5_wrapper_names(tmp_path):
    """The wrapper's text weights live under model.language_model.; text-only names are unexpected."""
    wrapper = {"model_type": "qwen3_5", "text_config": QWEN3_5 | {"model_type": "qwen3_5_text"}}
    tensors = hf_tensors(wrapper)
    assert "model.language_model.layers.0.linear_attn.A_log" in tensors
    QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, wrapper, tensors), dtype=torch.float32)
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.language_model\.embed_tokens\.weight"):
        QwenForCausalLM.from_pretrained(write_checkpoint(tmp_path, wrapper, hf_tensors(QWEN3_5)))


@pytest.mark.parametrize("damage", ["truncated", "header length", "offsets"])
def test_corrupt_weights_file_is_named(tmp_path, damage):
    """A truncated file, a header that claims a huge size, offsets past the data: a CheckpointError
    that names the file, not a raw safetensors error."""
    write_checkpoint(tmp_path, CONFIG, hf_tensors(CONFIG))
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    n = int.from_bytes(data[:8], "little")
    if damage == "truncated":
        data = data[: len(data) // 2]
    elif damage == "header length":
        data = (10**12).to_bytes(8, "little") + data[8:]
    else:
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        header[name]["data_offsets"] = [0, 10**9]
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        data = len(raw).to_bytes(8, "little") + raw + data[8 + n :]
    weights.write_bytes(data)
    with pytest.raises(CheckpointError, match="model.safetensors' is not a valid safetensors file"):
        QwenForCausalLM.from_pretrained(tmp_path)
