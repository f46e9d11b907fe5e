"""The random checkpoint builder never deletes what it did not write, concurrent builds agree, and
its config honours every field it is given."""
import json
import multiprocessing

import pytest
import torch
from safetensors.torch import load_file

from modeling import QwenForCausalLM
from modeling.model.random_checkpoint import (MARKER, build_random_checkpoint, config_dict, ensure_random_checkpoint,
                                        is_complete)

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16)


def test_refuses_a_directory_it_did_not_build(tmp_path):
    user_file = tmp_path / "notes.txt"
    user_file.write_text("precious")
    with pytest.raises(FileExistsError, match="refusing to replace it"):
        build_random_checkpoint(tmp_path, **TINY)
    with pytest.raises(FileExistsError):
        ensure_random_checkpoint(tmp_path)
    assert user_file.read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_refuses_a_checkpoint_with_a_user_file_beside_it(tmp_path):
    ckpt = build_random_checkpoint(tmp_path / "ckpt", **TINY)
    (ckpt / "my-weights.safetensors").write_bytes(b"mine")
    with pytest.raises(FileExistsError):
        build_random_checkpoint(ckpt, seed=3, **TINY)
    assert (ckpt / "my-weights.safetensors").read_bytes() == b"mine"


def test_rebuilds_its_own_checkpoint_and_an_empty_directory(tmp_path):
    (tmp_path / "empty").mkdir()
    assert is_complete(build_random_checkpoint(tmp_path / "empty", **TINY))
    ckpt = build_random_checkpoint(tmp_path / "ckpt", seed=1, **TINY)
    before = (ckpt / "model.safetensors").read_bytes()
    build_random_checkpoint(ckpt, seed=2, **TINY)
    assert (ckpt / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.lock", "empty", "empty.lock"]


def test_truncated_checkpoint_is_not_complete_and_is_rebuilt(tmp_path):
    ckpt = ensure_random_checkpoint(tmp_path / "ckpt")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    assert not is_complete(ckpt)
    ensure_random_checkpoint(ckpt)
    assert is_complete(ckpt) and weights.stat().st_size > 100
    (ckpt / MARKER).unlink()  # a build interrupted before its last file
    assert not is_complete(ckpt)


def _ensure(path):
    ensure_random_checkpoint(path)
    return is_complete(path)


def test_concurrent_builds_all_succeed(tmp_path):
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        assert pool.map(_ensure, [tmp_path / "ckpt"] * 3) == [True] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "ckpt.lock"]


def test_untied_checkpoint_has_its_own_lm_head(tmp_path):
    ckpt = build_random_checkpoint(tmp_path / "untied", tie_word_embeddings=False, **TINY)
    assert json.loads((ckpt / "config.json").read_text())["tie_word_embeddings"] is False
    tensors = load_file(str(ckpt / "model.safetensors"))
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert model.lm_head is not None and torch.equal(model.lm_head, tensors["lm_head.weight"])
    tied = build_random_checkpoint(tmp_path / "tied", **TINY)
    assert "lm_head.weight" not in load_file(str(tied / "model.safetensors"))


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_config_dict_fields_override_the_defaults(model_type):
    given = dict(tie_word_embeddings=False, rms_norm_eps=1e-5, hidden_act="silu", eos_token_id=1)
    d = config_dict(64, model_type=model_type, **given)
    assert {k: d[k] for k in given} == given and d["model_type"] == model_type
    with pytest.raises(ValueError, match="model_type must be 'qwen3' or 'qwen3_5_text', got 'qwen2'"):
        config_dict(64, model_type="qwen2")
