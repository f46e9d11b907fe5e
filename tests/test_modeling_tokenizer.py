"""QwenTokenizer and IncrementalDetokenizer on a small byte-level BPE built in the test."""

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from modeling import IncrementalDetokenizer, QwenTokenizer, format_chat

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, héllo 世界! Streaming text one token at a time.",
    "You are a helpful assistant. What is the capital of France?",
]
MULTIBYTE = "héllo 世界 🙂 naïve café"


@pytest.fixture
def checkpoint(tmp_path):
    """tokenizer.json (byte-level BPE), tokenizer_config.json, generation_config.json, config.json."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}})
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "eos_token_id": 2}))
    return tmp_path


def test_special_tokens_and_eos(checkpoint):
    tok = QwenTokenizer.from_pretrained(checkpoint)
    assert tok.special_tokens == {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    assert tok.eos_token_ids == (2, 0)
    assert tok.pad_token_id == 0


def test_eos_from_int_and_missing_files(checkpoint):
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    (checkpoint / "config.json").unlink()
    assert QwenTokenizer.from_pretrained(checkpoint).eos_token_ids == (0, 2)


def test_round_trip(checkpoint):
    tok = QwenTokenizer.from_pretrained(checkpoint)
    for text in CORPUS + [MULTIBYTE, "unseen wørds ✓"]:
        ids = tok.encode(text)
        assert all(isinstance(i, int) for i in ids)
        assert tok.decode(ids) == text


def test_chat_format(checkpoint):
    tok = QwenTokenizer.from_pretrained(checkpoint)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = format_chat(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    assert format_chat(messages, add_generation_prompt=False) == text[: -len("<|im_start|>assistant\n")]
    ids = tok.chat(messages)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2  # special tokens matched as one id
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=True) == "system\nBe brief.\nuser\nHi!\nassistant\n"


def test_incremental_detokenizer_holds_back_partial_characters(checkpoint):
    tok = QwenTokenizer.from_pretrained(checkpoint)
    ids = tok.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # a token that only starts a multi-byte character emits nothing


def test_incremental_detokenizer_flush_emits_incomplete_tail(checkpoint):
    tok = QwenTokenizer.from_pretrained(checkpoint)
    ids = tok.encode("ok 🙂")
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in ids[:-1])
    assert streamed == "ok "
    assert detok.flush().endswith("\ufffd")


@pytest.mark.parametrize("file, content, message", [
    ("generation_config.json", {"eos_token_id": "2"}, "generation_config.json: eos_token_id must be a token id"),
    ("generation_config.json", {"eos_token_id": [2, 2.0]}, "generation_config.json: eos_token_id must be"),
    ("generation_config.json", {"eos_token_id": True}, "generation_config.json: eos_token_id must be"),
    ("config.json", {"model_type": "qwen3", "eos_token_id": {"id": 2}}, "config.json: eos_token_id must be"),
    ("config.json", {"model_type": "qwen3", "eos_token_id": -1}, "config.json: eos_token_id must be"),
    ("generation_config.json", [1, 2], r"generation_config.json is not a JSON object \(it holds a list\)"),
    ("tokenizer_config.json", "{not json", r"unreadable tokenizer_config.json \(JSONDecodeError: "),
    ("tokenizer_config.json", {"eos_token": 5}, "eos_token must be a string"),
])
def test_bad_config_files_name_the_problem(checkpoint, file, content, message):
    (checkpoint / file).write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ValueError, match=message):
        QwenTokenizer.from_pretrained(checkpoint)


def test_null_eos_and_broken_tokenizer_json(checkpoint):
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert QwenTokenizer.from_pretrained(checkpoint).eos_token_ids == (2,)
    (checkpoint / "tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match="^tokenizer.json: "):
        QwenTokenizer.from_pretrained(checkpoint)


def test_side_files_must_be_regular_and_bounded(checkpoint):
    """A directory in place of tokenizer_config.json, a link to nowhere as generation_config.json
    (not taken for an absent file), a tokenizer.json over TOKENIZER_LIMIT (sparse: refused from its
    size, nothing read). FIFOs and /dev/zero: tests/test_loading_errors.py, in a subprocess."""
    from modeling.model.files import TOKENIZER_LIMIT

    (checkpoint / "tokenizer_config.json").unlink()
    (checkpoint / "tokenizer_config.json").mkdir()
    with pytest.raises(ValueError, match=r"^tokenizer_config.json is not a regular file \(a directory\)$"):
        QwenTokenizer.from_pretrained(checkpoint)
    (checkpoint / "tokenizer_config.json").rmdir()
    (checkpoint / "generation_config.json").unlink()
    (checkpoint / "generation_config.json").symlink_to(checkpoint / "gone.json")
    with pytest.raises(ValueError, match=r"^generation_config.json is a link to .*gone.json, which does not exist$"):
        QwenTokenizer.from_pretrained(checkpoint)
    (checkpoint / "generation_config.json").unlink()
    assert QwenTokenizer.from_pretrained(checkpoint).eos_token_ids == (2,)  # absent files are fine
    with open(checkpoint / "tokenizer.json", "r+b") as f:
        f.truncate(TOKENIZER_LIMIT + 1)
    with pytest.raises(ValueError, match=r"^tokenizer.json is 512 MiB, larger than the 512 MiB this package reads of "
                                         r"such a file$"):
        QwenTokenizer.from_pretrained(checkpoint)


def test_encode_rejects_text_that_is_not_unicode(checkpoint):
    tok = QwenTokenizer.from_pretrained(checkpoint)
    with pytest.raises(ValueError, match=r"is not valid UTF-8 \(byte 0xe9 at character 3\)"):
        tok.encode("caf\udce9")  # how Python keeps an undecodable command-line byte
    with pytest.raises(ValueError, match=r"lone surrogate U\+D800"):
        tok.encode("\ud800")
    with pytest.raises(ValueError, match="must be a str"):
        tok.encode(b"bytes")


def test_incremental_detokenizer_pieces_add_up_to_the_full_decode(checkpoint):
    """Piece by piece, what a stream emits is the text of its ids so far (a prefix of the full
    decode, nothing held back but an incomplete character), with and without special tokens."""
    tok = QwenTokenizer.from_pretrained(checkpoint)
    for text in CORPUS + [MULTIBYTE, "<|im_start|>user\nHi 🙂<|im_end|>"]:
        ids = tok.encode(text)
        for skip in (False, True):
            detok, streamed = IncrementalDetokenizer(tok, skip_special_tokens=skip), ""
            for n, i in enumerate(ids, 1):
                streamed += detok.push(i)
                so_far = tok.decode(ids[:n], skip_special_tokens=skip)
                assert so_far.startswith(streamed) and "\ufffd" not in streamed, (text, skip, n)
                assert streamed == so_far or so_far.endswith("\ufffd"), (text, skip, n)
            assert streamed + detok.flush() == tok.decode(ids, skip_special_tokens=skip)
