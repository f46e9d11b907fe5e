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
    with pytest.raises(ConfigError, match="unsupported model_type 'llama': supported are qwen3, qwen2"):
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
