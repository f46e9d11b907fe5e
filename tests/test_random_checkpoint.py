"""The random checkpoint builder never deletes what it did not write, concurrent builds agree, and
its config honours every field it is given; its word-level tokenizer has exactly the vocabulary
asked for, any id sequence survives decode then encode, and such a checkpoint names no EOS."""
import json
import multiprocessing
import random
import time

import pytest
import torch
from safetensors.torch import load_file

from modeling import QwenForCausalLM, QwenTokenizer
from modeling.model.random_checkpoint import (MARKER, QWEN3_0_6B, build_random_checkpoint, build_word_tokenizer,
                                              config_dict, ensure_random_checkpoint, is_complete)

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


def test_word_tokenizer_of_qwen3_vocab_round_trips_random_ids():
    t0 = time.perf_counter()
    tok = build_word_tokenizer(QWEN3_0_6B["vocab_size"])
    assert time.perf_counter() - t0 < 3, "building the 151,936 words should take well under a second"
    n = tok.get_vocab_size(with_added_tokens=True)
    assert n == QWEN3_0_6B["vocab_size"] and len(set(tok.get_vocab())) == n
    rng = random.Random(0)
    for length in (1, 2, 256, 1000):
        ids = [rng.randrange(n) for _ in range(length)]
        assert tok.encode(tok.decode(ids)).ids == ids
    ends = [0, 1, n - 1]  # <unk>, the first word, the last one
    assert tok.encode(tok.decode(ends)).ids == ends
    assert tok.encode("not-a-word bababa").ids == [0, 1]


@pytest.mark.parametrize("vocab_size", [2, 86, 87, 1000])
def test_word_tokenizer_sizes(vocab_size):
    tok = build_word_tokenizer(vocab_size)
    ids = list(range(vocab_size))
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size and tok.encode(tok.decode(ids)).ids == ids


def test_word_tokenizer_needs_a_word():
    with pytest.raises(ValueError, match="at least 2 entries"):
        build_word_tokenizer(1)


def test_words_checkpoint_has_the_vocab_the_dtype_and_no_eos(tmp_path):
    ckpt = build_random_checkpoint(tmp_path / "words", vocab_size=1000, tokenizer="words", dtype=torch.bfloat16, **TINY)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["vocab_size"] == 1000 and cfg["torch_dtype"] == "bfloat16" and cfg["eos_token_id"] is None
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] is None
    assert {t.dtype for t in load_file(str(ckpt / "model.safetensors")).values()} == {torch.bfloat16}
    tok = QwenTokenizer.from_pretrained(ckpt)
    assert tok.vocab_size == 1000 and tok.eos_token_ids == () and tok.pad_token_id is None
    rng = random.Random(1)
    ids = [rng.randrange(1, 1000) for _ in range(64)]
    assert tok.encode(tok.decode(ids)) == ids
    model = QwenForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert model.embed_tokens.shape[0] == 1000
    with pytest.raises(ValueError, match="tokenizer must be one of"):
        build_random_checkpoint(tmp_path / "other", tokenizer="sentencepiece", **TINY)
